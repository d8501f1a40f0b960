"""Jobs end (control/api/lifecycle.py, host_lib/membership.py): leave releases, leases run out,
a new run takes over a dead run's job id, a live one is named, heartbeats name a dead host.
In one process over loopback HTTP and UDP: the control service in userspace mode (no dataplane),
a userspace DPU worker learning jobs from it, AggregationClients joining through it."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from control.api import ControlServer, ControlService
from dosa.errors import DosaError
from dosa.join import request
from dpu_fw.discovery import control_discovery
from dpu_fw.worker import DpuWorker
from host_lib.client import AggregationClient, MissingWorkersError
from host_lib.membership import StaleJobError

pytestmark = pytest.mark.timeout(60)


def free_ports(n, kind=socket.SOCK_DGRAM):
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def plane():
    """(control address, DPU data port, service); a userspace DPU worker serving what it learns."""
    made = []

    def make(**svc_kw):
        dport = free_ports(1)[0]
        svc = ControlService(None, address="127.0.0.1", data_port=dport, control_port=0, **svc_kw)
        srv = ControlServer(svc, "127.0.0.1", 0).start()
        ctl = ("127.0.0.1", srv.port)
        w = DpuWorker([], 0, mode="userspace", bind=("127.0.0.1", dport),
                      discover=control_discovery(ctl, ("127.0.0.1", dport)))
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        made.append((srv, w, t))
        return ctl, dport, svc

    yield make
    for srv, w, t in made:
        srv.stop()
        w.stop()
        t.join(5)
        w.close()


def shape(job_id, dport, workers=2, numel=50_000):
    return {"job_id": job_id, "workers": workers, "numel": numel, "partition_size": 8192,
            "dpus": [{"address": "127.0.0.1", "port": dport}], "address": "127.0.0.1", "scale_exp": 8}


def clients(ctl, dport, job_id, n=2, **kw):
    ports = free_ports(n)
    out = [None] * n
    errs = []

    def one(i):
        try:
            out[i] = AggregationClient(worker_id=i, control=ctl, timeout=kw.get("timeout", 30.0),
                                       join=dict(shape(job_id, dport, n), port=ports[i]))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if errs:
        raise errs[0]
    return out


def rounds(cs, n=2, nnz=300, seed=0):
    """n exact rounds on every client at once; returns the errors raised (one per client or None)."""
    errs = [None] * len(cs)
    numel = cs[0].job.numel

    def inputs(r, w):
        rng = np.random.default_rng([seed, r, w])
        return np.sort(rng.choice(numel, nnz, replace=False)).astype(np.uint32), \
            rng.integers(-1000, 1000, nnz).astype(np.int32)

    def one(i):
        try:
            for r in range(n):
                idx, q = inputs(r, i)
                gi, gs = cs[i].allreduce_sparse(idx, q, 8)
                total = np.zeros(numel, np.int64)
                for w in range(len(cs)):
                    a, b = inputs(r, w)
                    np.add.at(total, a.astype(np.int64), b.astype(np.int64))
                nz = np.flatnonzero(total)
                assert np.array_equal(gi.astype(np.int64), nz) and np.array_equal(gs.astype(np.int64), total[nz])
        except BaseException as e:  # noqa: BLE001
            errs[i] = e

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(cs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(40)
    return errs


def test_the_last_worker_to_leave_releases_the_job_and_the_same_id_runs_again(plane):
    ctl, dport, svc = plane()
    for attempt in range(3):  # the same job id, run after run
        cs = clients(ctl, dport, 41)
        view = request(ctl, "GET", "/v1/jobs/41")
        assert view["complete"] and view["lease"]["members"]["0"]["alive"] is True
        assert rounds(cs) == [None, None], attempt
        for c in cs:
            c.close()
        with pytest.raises(DosaError, match="released \\(every worker left\\)") as e:
            request(ctl, "GET", "/v1/jobs/41")
        assert e.value.status == 404
    assert svc.jobs == {}


def test_a_crashed_runs_lease_runs_out(plane):
    ctl, dport, svc = plane(lease_s=0.6, dead_after=0.3)
    for w in (0, 1):  # joined with sessions, then never a heartbeat: a run that died
        request(ctl, "POST", "/v1/join", dict(shape(42, dport), worker_id=w, port=20000 + w,
                                              session=f"s{w}"))
    deadline = time.monotonic() + 10
    while 42 in svc.jobs and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 42 not in svc.jobs
    with pytest.raises(DosaError, match="lease ran out"):
        request(ctl, "POST", "/v1/heartbeat", {"job_id": 42, "worker_id": 0, "session": "s0"})


def test_members_without_a_session_hold_no_lease(plane):
    ctl, dport, svc = plane(lease_s=0.3, dead_after=0.2)
    request(ctl, "POST", "/v1/join", dict(shape(43, dport, workers=1), worker_id=0, port=20000))
    time.sleep(1.0)
    assert 43 in svc.jobs and request(ctl, "GET", "/v1/jobs/43")["lease"]["expires_in_s"] is None


def test_a_new_run_takes_over_a_dead_runs_job_and_the_old_one_is_told(plane):
    ctl, dport, svc = plane(dead_after=0.3)
    old = [request(ctl, "POST", "/v1/join", dict(shape(44, dport), worker_id=w, port=20000 + w,
                                                 session=f"old{w}")) for w in (0, 1)]
    time.sleep(0.5)  # both silent past dead_after
    new = request(ctl, "POST", "/v1/join", dict(shape(44, dport), worker_id=0, port=20000, session="new0"))
    assert new["generation"] != old[0]["generation"]
    assert [h["worker_id"] for h in new["hosts"]] == [0]  # a fresh job: the old members are gone
    with pytest.raises(DosaError, match="re-created by another run"):
        request(ctl, "POST", "/v1/heartbeat", {"job_id": 44, "worker_id": 1, "session": "old1",
                                               "generation": old[1]["generation"]})


def test_a_rank_held_by_a_live_run_is_a_409_naming_it(plane):
    ctl, dport, svc = plane(dead_after=0.3)
    request(ctl, "POST", "/v1/join", dict(shape(45, dport), worker_id=0, port=20000, session="a"))
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            request(ctl, "POST", "/v1/heartbeat", {"job_id": 45, "worker_id": 0, "session": "a"})
            time.sleep(0.05)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        with pytest.raises(DosaError, match="held by a live run \\(127.0.0.1:20000, heartbeat") as e:
            request(ctl, "POST", "/v1/join", dict(shape(45, dport), worker_id=0, port=20000, session="b"))
        assert e.value.status == 409
    finally:
        stop.set()
        t.join(2)


def test_a_dead_host_is_named_from_heartbeats_before_the_round_timeout(plane):
    ctl, dport, svc = plane(dead_after=0.5)
    cs = clients(ctl, dport, 46, timeout=60.0)  # the no-progress timeout cannot be what speaks
    assert rounds(cs, 1) == [None, None]
    m = cs[1].membership  # host 1 "crashes": no more heartbeats, no leave, no more rounds
    m._left = True
    m._stop.set()
    errs = rounds(cs[:1], 1, seed=7)
    assert isinstance(errs[0], MissingWorkersError), errs
    assert errs[0].missing == [1] and "worker 1 (127.0.0.1:" in str(errs[0]) and "is dead" in str(errs[0])
    for c in cs:
        c.close()


def test_a_released_job_under_a_running_client_is_named_as_the_cause(plane):
    ctl, dport, svc = plane()
    cs = clients(ctl, dport, 47)
    assert rounds(cs, 1) == [None, None]
    request(ctl, "DELETE", "/v1/jobs/47")
    time.sleep(1.0)  # the DPU worker polls its jobs twice a second: then it serves 47 no more
    errs = rounds(cs, 1, seed=3)
    assert all(isinstance(e, StaleJobError) for e in errs), errs
    assert "job 47 does not exist any more: it was released (removed by an admin)" in str(errs[0])
    for c in cs:
        c.close()


def test_a_joiner_waiting_for_the_others_is_alive_past_dead_after(plane):
    """Ranks start seconds apart (importing torch): the first one, blocked in the rendezvous, must
    not look dead to a later joiner, or its job would be taken over under it."""
    ctl, dport, svc = plane(dead_after=0.3)
    got = {}

    def first():
        got[0] = request(ctl, "POST", "/v1/join", dict(shape(48, dport), worker_id=0, port=20000,
                                                       session="r0", wait=10))

    t = threading.Thread(target=first)
    t.start()
    time.sleep(1.0)  # three times dead_after
    second = request(ctl, "POST", "/v1/join", dict(shape(48, dport), worker_id=1, port=20001,
                                                   session="r1", wait=10))
    t.join(10)
    assert second["complete"] and got[0]["generation"] == second["generation"]
