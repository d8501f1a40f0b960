"""The control plane lets in only those it should, on a real testbed (XDP dataplane, control plane and
DPU worker in their namespaces; docs/control.md *Credentials*).

While a 2-rank job runs, every call of issue 25 is tried from host h0 as a stranger would (curl, no
credential) and as another tenant would (the deployment's host key, but not the members' sessions):
the spoofed ``POST /v1/local/flows``, ``DELETE /v1/jobs/N``, leave and heartbeat with another's
session, a join that would move worker 1's flow, a join without the secret, a replayed and a
mis-signed request. Each is a 401/403 counted in /metrics; the job's registry is unchanged, the
dataplane dropped nothing as ``bad_source``, and the ranks' next rounds are still exact. Then the
operator (``dosa ctl`` in d0, with the DPUs' secret file) removes a job, and a TLS testbed serves
only HTTPS, with the CA it made, to ranks whose rounds are exact."""
from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time

import pytest

from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

JOB = 31
# one rank: join, 2 exact rounds, say READY, wait for the test's attacks, 3 more exact rounds, leave
RANK = r"""
import os, sys, time
import numpy as np
from host_lib.client import AggregationClient
numel, go = 100_000, sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
def inputs(r, w):
    g = np.random.default_rng([r, w])
    return np.sort(g.choice(numel, 400, replace=False)).astype(np.uint32), g.integers(-99, 99, 400).astype(np.int32)
def exact(c, r):
    gi, gs = c.allreduce_sparse(*inputs(r, rank), c.job.scale_exp)
    tot = np.zeros(numel, np.int64)
    for w in range(world):
        i, q = inputs(r, w)
        np.add.at(tot, i.astype(np.int64), q)
    nz = np.flatnonzero(tot)
    assert np.array_equal(gi.astype(np.int64), nz) and np.array_equal(gs.astype(np.int64), tot[nz]), r
c = AggregationClient.from_env(numel=numel, timeout=20)
for r in range(2):
    exact(c, r)
print("READY", flush=True)
end = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < end:
    time.sleep(0.1)
for r in range(2, 5):
    exact(c, r)
print("EXACT", c.job.job_id, flush=True)
c.close()
"""
# a call signed with the key of DOSA_SECRET_FILE (the hosts' file: another tenant's process)
SIGNED = r"""
import json, sys
from dosa.errors import DosaError
from dosa.join import request
method, path, body = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
try:
    print(json.dumps({"status": 200, "body": request(sys.argv[1], method, path, body)}))
except DosaError as e:
    print(json.dumps({"status": getattr(e, "status", None), "error": str(e)}))
"""
# the same signed request sent twice (a replay), and one signed with another deployment's secret
REPLAY = r"""
import http.client, json, sys
from dosa import auth
host, port = sys.argv[1].split(":")
body = json.dumps({"job_id": int(sys.argv[2]), "worker_id": 1, "session": "x"}).encode()
def send(h):
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("POST", "/v1/heartbeat", body, {"Authorization": h, "Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read()).get("reason")
h = auth.authorization(auth.from_env(), "host", sys.argv[1], "POST", "/v1/heartbeat", body)
other = auth.authorization(auth.Secret.new(), "host", sys.argv[1], "POST", "/v1/heartbeat", body)
print(json.dumps([send(h), send(h), send(other)]))
"""


def _curl(tb, node: str, method: str, url: str, body: dict | None = None, *extra: str) -> tuple[int, dict]:
    argv = ["curl", "-s", "-m", "10", "-X", method, "-w", "\n%{http_code}", *extra, url]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    p = tb.exec_in(node, argv, timeout=30)
    text, _, code = p.stdout.rpartition("\n")
    try:
        return int(code), json.loads(text or "{}")
    except ValueError:
        return int(code or 0), {"raw": text}


def _signed(tb, node: str, ctl: str, method: str, path: str, body: dict | None = None) -> dict:
    argv = [sys.executable, "-c", SIGNED, ctl, method, path] + ([json.dumps(body)] if body is not None else [])
    p = tb.exec_in(node, argv, timeout=60, env=tb.credential_env(node))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _metrics(tb, url: str, *extra: str) -> dict[str, float]:
    p = tb.exec_in("h1", ["curl", "-s", "-m", "10", *extra, f"{url}/metrics"], timeout=30)
    out = {}
    for line in p.stdout.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def _job(tb, url: str) -> dict:
    code, view = _curl(tb, "h1", "GET", f"{url}/v1/jobs/{JOB}")
    assert code == 200, view
    return {"hosts": view["hosts"], "generation": view["generation"]}


