"""A job many times larger than the DPU's aggregation pool runs exact through the XDP dataplane:
the pool is shrunk (`dosa ctl serve --pool-buffers`) to 7 buffers, the job has 400k entries in 98
partitions (one buffer pair per partition would need 196 buffers, 28x the pool), and holds 2
aggregation slots (4 buffers). Hosts join through the control plane, which
refuses a window that can never fit (507, with the numbers) and makes one that fits once another
job ends wait (503, retried by the joiners). Real namespaces, real XDP, real hosts."""
from __future__ import annotations

import subprocess
import uuid

import pytest
from allreduce_lab import Lab

pytestmark = [pytest.mark.root]

POOL = 7
PSIZE = 4096
NUMEL = 400_000


@pytest.fixture(scope="module")
def lab():
    created = []
    tag = uuid.uuid4().hex[:6]

    def make(name):
        ns = f"sl{tag}{name}"[:15]
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        created.append(ns)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        return ns

    lab = None
    try:
        lab = Lab(make, hosts=3, dpus=1, subnet="10.231.9")
        lab.start_control(0, "xdp", pool_buffers=POOL)
        lab.workers = [lab.start_dpu_control(0, "xdp")]
        yield lab
    finally:
        if lab is not None:
            lab.close()
        for ns in reversed(created):
            subprocess.run(f"ip netns pids {ns} | xargs -r kill -9", shell=True, check=False)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def maps(lab):
    from dataplane.maps import DataplaneMaps

    return DataplaneMaps.open(lab.pin_dirs[0])


@pytest.mark.timeout(300)  # the first test also pays for the module's lab (one BCC compile)
@pytest.mark.parametrize("job_id,loss,dup", [(61, 0.0, 0.0), (62, 3.0, 1.0)])
def test_a_job_twelve_times_the_pool_is_exact(lab, job_id, loss, dup):
    with maps(lab) as dp:
        assert len(dp.pool) == POOL
        before = dp.counters()
    if loss or dup:
        lab.impair(loss, dup)
    try:
        res = lab.run_hosts(None, timeout=150, extra=[
            "--rounds", "4", "--nnz", "4000", "--shuffle", "--timeout", "30",
            *lab.control_args(job_id=job_id, numel=NUMEL, partition_size=PSIZE, slots=2)])
    finally:
        if loss or dup:
            lab.impair(0, 0)
    for r in res:
        assert "error" not in r, f"host {r.get('worker')}: {r.get('error')}\n{lab.logs()}"
        assert r["mismatches"] == [] and r["rounds_ok"] == 4, r
    with maps(lab) as dp:
        c = {k: v - before[k] for k, v in dp.counters().items()}
        job = dp.job_info(job_id)
    if job is not None:  # (the lifecycle may already have released it)
        assert job.slots == 2 and job.pool_len == 2 * 2
    assert c["completions"] == 4 * -(-NUMEL // PSIZE)
    if not (loss or dup):
        # hosts never send a partition whose slot is still held, and nothing arrives late
        assert c["round_too_new"] == 0 and c["round_too_old"] == 0, c


@pytest.mark.timeout(120)
def test_a_window_that_can_never_fit_is_refused_with_the_numbers(lab):
    res = lab.run_hosts(None, timeout=60, extra=[
        "--rounds", "1", "--timeout", "10",
        *lab.control_args(job_id=63, numel=NUMEL, partition_size=PSIZE, slots=8)])
    for r in res:
        err = r.get("error", "")
        assert "job 63 needs 8 aggregation slots" in err and "16 pool buffers" in err, r
        assert "can never fit" in err and "at most 3 slots" in err, r


@pytest.mark.timeout(180)
def test_a_job_that_fits_once_another_ends_waits_for_it(lab):
    """Job 64 holds 3 slots (6 of the pool's 7 buffers); job 65 (2 slots, 4 buffers)
    is refused with a 503 (the message naming job 64 is checked in tests/unit/test_alloc.py and
    test_join_wait.py), its hosts wait (retrying the join), and once job 64 is removed they run
    exact."""
    import time

    from control.controller import Controller

    with Controller(lab.pin_dirs[0]) as ctl:
        ctl.add_job(64, workers=1, numel=NUMEL, partition_size=PSIZE, slots=3)  # 6 of 7 buffers
        try:
            ps = lab.start_hosts(None, extra=[
                "--rounds", "2", "--nnz", "4000", "--timeout", "30",
                *lab.control_args(job_id=65, numel=NUMEL, partition_size=PSIZE, slots=2)])
            time.sleep(4)
            assert all(p.poll() is None for p in ps), lab.logs()  # waiting, not failed
            with maps(lab) as dp:
                assert dp.job_info(65) is None  # refused so far: its window does not fit yet
        finally:
            ctl.remove_job(64)
    res = lab.wait_hosts(ps, timeout=120)
    for r in res:
        assert "error" not in r, f"host {r.get('worker')}: {r.get('error')}\n{lab.logs()}"
        assert r["mismatches"] == [] and r["rounds_ok"] == 2, r
