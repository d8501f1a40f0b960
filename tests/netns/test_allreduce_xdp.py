"""Allreduce through the XDP dataplane, in real namespaces: `dosa ctl serve` attaches the dataplane
to each DPU's interface and serves the join API, `dosa dpu run --mode xdp` emits the results from
the pinned maps, 4 hosts join through the control plane and check every round against numpy.

One lab (4 hosts, 2 DPUs) serves the whole module, each test with its own job id: compiling the
dataplane costs tens of seconds per DPU on a loaded 2-core machine, so it is paid once. A job that
names only DPU 0 is the 1-DPU case.
"""
from __future__ import annotations

import subprocess
import time
import uuid

import pytest
from allreduce_lab import Lab

pytestmark = [pytest.mark.root]


@pytest.fixture(scope="module")
def lab():
    created = []
    tag = uuid.uuid4().hex[:6]

    def make(name):
        ns = f"dx{tag}{name}"[:15]
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        created.append(ns)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        return ns

    lab = None
    try:
        lab = Lab(make, hosts=4, dpus=2)
        for d in range(2):
            lab.start_control(d, "xdp")
        # every worker asks DPU 0's control plane (the one hosts join through): only its registry
        # has the job's density, which gtopk's k needs; the maps of DPU 1 have the rest
        lab.workers = [lab.start_dpu_control(d, "xdp", control_dpu=0) for d in range(2)]
        yield lab
    finally:
        if lab is not None:
            lab.close()
        for ns in reversed(created):
            subprocess.run(f"ip netns pids {ns} | xargs -r kill -9", shell=True, check=False)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def assert_all_exact(results, rounds, lab):
    for r in results:
        assert "error" not in r, f"host {r.get('worker')}: {r.get('error')}\nall: {results}\n{lab.logs()}"
        assert r["mismatches"] == [], r
        assert r["rounds_ok"] == rounds, r


@pytest.mark.timeout(200)  # the first test also pays for the module's lab
@pytest.mark.parametrize("job_id,dpus,mode", [(21, 1, "sum"), (22, 2, "sum"), (23, 2, "gtopk")])
def test_xdp_allreduce_is_exact(lab, job_id, dpus, mode):
    res = lab.run_hosts(None, timeout=60, extra=[
        "--rounds", "8", *lab.control_args(job_id=job_id, mode=mode, density=0.005, dpus=dpus)])
    assert_all_exact(res, 8, lab)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("job_id,loss", [(31, 1.0), (32, 5.0)])
def test_xdp_allreduce_exact_under_loss_duplication_and_reordering(lab, job_id, loss):
    lab.impair(loss, 1.0)
    try:
        res = lab.run_hosts(None, timeout=90, extra=["--rounds", "10", "--shuffle",
                                                     *lab.control_args(job_id=job_id)])
    finally:
        lab.impair(0, 0)
    assert_all_exact(res, 10, lab)
    assert sum(r["stats"]["retransmissions"] for r in res) > 0


@pytest.mark.timeout(200)
def test_xdp_dead_host_is_named(lab):
    timeout = 3.0
    res = lab.run_hosts(None, timeout=60,
                        extra=["--rounds", "5", "--timeout", str(timeout), *lab.control_args(job_id=41)],
                        per_host=lambda w: ["--exit-before-round", "3"] if w == 1 else [])
    for r in (res[0], res[2], res[3]):
        assert r["rounds_ok"] == 3, r
        assert r["missing"] == [1], r
        assert "worker(s) [1]" in r["error"]


@pytest.mark.timeout(200)
def test_xdp_dpu_worker_killed_and_restarted_continues_exact(lab):
    hosts = lab.start_hosts(None, extra=["--rounds", "40", "--round-gap", "0.05", "--timeout", "20",
                                         *lab.control_args(job_id=51)])
    time.sleep(2.5)  # past the join, rounds running
    lab.kill(lab.workers[0])
    time.sleep(0.3)
    lab.workers[0] = lab.start_dpu_control(0, "xdp", control_dpu=0)
    res = lab.wait_hosts(hosts, timeout=90)
    assert_all_exact(res, 40, lab)