def test_every_refused_call_changes_nothing_and_the_running_job_stays_exact(tmp_path):
    with scratch_testbed(hosts=2, dpus=1) as tb:
        env = tb.job_env(0)
        ctl = f"{env['DOSA_CONTROL_ADDR']}:{env['DOSA_CONTROL_PORT']}"
        url = f"http://{ctl}"
        # the secret: made by `up`, 0600, handed to the ranks as the control address is
        host_file, dpu_file = env["DOSA_SECRET_FILE"], tb.credential_env("d0")["DOSA_SECRET_FILE"]
        for f in (host_file, dpu_file):
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
        assert set(json.loads(open(host_file).read())["keys"]) == {"host"}

        go = tmp_path / "attacks-done"
        result = {}
        runner = threading.Thread(target=lambda: result.update(run=tb.run(
            [sys.executable, "-c", RANK, str(go)], env={"DOSA_JOB_ID": JOB}, timeout=150, echo=False,
            log_dir=tmp_path / "ranks")))
        runner.start()
        try:
            deadline = time.monotonic() + 120
            outs = [tmp_path / "ranks" / f"rank{r}.out" for r in range(2)]
            while not all(f.exists() and "READY" in f.read_text() for f in outs):
                assert runner.is_alive() and time.monotonic() < deadline, result
                time.sleep(0.2)
            before = _job(tb, url)
            m0 = _metrics(tb, url)
            h0, h1 = before["hosts"][0], before["hosts"][1]

            t0 = time.monotonic()
            seen = {}
            # a stranger: no credential at all (curl, as in issue 25)
            seen["spoofed flow"] = _curl(tb, "h0", "POST", f"{url}/v1/local/flows",
                                         {"job_id": JOB, "worker_id": 1, "address": h0["address"], "port": 4242})
            seen["delete job"] = _curl(tb, "h0", "DELETE", f"{url}/v1/jobs/{JOB}")
            seen["join without secret"] = _curl(tb, "h0", "POST", f"{url}/v1/join",
                                                {"job_id": JOB, "worker_id": 1, "address": h0["address"],
                                                 "port": 4242, "replace": True})
            seen["leave without secret"] = _curl(tb, "h0", "POST", f"{url}/v1/leave", {"job_id": JOB, "worker_id": 1})
            seen["PUT"] = _curl(tb, "h0", "PUT", f"{url}/v1/jobs/{JOB}", {})
            for what in ("spoofed flow", "delete job", "join without secret", "leave without secret"):
                code, ans = seen[what]
                assert code == 401 and ans["reason"] == "no_credential", (what, code, ans)
            assert seen["PUT"][0] == 405 and "not allowed" in seen["PUT"][1]["error"], seen["PUT"]

            # another tenant: signed with the hosts' key, without worker 1's session
            signed = {
                "spoofed flow": _signed(tb, "h0", ctl, "POST", "/v1/local/flows",
                                        {"job_id": JOB, "worker_id": 1, "address": h0["address"], "port": 4242}),
                "delete job": _signed(tb, "h0", ctl, "DELETE", f"/v1/jobs/{JOB}"),
                "leave": _signed(tb, "h0", ctl, "POST", "/v1/leave",
                                 {"job_id": JOB, "worker_id": 1, "session": "not-worker-1s"}),
                "leave without session": _signed(tb, "h0", ctl, "POST", "/v1/leave", {"job_id": JOB, "worker_id": 1}),
                "heartbeat": _signed(tb, "h0", ctl, "POST", "/v1/heartbeat",
                                     {"job_id": JOB, "worker_id": 1, "session": "not-worker-1s"}),
                "move flow": _signed(tb, "h0", ctl, "POST", "/v1/join",
                                     {"job_id": JOB, "worker_id": 1, "address": h0["address"], "port": 4242,
                                      "replace": True, "session": "not-worker-1s"}),
                "move flow without session": _signed(tb, "h0", ctl, "POST", "/v1/join",
                                                     {"job_id": JOB, "worker_id": 1, "address": h0["address"],
                                                      "port": 4242, "replace": True}),
                "take rank by its address": _signed(tb, "h0", ctl, "POST", "/v1/join",
                                                    {"job_id": JOB, "address": h1["address"], "port": h1["port"],
                                                     "session": "not-worker-1s"}),
            }
            for what in ("spoofed flow", "delete job"):
                assert signed[what]["status"] == 403 and "may not make this call" in signed[what]["error"], signed[what]
            for what in ("leave", "leave without session", "heartbeat", "move flow without session",
                         "take rank by its address"):
                assert signed[what]["status"] == 403 and "worker 1" in signed[what]["error"], (what, signed[what])
            # a join with a session of its own meets a live member: the lifecycle's 409 (a new run
            # of the same job id would wait for the old one to end), not a move
            assert signed["move flow"]["status"] == 409 and "held by a live run" in signed["move flow"]["error"]

            # a replayed request and one signed with another deployment's secret
            p = tb.exec_in("h0", [sys.executable, "-c", REPLAY, ctl, str(JOB)], timeout=60,
                           env=tb.credential_env("h0"))
            first, again, other = json.loads(p.stdout)
            assert first[0] == 403 and again == [401, "replayed"] and other == [401, "bad_signature"], p.stdout
            attack_s = time.monotonic() - t0

            # nothing changed: the registry, the dataplane (no packet from a moved flow), the counters
            assert _job(tb, url) == before
            m1 = _metrics(tb, url)
            refused = {k: m1[k] - m0.get(k, 0) for k in m1 if k.startswith("dosa_control_refused_requests_total")}
            assert refused['dosa_control_refused_requests_total{reason="no_credential"}'] == 4
            assert refused['dosa_control_refused_requests_total{reason="role_not_allowed"}'] == 2
            assert refused['dosa_control_refused_requests_total{reason="not_the_holder"}'] == 6  # and the replay's first
            assert refused['dosa_control_refused_requests_total{reason="replayed"}'] == 1
            assert refused['dosa_control_refused_requests_total{reason="bad_signature"}'] == 1
            assert m1['dosa_control_credentials_required'] == 1
        finally:
            go.touch()
            runner.join(160)
        res = result["run"]
        outs = [(tmp_path / "ranks" / f"rank{r}.out").read_text() for r in range(2)]
        errs = [(tmp_path / "ranks" / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
        assert res.ok and all(f"EXACT {JOB}" in o for o in outs), (res.summary(), errs)
        m2 = _metrics(tb, url)
        assert m2['dosa_dataplane_drops_total{reason="bad_source"}'] == 0
        assert m2['dosa_dataplane_drops_total{reason="unknown_worker"}'] == 0
        print(f"\n{len(seen) + len(signed) + 3} refused calls in {attack_s:.1f} s")

        # the operator: dosa ctl in d0 (the DPUs' secret file) creates and removes a job
        op = _signed(tb, "d0", ctl, "POST", "/v1/jobs", {"job_id": 99, "workers": 1, "numel": 1000})
        assert op["status"] == 403  # the DPUs' file signs as a host by default: the operator says so
        p = tb.exec_in("d0", [sys.executable, "-c",
                              "from dosa.join import request; import sys; request(sys.argv[1], 'POST', '/v1/jobs', "
                              "{'job_id': 99, 'workers': 1, 'numel': 1000}, role='operator')", ctl],
                       env=tb.credential_env("d0"), timeout=60)
        assert p.returncode == 0, p.stderr
        p = tb.exec_in("d0", [sys.executable, "-m", "dosa", "ctl", "job", "rm", "--job", "99", "--control", ctl],
                       env=tb.credential_env("d0"), timeout=60)
        assert p.returncode == 0 and "removed from every DPU" in p.stdout, p.stderr
        assert _curl(tb, "h1", "GET", f"{url}/v1/jobs/99")[0] == 404
        # the same command from a host has no operator key
        p = tb.exec_in("h0", [sys.executable, "-m", "dosa", "ctl", "job", "rm", "--job", "99", "--control", ctl],
                       env=tb.credential_env("h0"), timeout=60)
        assert p.returncode == 2 and "holds no operator key" in p.stderr, p.stderr


def test_a_tls_testbed_serves_only_https_with_its_own_ca_and_its_ranks_are_exact(tmp_path):
    """Two DPUs: the job's flows reach DPU 1 through DPU 0's peer calls, over HTTPS too."""
    with scratch_testbed(hosts=2, dpus=2, mode="userspace", tls=True) as tb:
        env = tb.job_env(0)
        ctl = f"{env['DOSA_CONTROL_ADDR']}:{env['DOSA_CONTROL_PORT']}"
        ca = env["DOSA_CONTROL_CA"]
        assert ca and os.path.exists(ca)
        code, ans = _curl(tb, "h0", "GET", f"https://{ctl}/v1/health", None, "--cacert", ca)
        assert (code, ans) == (200, {"ok": True})
        assert _curl(tb, "h0", "GET", f"https://{ctl}/v1/health")[0] == 0  # no CA: curl refuses the certificate
        assert _curl(tb, "h0", "GET", f"http://{ctl}/v1/health")[0] == 0  # plain HTTP: the server hangs up
        code, ans = _curl(tb, "h0", "POST", f"https://{ctl}/v1/join", {"job_id": 5, "address": "10.0.0.1"},
                          "--cacert", ca)
        assert code == 401 and ans["reason"] == "no_credential"
        code, ans = _curl(tb, "h0", "DELETE", f"https://{ctl}/v1/jobs/5", None, "--cacert", ca)
        assert code == 401 and ans["reason"] == "no_credential"
        # ranks: the hook's client joins and beats over HTTPS, rounds exact
        go = tmp_path / "go"
        go.touch()
        res = tb.run([sys.executable, "-c", RANK, str(go)], env={"DOSA_JOB_ID": JOB}, timeout=120, echo=False,
                     log_dir=tmp_path / "ranks")
        outs = [(tmp_path / "ranks" / f"rank{r}.out").read_text() for r in range(2)]
        errs = [(tmp_path / "ranks" / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
        assert res.ok and all(f"EXACT {JOB}" in o for o in outs), (res.summary(), errs)
        # DPU 1 learnt the job and its members from DPU 0's signed peer calls over HTTPS
        m = _metrics(tb, f"https://{tb.job_env(0)['DOSA_DPU_ADDRS'].split(',')[1]}:{env['DOSA_CONTROL_PORT']}",
                     "--cacert", ca)
        assert m[f'dosa_worker_completions_total{{job_id="{JOB}"}}'] >= 5, m  # its partition, each round
        assert m['dosa_control_refused_requests_total{reason="no_credential"}'] == 0


# hold n idle connections to the control plane; report which were answered 429 and when the rest
# were closed by the server
IDLE = r"""
import json, select, socket, sys, time
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic()
socks = [socket.create_connection((addr, port), timeout=10) for _ in range(n)]
print("OPEN", round(time.monotonic() - t0, 2), flush=True)
refused, closed, waiting = 0, [], set(socks)
while waiting and time.monotonic() < t0 + 25:
    for s in select.select(list(waiting), [], [], 0.5)[0]:
        data = s.recv(4096)
        if data.startswith(b"HTTP/1.1 429 "):
            refused += 1
        elif data == b"":
            closed.append(round(time.monotonic() - t0, 2))
        waiting.discard(s)
print(json.dumps({"refused": refused, "closed": len(closed), "first_closed": min(closed, default=None),
                  "last_closed": max(closed, default=None), "still_open": len(waiting)}), flush=True)
"""


def test_hundreds_of_idle_connections_from_one_host_stall_no_one_else(tmp_path):
    """300 idle connections from h0 to the DPU's control plane (its default limits: 160 from one
    address, 10 s per request): 140 are answered 429 at once, 160 held and closed by the server
    after 10 s; meanwhile h1 is answered at once, and /metrics counts both."""
    import subprocess

    with scratch_testbed(hosts=2, dpus=1, mode="userspace") as tb:
        env = tb.job_env(0)
        addr, port = env["DOSA_CONTROL_ADDR"], env["DOSA_CONTROL_PORT"]
        url = f"http://{addr}:{port}"
        p = tb.popen_in("h0", [sys.executable, "-c", IDLE, addr, port, "300"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
        try:
            opened = p.stdout.readline()
            assert opened.startswith("OPEN"), opened + p.stderr.read()
            took = []
            for _ in range(5):
                t = time.monotonic()
                code, ans = _curl(tb, "h1", "GET", f"{url}/v1/health")
                took.append(time.monotonic() - t)
                assert (code, ans) == (200, {"ok": True})
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        got = json.loads(out.strip().splitlines()[-1])
        print(f"\nopened in {opened.split()[1]} s; h1's health answered in {max(took):.2f} s at most; {got}")
        assert got["refused"] == 140 and got["closed"] == 160 and got["still_open"] == 0, (got, err)
        assert 9.5 <= got["first_closed"] and got["last_closed"] <= 13, got
        assert max(took) < 1.0, took  # a curl in a namespace, process start included
        m = _metrics(tb, url)
        assert m['dosa_control_dropped_connections_total{reason="too_many_connections"}'] == 140
        assert m['dosa_control_dropped_connections_total{reason="request_timeout"}'] >= 160
        assert _curl(tb, "h0", "GET", f"{url}/v1/health")[0] == 200  # h0 is served again
