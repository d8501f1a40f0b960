"""control.Controller: attach in a namespace, jobs from a fixed pool (admission, isolation), workers,
counters, a restarted controller sees the live state, and detach leaves nothing behind."""
from __future__ import annotations

import os
import subprocess
import uuid

import numpy as np
import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]

SMALL = dict(pool_buffers=16, pstate_slots=64, wstate_slots=1024, max_jobs=4, max_flows=64)


@pytest.fixture(scope="module")
def ctl():
    """One loaded instance for the module (BCC compiles in seconds)."""
    from control.controller import Controller
    from dataplane.loader import LoadConfig

    c = Controller(f"ctltest-{uuid.uuid4().hex[:6]}")
    c.load(LoadConfig(**SMALL))
    try:
        yield c
    finally:
        c.destroy()


@pytest.fixture
def clean(ctl):
    for j in ctl.jobs():
        ctl.remove_job(j.job_id)
    return ctl


def test_jobs_get_disjoint_regions_and_admission_refuses_when_full(clean):
    from control.alloc import AdmissionError

    a = clean.add_job(1, workers=2, numel=20000, partition_size=8192)  # 3 partitions x2 x8192
    b = clean.add_job(2, workers=4, numel=10000, partition_size=4096, num_dpus=2, dpu_index=1)
    # two buffers a slot, whatever the partition size (each holds up to 65536 sums and their list)
    assert a.pool_len == 3 * 2 and b.num_owned == 1 and b.pool_len == 2
    ra = range(a.pool_off, a.pool_off + a.pool_len)
    rb = range(b.pool_off, b.pool_off + b.pool_len)
    assert not set(ra) & set(rb)
    with pytest.raises(AdmissionError, match="aggregation slots"):
        clean.add_job(3, workers=2, numel=6 * 65536, partition_size=65536)  # 12 of 16 - 8 left
    clean.remove_job(1)  # its region is free again and reused
    c = clean.add_job(3, workers=2, numel=20000, partition_size=8192)
    assert c.pool_off == a.pool_off


def test_bad_job_requests_are_clear_errors(clean):
    from dosa.errors import DosaError

    clean.add_job(5, workers=2, numel=100, partition_size=50)
    for kw, msg in [(dict(job_id=5), "already installed"), (dict(job_id=0), "job id"),
                    (dict(workers=65), "workers"), (dict(dpu_index=2, num_dpus=2), "DPU index"),
                    (dict(mode="dense"), "mode"), (dict(scale_exp=99), "scale_exp"),
                    (dict(numel=10**6, partition_size=1), "partitions")]:
        args = dict(job_id=6, workers=2, numel=100, partition_size=50)
        args.update(kw)
        with pytest.raises(DosaError, match=msg):
            clean.add_job(args.pop("job_id"), **args)
    with pytest.raises(DosaError, match="not installed"):
        clean.remove_job(77)
    with pytest.raises(DosaError, match="worker id"):
        clean.add_worker(5, 2, "10.0.0.1", 4000)
    with pytest.raises(DosaError, match="IPv4"):
        clean.add_worker(5, 1, "not-an-ip", 4000)


def test_max_jobs_is_an_admission_error(clean):
    from control.alloc import AdmissionError

    for i in range(SMALL["max_jobs"]):
        clean.add_job(10 + i, workers=1, numel=16, partition_size=16)
    with pytest.raises(AdmissionError, match="maximum"):
        clean.add_job(99, workers=1, numel=16, partition_size=16)


def test_workers_and_restart_sees_live_state(clean):
    from control.controller import Controller

    clean.add_job(7, workers=3, numel=1000, partition_size=500)
    clean.add_worker(7, 0, "10.1.0.1", 17791)
    clean.add_worker(7, 2, "10.1.0.3", 17792)
    clean.maps.buffer(7, 0, 0)[:3] = [1, 2, 3]
    with Controller(clean.instance) as again:  # a restarted control process
        assert [j.job_id for j in again.jobs()] == [7]
        assert again.workers(7) == {(7, 0): ("10.1.0.1", 17791), (7, 2): ("10.1.0.3", 17792)}
        assert list(again.maps.buffer(7, 0, 0)[:3]) == [1, 2, 3]
        again.remove_worker(7, 0)
    assert clean.workers(7) == {(7, 2): ("10.1.0.3", 17792)}
    clean.remove_job(7)  # flows and memory go with it
    assert clean.workers() == {} and not np.any(clean.maps.pool["sums"][:2])


def test_stats_names_every_drop_reason(clean):
    from dataplane.reasons import DROP_REASONS, name

    st = clean.stats()
    assert set(st["drops"]) == {name(r) for r in DROP_REASONS}
    assert {"merged", "completions", "pass_not_dosa"} <= set(st["outcomes"])


def test_attach_in_namespace_and_detach_leave_nothing(netns_factory):
    """A separate instance: attach loads it, detach of the last interface unloads it."""
    from control.controller import Controller
    from dataplane import libbpf, loader
    from dataplane.loader import LoadConfig
    from control.netns import run_in_netns
    from dosa.errors import DosaError
    import socket

    ns = netns_factory("dp")
    subprocess.run(["ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "va", "up"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "vb", "up"], check=True)
    inst = f"ctlattach-{uuid.uuid4().hex[:6]}"
    c = Controller(inst)
    try:
        with pytest.raises(DosaError, match="no network interface 'nope0'"):
            c.attach("nope0", netns=ns)
        assert not loader.is_loaded(inst)
        c.attach("va", netns=ns, config=LoadConfig(**SMALL))
        prog_id = run_in_netns(ns, lambda: libbpf.xdp_query_id(socket.if_nametoindex("va")))
        assert prog_id > 0 and loader.is_loaded(inst)
        assert c.attachments() == [{"ifname": "va", "netns": ns, "mode": "auto"}]
        assert c.maps.ports() == [17791]
        c.detach("va", netns=ns)
        assert run_in_netns(ns, lambda: libbpf.xdp_query_id(socket.if_nametoindex("va"))) == 0
        assert not os.path.exists(loader.pin_dir(inst))
        assert not any(inst in f for f in os.listdir("/run/dosa"))
    finally:
        if loader.is_loaded(inst):
            c.destroy()
