"""The credential check itself (dosa.auth): an HMAC over role, audience, method, path, timestamp,
nonce and body; every part bound, a replay refused, a timestamp outside the window refused, the
signature compared in constant time, secret files private; and the client's recovery from a server
whose clock is off (dosa.join.Channel)."""
from __future__ import annotations

import os
import stat

import pytest

from dosa import auth
from dosa.auth import AuthError, Secret, Verifier
from dosa.errors import DosaError

pytestmark = pytest.mark.timeout(60)

AUD = "10.77.0.200:17800"
NOW = 1_800_000_000.0
BODY = b'{"job_id": 7, "worker_id": 1}'


def _verifier(secret, now=NOW, **kw):
    return Verifier(secret, {AUD}, clock=lambda: now, **kw)


def _sign(secret, role="host", aud=AUD, method="POST", path="/v1/leave", body=BODY, now=NOW, nonce=None):
    return auth.authorization(secret, role, aud, method, path, body, now=now, nonce=nonce)


def test_a_signed_request_passes_and_names_its_role():
    s = Secret.new()
    v = _verifier(s)
    assert v.verify(_sign(s), "POST", "/v1/leave", BODY, ("host", "operator")) == "host"
    assert v.verify(_sign(s, role="peer"), "POST", "/v1/leave", BODY, ("peer",)) == "peer"


@pytest.mark.parametrize("change", ["method", "path", "body", "aud", "ts", "nonce", "role", "sig"])
def test_changing_any_signed_part_breaks_the_signature(change):
    s = Secret.new()
    v = _verifier(s)
    h = _sign(s, nonce="ab" * 16)
    method, path, body = "POST", "/v1/leave", BODY
    if change == "method":
        method = "DELETE"
    elif change == "path":
        path = "/v1/leave?x=1"
    elif change == "body":
        body = BODY.replace(b"1", b"0")
    elif change == "aud":  # sent to another DPU: it answers to its own address only
        v = Verifier(s, {"10.77.0.201:17800"}, clock=lambda: NOW)
    elif change == "ts":
        h = h.replace(f"ts={int(NOW * 1000)}", f"ts={int(NOW * 1000) + 1}")
    elif change == "nonce":
        h = h.replace("ab" * 16, "cd" * 16)
    elif change == "role":  # the host's signature relabelled as the operator's
        h = h.replace("role=host", "role=operator")
    elif change == "sig":
        h = h[:-1] + ("0" if h[-1] != "0" else "1")
    with pytest.raises(AuthError) as e:
        v.verify(h, method, path, body, ("host", "operator"))
    assert e.value.status == 401
    assert e.value.reason == ("wrong_audience" if change == "aud" else "bad_signature")


def test_another_deployments_secret_is_refused():
    with pytest.raises(AuthError, match="signature is wrong") as e:
        _verifier(Secret.new()).verify(_sign(Secret.new()), "POST", "/v1/leave", BODY, ("host",))
    assert e.value.reason == "bad_signature"


def test_a_replay_is_refused_within_the_window_and_forgotten_after_it():
    s = Secret.new()
    clock = [NOW]
    v = Verifier(s, {AUD}, window=30, clock=lambda: clock[0])
    h = _sign(s)
    v.verify(h, "POST", "/v1/leave", BODY, ("host",))
    with pytest.raises(AuthError) as e:
        v.verify(h, "POST", "/v1/leave", BODY, ("host",))
    assert (e.value.status, e.value.reason) == (401, "replayed")
    # once its timestamp is out of the window the nonce is dropped: the request is stale instead
    clock[0] = NOW + 61
    with pytest.raises(AuthError) as e:
        v.verify(h, "POST", "/v1/leave", BODY, ("host",))
    assert e.value.reason == "stale"
    v.verify(_sign(s, now=clock[0]), "POST", "/v1/leave", BODY, ("host",))
    assert list(v._seen) != [h.split("nonce=")[1].split(",")[0]] and len(v._seen) == 1


@pytest.mark.parametrize("offset,ok", [(-29.9, True), (29.9, True), (-30.5, False), (30.5, False), (-3600, False)])
def test_the_timestamp_window_is_30_s_either_way(offset, ok):
    s = Secret.new()
    v = _verifier(s)
    h = _sign(s, now=NOW + offset)
    if ok:
        assert v.verify(h, "POST", "/v1/leave", BODY, ("host",)) == "host"
    else:
        with pytest.raises(AuthError, match="from this control plane's clock") as e:
            v.verify(h, "POST", "/v1/leave", BODY, ("host",))
        assert (e.value.status, e.value.reason) == (401, "stale")


def test_a_role_that_may_not_make_the_call_is_a_403_only_once_authenticated():
    full = Secret.new()
    v = _verifier(full)
    with pytest.raises(AuthError) as e:
        v.verify(_sign(full, path="/v1/local/flows"), "POST", "/v1/local/flows", BODY, ("peer",))
    assert (e.value.status, e.value.reason) == (403, "role_not_allowed")
    # a forged operator signature is a 401, not a hint about roles
    with pytest.raises(AuthError) as e:
        v.verify(_sign(Secret.new(), role="operator", path="/v1/local/flows"), "POST", "/v1/local/flows",
                 BODY, ("peer",))
    assert e.value.status == 401


