"""A completion event can reach the DPU worker before its discovery has seen the job (the dataplane
had it installed first: a job's first partition may complete within milliseconds). The worker
keeps such events (``PARKED_S``) and handles them once it serves the job, instead of losing them
(their results would then go out only when a host asks, after its retransmission timer)."""
from __future__ import annotations

import socket

import pytest

import numpy as np

from dosa.job import JobConfig
from dosa.packetizer import parse_batch
from dosa.wire import PacketBatch, PacketType
from dpu_fw import policy
from dpu_fw.worker import DpuWorker

pytestmark = pytest.mark.timeout(30)


def _ports(n):
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    return socks, ports


@pytest.fixture
def late_worker():
    """A userspace DPU worker whose discovery finds nothing until the test installs the job; the
    hosts' sockets are bound, so the results it sends can be read."""
    socks, ports = _ports(3)
    for s in socks[:2]:
        s.settimeout(2.0)
    job = JobConfig(job_id=5, numel=20_000, hosts=[("127.0.0.1", p) for p in ports[:2]],
                    dpus=[("127.0.0.1", ports[2])], partition_size=8192, mode="sum",
                    density=0.01, scale_exp=8, mtu=1500)
    socks[2].close()  # the worker binds the DPU's port
    found: list[JobConfig] = []
    w = DpuWorker([], 0, mode="userspace", bind=("127.0.0.1", ports[2]), discover=lambda: list(found))
    yield w, job, found, socks[:2]
    w.close()
    for s in socks[:2]:
        s.close()


def _complete(w, *records):
    """Completion records reaching the worker's engine (as its ring would hand them), and what the
    worker's step does with those of a job it does not serve: park them."""
    w.engine.handle(records)
    w.discovery.park(w.engine.take_unknown())


def test_a_completion_before_discovery_is_handled_once_the_job_is_served(late_worker):
    w, job, found, hosts = late_worker
    _complete(w, (job.job_id, 1, 0, job.scale_exp))
    assert w.discovery.stats["completion_unknown"] == 0 and job.job_id in w.discovery.parked
    found.append(job)
    w.discovery._next = 0.0
    w._discover()
    assert job.job_id in w.jobs and job.job_id in w.discovery.parked
    # the sums the dataplane merged for partition 1, round 0, and its touched list, before the
    # event came
    rt = w.jobs[job.job_id]
    slot, gen = rt.state.occupant(int(rt.local_of[1]), 0)
    b = rt.state.bufs[slot * 2 + (gen & 1)]
    b["sums"][[0, 7]] = [5, -3]
    b["list"].view(np.uint16)[:4] = [0, 7, 7, 0]
    rt.state.pstate["touched"][slot, gen & 1] = 4
    w.engine.handle(w.discovery.unpark(w.jobs))
    assert not w.discovery.parked and w.discovery.stats["completion_parked"] == 1
    assert rt.counters()["completions"] == 1 and w.discovery.stats["completion_unknown"] == 0
    for s in hosts:  # every host got the partition's result without asking for it
        r = parse_batch(PacketBatch.from_packets([s.recv(4096)]))
        assert r.headers["type"][0] == PacketType.SPARSE_RESULT and r.headers["partition"][0] == 1
        assert r.indices.tolist() == [8192, 8199] and r.values.tolist() == [5, -3]


def test_completions_of_a_job_never_served_are_counted_lost_after_a_while(late_worker, monkeypatch):
    w, job, found, hosts = late_worker
    _complete(w, (77, 0, 0, 8), (77, 1, 0, 8))
    w.discovery.unpark(w.jobs)
    assert w.discovery.stats["completion_unknown"] == 0 and 77 in w.discovery.parked  # within PARKED_S
    monkeypatch.setattr(policy, "PARKED_S", 0.0)
    assert w.discovery.unpark(w.jobs) == []
    assert w.discovery.stats["completion_unknown"] == 2 and not w.discovery.parked


def test_parking_is_bounded(late_worker, monkeypatch):
    w, job, found, hosts = late_worker
    monkeypatch.setattr(policy, "PARKED_MAX", 3)
    _complete(w, *[(77, p, 0, 8) for p in range(5)])
    assert len(w.discovery.parked[77][1]) == 3 and w.discovery.stats["completion_unknown"] == 2
