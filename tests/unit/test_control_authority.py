"""Per-job authority (control/api/authority.py), in one process over loopback HTTP with a secret:
every host holds the same host key, so what makes a caller member w of a job is w's session.
Another's session (or none) cannot leave, heartbeat or move w; its own re-join can; the operator
can do all of it; the DPU-to-DPU endpoints take the peer key only. A restarted server keeps each
member's session (as a digest, in a 0600 file), so no one adopts a member by beating first."""
from __future__ import annotations

import json
import os
import stat

import pytest

from control.api import ControlServer, ControlService
from dosa import auth
from dosa.errors import DosaError
from dosa.join import request

pytestmark = pytest.mark.timeout(60)

SECRET = auth.Secret.new()
HOST = SECRET.only("host")


@pytest.fixture
def plane(tmp_path):
    made = []

    def make(state=None):
        svc = ControlService(None, address="127.0.0.1", control_port=0, sweep=False, secret=SECRET,
                             state_path=state)
        srv = ControlServer(svc, "127.0.0.1", 0).start()
        made.append(srv)
        return ("127.0.0.1", srv.port), srv

    yield make
    for srv in made:
        srv.stop()


def call(ctl, method, path, body=None, secret=HOST, role=None) -> tuple[int, dict]:
    try:
        return 200, request(ctl, method, path, body, secret=secret, role=role, ca=None)
    except DosaError as e:
        return getattr(e, "status", None), {"error": str(e)}


def join(ctl, w, port, session=None, **kw):
    body = {"job_id": 7, "workers": 2, "numel": 1000, "worker_id": w, "address": "127.0.0.1", "port": port, **kw}
    if session is not None:
        body["session"] = session
    return call(ctl, "POST", "/v1/join", body)


def member(ctl, w) -> tuple:
    view = call(ctl, "GET", "/v1/jobs/7", secret=None)[1]
    return next(((h["address"], h["port"]) for h in view["hosts"] if h["worker_id"] == w), None)


def test_only_a_members_own_session_leaves_beats_or_moves_it(plane):
    ctl, srv = plane()
    assert join(ctl, 0, 20000, "s0")[0] == 200 and join(ctl, 1, 20001, "s1")[0] == 200
    refused = [
        call(ctl, "POST", "/v1/leave", {"job_id": 7, "worker_id": 1, "session": "s0"}),
        call(ctl, "POST", "/v1/leave", {"job_id": 7, "worker_id": 1}),
        call(ctl, "POST", "/v1/heartbeat", {"job_id": 7, "worker_id": 1, "session": "s0"}),
        join(ctl, 1, 4242, None, replace=True),  # move worker 1's flow without its session
        join(ctl, None, 20001, "s0"),  # take worker 1 by naming its address and port
    ]
    for status, ans in refused:
        assert status == 403 and "worker 1 of job 7" in ans["error"], ans
    # with a session of its own, a join for a live member is the lifecycle's 409 (it waits for a
    # dead run to end, up to its wait), never a move
    status, ans = join(ctl, 1, 4242, "s0", replace=True)
    assert status == 409 and "held by a live run" in ans["error"]
    assert member(ctl, 1) == ("127.0.0.1", 20001)
    assert srv.guard.counts()[0] == {"not_the_holder": 5}
    # its own process: heartbeat, re-join from another port (moves its flow), leave
    assert call(ctl, "POST", "/v1/heartbeat", {"job_id": 7, "worker_id": 1, "session": "s1"})[0] == 200
    assert join(ctl, 1, 20011, "s1", replace=True)[0] == 200 and member(ctl, 1) == ("127.0.0.1", 20011)
    assert call(ctl, "POST", "/v1/leave", {"job_id": 7, "worker_id": 1, "session": "s1"})[0] == 200
    assert member(ctl, 1) is None


def test_a_member_without_a_session_is_the_operators_to_move_or_remove(plane):
    ctl, _ = plane()
    assert join(ctl, 0, 20000)[0] == 200  # an admin-style join: no session, no lease
    assert join(ctl, 0, 20000)[0] == 200  # the same again changes nothing: allowed
    assert join(ctl, 0, 20000, "mine")[0] == 409  # a session's join meets a live member (no lease)
    for status, ans in (join(ctl, 0, 20002, replace=True),
                        call(ctl, "POST", "/v1/leave", {"job_id": 7, "worker_id": 0}),
                        call(ctl, "POST", "/v1/leave", {"job_id": 7, "worker_id": 0, "session": "x"})):
        assert status == 403 and "joined without a session: only the operator" in ans["error"], ans
    op = {"secret": SECRET, "role": "operator"}
    status, _ = call(ctl, "POST", "/v1/join", {"job_id": 7, "worker_id": 0, "address": "127.0.0.1",
                                               "port": 20002, "replace": True}, **op)
    assert status == 200 and member(ctl, 0) == ("127.0.0.1", 20002)
    assert call(ctl, "POST", "/v1/leave", {"job_id": 7, "worker_id": 0}, **op)[0] == 200


def test_jobs_are_the_operators_and_local_endpoints_the_peers(plane):
    ctl, srv = plane()
    job = {"job_id": 8, "workers": 1, "numel": 100}
    assert call(ctl, "POST", "/v1/jobs", job)[0] == 403
    assert call(ctl, "POST", "/v1/jobs", job, secret=SECRET, role="peer")[0] == 403
    assert call(ctl, "POST", "/v1/jobs", job, secret=SECRET, role="operator")[0] == 200
    flow = {"job_id": 8, "worker_id": 0, "address": "127.0.0.1", "port": 4242}
    for role in ("host", "operator"):
        assert call(ctl, "POST", "/v1/local/flows", flow, secret=SECRET, role=role)[0] == 403
        assert call(ctl, "DELETE", "/v1/jobs/8", secret=SECRET, role="host")[0] == 403
    assert call(ctl, "GET", "/v1/jobs/8", secret=None)[1]["hosts"] == []
    assert call(ctl, "POST", "/v1/local/flows", flow, secret=SECRET, role="peer")[0] == 200
    assert call(ctl, "DELETE", "/v1/jobs/8", secret=SECRET, role="operator")[0] == 200
    refused, _ = srv.guard.counts()
    assert refused == {"role_not_allowed": 6}
    # reads stay open: health, jobs, stats, metrics
    for path in ("/v1/health", "/v1/jobs", "/v1/stats"):
        assert call(ctl, "GET", path, secret=None)[0] == 200


def test_a_restarted_server_keeps_each_members_session_and_no_one_adopts_it(plane, tmp_path):
    state = str(tmp_path / "api.json")
    ctl, srv = plane(state)
    assert join(ctl, 0, 20000, "s0")[0] == 200 and join(ctl, 1, 20001, "s1")[0] == 200
    srv.stop()
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o600
    saved = open(state).read()
    assert "s0" not in json.loads(saved)["holders"]["7"].values() and '"s1"' not in saved
    ctl, _ = plane(state)
    # the first to beat for worker 1 after the restart is not its holder: refused
    status, ans = call(ctl, "POST", "/v1/heartbeat", {"job_id": 7, "worker_id": 1, "session": "intruder"})
    assert status == 403 and "held by another session" in ans["error"]
    assert call(ctl, "POST", "/v1/heartbeat", {"job_id": 7, "worker_id": 1, "session": "s1"})[0] == 200
    assert call(ctl, "POST", "/v1/heartbeat", {"job_id": 7, "worker_id": 0, "session": "s0"})[0] == 200
