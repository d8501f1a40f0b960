"""The join API over real HTTP: two DPUs (two dataplane instances, servers on 127.0.0.1 and
127.0.0.2), hosts joining through DPU 0, flows installed in BOTH dataplanes, clear errors."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import urllib.request
import uuid

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]

SMALL = dict(pool_buffers=16, pstate_slots=256, wstate_slots=4096, max_jobs=8, max_flows=256)
ADDRS = ("127.0.0.1", "127.0.0.2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dpus():
    from control.api import ControlServer, ControlService
    from control.controller import Controller
    from dataplane.loader import LoadConfig

    port = _free_port()
    ctls, servers = [], []
    try:
        for i, a in enumerate(ADDRS):
            c = Controller(f"apitest{i}-{uuid.uuid4().hex[:6]}")
            ctls.append(c)
            c.load(LoadConfig(**SMALL))
            servers.append(ControlServer(ControlService(c, address=a, control_port=port), a, port).start())
        yield ctls, servers
    finally:
        for s in servers:
            s.stop()
        for c in ctls:
            c.destroy()


@pytest.fixture
def api(dpus):
    ctls, servers = dpus
    for s in servers:
        s.service.jobs.clear()
    for c in ctls:
        for j in c.jobs():
            c.remove_job(j.job_id)
    return ctls, servers[0].address


def test_first_joiner_creates_the_job_on_every_dpu_and_join_returns_a_jobconfig(api):
    from dosa.join import join

    ctls, url = api
    shape = dict(numel=5000, workers=2, dpus=list(ADDRS), partition_size=1000, scale_exp=12)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(join, url, w, job_id=41, address=f"10.2.0.{w + 1}", port=17791, wait=20,
                          **shape) for w in (1, 0)]
        cfgs = [f.result(30) for f in futs]
    for cfg in cfgs:
        assert cfg.job_id == 41 and cfg.numel == 5000 and cfg.partition_size == 1000
        assert cfg.hosts == [("10.2.0.1", 17791), ("10.2.0.2", 17791)]
        assert cfg.dpus == [("127.0.0.1", 17791), ("127.0.0.2", 17791)] and cfg.scale_exp == 12
    for i, c in enumerate(ctls):
        (j,) = c.jobs()
        assert (j.job_id, j.dpu_index, j.num_dpus, j.num_owned) == (41, i, 2, [3, 2][i])
        assert c.workers(41) == {(41, 0): ("10.2.0.1", 17791), (41, 1): ("10.2.0.2", 17791)}


def _call(url, method, path, body=None, raw=None):
    from dosa.join import request

    if raw is not None:
        req = urllib.request.Request(f"http://{url}{path}", data=raw, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    try:
        return 200, request(url, method, path, body)
    except Exception as e:  # DosaError carries the status
        return getattr(e, "status", None), {"error": str(e)}


def test_bad_requests_get_clear_errors(api):
    ctls, url = api
    ok = {"job_id": 50, "address": "10.3.0.1", "numel": 100, "workers": 2, "dpus": [ADDRS[0]]}
    assert _call(url, "POST", "/v1/join", ok)[0] == 200
    cases = [
        ({"job_id": 51, "address": "10.3.0.1"}, 404, "does not exist"),
        ({"job_id": 50, "address": "10.3.0.9", "worker_id": 2}, 400, "outside 0..1"),
        ({"job_id": 50, "address": "10.3.0.9", "worker_id": 0}, 409, "already joined"),
        ({"job_id": 50, "address": "10.3.0.9", "numel": 101}, 409, "numel"),
        ({"job_id": 50, "address": "nope"}, 400, "IPv4"),
        ({"job_id": "x", "address": "10.3.0.9"}, 400, "integer"),
        ({"address": "10.3.0.9"}, 400, "job_id"),
        ({"job_id": 52, "address": "10.3.0.1", "numel": 100, "workers": 99}, 400, "workers"),
    ]
    for body, status, msg in cases:
        st, resp = _call(url, "POST", "/v1/join", body)
        assert st == status and msg in resp["error"], (body, st, resp)
    assert _call(url, "POST", "/v1/join", {"job_id": 50, "address": "10.3.0.2"})[0] == 200
    st, resp = _call(url, "POST", "/v1/join", {"job_id": 50, "address": "10.3.0.3"})
    assert st == 409 and "full" in resp["error"]
    st, resp = _call(url, "POST", "/v1/join", raw=b"{not json")
    assert st == 400 and "JSON" in resp["error"]
    st, resp = _call(url, "POST", "/v1/join", raw=b"[1, 2]")
    assert st == 400 and "object" in resp["error"]
    st, resp = _call(url, "GET", "/v1/nothing")
    assert st == 404


def test_join_waits_for_everyone_and_times_out_naming_missing_ranks(api):
    ctls, url = api
    body = {"job_id": 60, "address": "10.4.0.1", "worker_id": 0, "numel": 100, "workers": 3,
            "dpus": [ADDRS[0]], "wait": 0.5}
    st, resp = _call(url, "POST", "/v1/join", body)
    assert st == 504 and "missing ranks [1, 2]" in resp["error"]


def test_pool_full_is_an_admission_error_and_nothing_half_installed(api):
    ctls, url = api
    st, resp = _call(url, "POST", "/v1/jobs", {"job_id": 70, "workers": 2, "numel": 1 << 20,
                                               "partition_size": 1 << 15, "dpus": list(ADDRS)})
    assert st in (502, 507) and "aggregation slots" in resp["error"]


def test_leave_and_delete_remove_flows_and_jobs_everywhere(api):
    ctls, url = api
    shape = {"numel": 100, "workers": 2, "dpus": list(ADDRS)}
    assert _call(url, "POST", "/v1/join", {"job_id": 80, "address": "10.5.0.1", **shape})[0] == 200
    assert _call(url, "POST", "/v1/join", {"job_id": 80, "address": "10.5.0.2"})[0] == 200
    assert all(len(c.workers(80)) == 2 for c in ctls)
    assert _call(url, "POST", "/v1/leave", {"job_id": 80, "worker_id": 1})[0] == 200
    assert all(c.workers(80) == {(80, 0): ("10.5.0.1", 17791)} for c in ctls)
    st, resp = _call(url, "GET", "/v1/jobs/80")
    assert st == 200 and [h["worker_id"] for h in resp["hosts"]] == [0]
    assert _call(url, "DELETE", "/v1/jobs/80")[0] == 200
    assert all(c.jobs() == [] and c.workers() == {} for c in ctls)
    st, resp = _call(url, "GET", "/v1/stats")
    assert st == 200 and "bad_source" in resp["drops"]


def test_a_restarted_server_keeps_its_registry(api, tmp_path):
    """The registry is saved on every change: a server restarted after a crash answers for the jobs
    still installed in its dataplane (and forgets those that are not)."""
    from control.api import ControlService

    ctls, _ = api
    state = str(tmp_path / "api.json")
    s1 = ControlService(ctls[0], address=ADDRS[0], state_path=state)
    s1.join({"job_id": 90, "address": "10.6.0.1", "numel": 100, "workers": 2, "dpus": [ADDRS[0]]})
    s1.join({"job_id": 91, "address": "10.6.0.1", "numel": 100, "workers": 1, "dpus": [ADDRS[0]]})
    ctls[0].remove_job(91)  # gone from the dataplane while the server was down
    s2 = ControlService(ctls[0], address=ADDRS[0], state_path=state)
    assert sorted(s2.jobs) == [90]
    v = s2.join({"job_id": 90, "address": "10.6.0.2"})
    assert v["complete"] and [h["address"] for h in v["hosts"]] == ["10.6.0.1", "10.6.0.2"]


def test_every_dpu_registry_has_the_full_job_in_xdp_mode_too(api):
    """DPU 1's control plane answers the same view as DPU 0's (density, mode, dpus, hosts): its DPU
    worker does not fall back to --gtopk-density."""
    from dosa.join import request
    from dataplane.maps import MODE_GTOPK

    ctls, url = api
    shape = {"numel": 3000, "workers": 2, "dpus": list(ADDRS), "partition_size": 1000, "mode": "gtopk",
             "density": 0.002}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(_call, url, "POST", "/v1/join",
                          {"job_id": 95, "worker_id": w, "address": f"10.7.0.{w + 1}", "wait": 10, **shape})
                for w in (0, 1)]
        assert [f.result(20)[0] for f in futs] == [200, 200]
    port = url.rsplit(":", 1)[1]
    v0, v1 = (request(f"{a}:{port}", "GET", "/v1/jobs/95") for a in ADDRS)
    assert v1 == v0 and v1["density"] == 0.002 and v1["mode"] == "gtopk" and v1["complete"]
    assert [h["address"] for h in v1["hosts"]] == ["10.7.0.1", "10.7.0.2"]
    assert [(j.job_id, j.mode) for c in ctls for j in c.jobs()] == [(95, MODE_GTOPK)] * 2
    assert _call(url, "DELETE", "/v1/jobs/95")[0] == 200
    assert _call(f"{ADDRS[1]}:{port}", "GET", "/v1/jobs/95")[0] == 404
