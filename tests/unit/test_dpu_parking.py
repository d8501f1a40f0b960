"""A completion event can reach the DPU worker before its discovery has seen the job (the dataplane
had it installed first: a job's first partition may complete within milliseconds). The worker
keeps such events (``PARKED_S``) and handles them once it serves the job, instead of losing them
(their results would then go out only when a host asks, after its retransmission timer)."""
from __future__ import annotations

import socket

import pytest

from dataplane.maps import Completion
from dosa.packetizer import parse_batch
from dosa.wire import PacketBatch, PacketType
from dosa.job import JobConfig
from dpu_fw import worker as worker_mod
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


def test_a_completion_before_discovery_is_handled_once_the_job_is_served(late_worker):
    w, job, found, hosts = late_worker
    w._on_completions([Completion(job.job_id, 1, 0, job.scale_exp)])
    assert w.stats["completion_unknown"] == 0 and job.job_id in w._parked
    found.append(job)
    w._next_discover = 0.0
    w._discover()
    assert job.job_id in w.jobs and job.job_id in w._parked
    # the sums the dataplane merged for partition 1, round 0 (parity 0), before the event came
    rt = w.jobs[job.job_id]
    lp = int(rt.local_of[1])
    rt.backend.state.scale_of[lp, 0] = job.scale_exp
    rt.backend.state.buf[lp, 0, [0, 7]] = [5, -3]
    w._unpark()
    assert not w._parked and w.stats["completion_parked"] == 1 and w.stats["completions"] == 1
    assert w.stats["completion_unknown"] == 0
    for s in hosts:  # every host got the partition's result without asking for it
        b = PacketBatch.from_packets([s.recv(4096)])
        r = parse_batch(b)
        assert r.headers["type"][0] == PacketType.SPARSE_RESULT and r.headers["partition"][0] == 1
        assert r.indices.tolist() == [8192, 8199] and r.values.tolist() == [5, -3]


def test_completions_of_a_job_never_served_are_counted_lost_after_a_while(late_worker, monkeypatch):
    w, job, found, hosts = late_worker
    w._on_completions([Completion(77, 0, 0, 8), Completion(77, 1, 0, 8)])
    w._unpark()
    assert w.stats["completion_unknown"] == 0 and 77 in w._parked  # still within PARKED_S
    monkeypatch.setattr(worker_mod, "PARKED_S", 0.0)
    w._unpark()
    assert w.stats["completion_unknown"] == 2 and not w._parked


def test_parking_is_bounded(late_worker, monkeypatch):
    w, job, found, hosts = late_worker
    monkeypatch.setattr(worker_mod, "PARKED_MAX", 3)
    w._on_completions([Completion(77, p, 0, 8) for p in range(5)])
    assert len(w._parked[77][1]) == 3 and w.stats["completion_unknown"] == 2