@pytest.mark.parametrize("header", [None, "", "Bearer abc", "DOSA-HMAC-SHA256 role=host",
                                    "DOSA-HMAC-SHA256 role=host,aud=x,ts=1,nonce=zz,sig=00",
                                    "DOSA-HMAC-SHA256 " + "a=b," * 300])
def test_a_missing_or_malformed_credential_is_a_401(header):
    with pytest.raises(AuthError) as e:
        _verifier(Secret.new()).verify(header, "POST", "/v1/leave", BODY, ("host",))
    assert e.value.status == 401 and e.value.reason in ("no_credential", "bad_credential")


def test_signatures_are_compared_in_constant_time(monkeypatch):
    """The comparison is hmac.compare_digest (its time does not depend on where the first differing
    byte is), never ``==``."""
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    s = Secret.new()
    _verifier(s).verify(_sign(s), "POST", "/v1/leave", BODY, ("host",))
    with pytest.raises(AuthError):
        _verifier(s).verify(_sign(Secret.new()), "POST", "/v1/leave", BODY, ("host",))
    assert len(calls) == 2 and all(len(a) == len(b) == 64 for a, b in calls)


def test_sessions_are_kept_as_digests_and_compared_in_constant_time(monkeypatch):
    from control.api import lease

    calls = []
    real = lease.hmac.compare_digest
    monkeypatch.setattr(lease.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    ls = lease.Leases()
    ls.grant(7, 0, "my-session")
    assert ls.holder(7, 0) == lease.digest("my-session") != "my-session"
    assert ls.holds(7, 0, "my-session") and not ls.holds(7, 0, "my-sessioN") and not ls.holds(7, 0, None)
    assert ls.beat(7, 0, "other") == "is held by another session" and ls.beat(7, 0, "my-session") is None
    assert len(calls) == 4


def test_the_nonce_cache_is_bounded():
    s = Secret.new()
    v = _verifier(s, max_nonces=3)
    for _ in range(3):
        v.verify(_sign(s), "POST", "/v1/leave", BODY, ("host",))
    with pytest.raises(AuthError) as e:
        v.verify(_sign(s), "POST", "/v1/leave", BODY, ("host",))
    assert (e.value.status, e.value.reason) == (429, "busy")


def test_secret_files_are_private_and_a_hosts_file_has_only_the_host_key(tmp_path):
    dpu = auth.make_files(str(tmp_path / "dpu.secret"), str(tmp_path / "host.secret"))
    for f in ("dpu.secret", "host.secret"):
        assert stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o600
    host = Secret.load(str(tmp_path / "host.secret"))
    assert set(dpu.keys) == {"host", "operator", "peer"} and host.keys == {"host": dpu.keys["host"]}
    with pytest.raises(DosaError, match="holds no operator key"):
        auth.authorization(host, "operator", AUD, "DELETE", "/v1/jobs/7", b"")
    os.chmod(tmp_path / "host.secret", 0o644)
    with pytest.raises(DosaError, match=r"may be read by others \(mode 644\): `chmod 600"):
        Secret.load(str(tmp_path / "host.secret"))
    (tmp_path / "junk").write_text("{}")
    os.chmod(tmp_path / "junk", 0o600)
    with pytest.raises(DosaError, match="is not a dosa secret file"):
        Secret.load(str(tmp_path / "junk"))
    with pytest.raises(DosaError, match="cannot read the secret file"):
        Secret.load(str(tmp_path / "none"))
    assert auth.from_env({"DOSA_SECRET_FILE": str(tmp_path / "dpu.secret")}).keys == dpu.keys
    assert auth.from_env({}) is None


def test_a_client_whose_clock_is_off_learns_the_servers_and_signs_again(monkeypatch):
    """A DPU whose clock is 10 minutes ahead (an SoC without a battery-backed clock): the first
    call is a 401 "stale" carrying the server's time, the client signs again once with it."""
    import time

    from control.api import ControlServer, ControlService
    from dosa import join

    s = Secret.new()
    svc = ControlService(None, address="127.0.0.1", control_port=0, sweep=False, secret=s)
    with ControlServer(svc, "127.0.0.1", 0) as srv:
        srv.guard.verifier.clock = lambda: time.time() + 600
        ctl = ("127.0.0.1", srv.port)
        join._skew.pop(f"127.0.0.1:{srv.port}", None)
        view = join.request(ctl, "POST", "/v1/jobs", {"job_id": 3, "workers": 1, "numel": 100},
                            secret=s, role="operator")
        assert view["job_id"] == 3 and 590 < join._skew[f"127.0.0.1:{srv.port}"] < 610
        refused, _ = srv.guard.counts()
        assert refused == {"stale": 1}
