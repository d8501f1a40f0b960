"""`dosa ctl` end to end as a user runs it: attach in a namespace, job add, worker add, stats --json
with drops by reason name, job rm, detach (unloads); user errors are one line, no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dosa(*args, ok=True):
    r = subprocess.run([sys.executable, "-m", "dosa", *args], capture_output=True, text=True, cwd=REPO)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def test_ctl_lifecycle_and_stats_json(netns_factory):
    ns = netns_factory("cli")
    subprocess.run(["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=True)
    inst = f"clitest-{uuid.uuid4().hex[:6]}"
    common = ["--instance", inst]
    try:
        dosa("ctl", "attach", "--iface", "v0", "--netns", ns, "--pool-buffers", "16",
             "--pstate-slots", "256", "--wstate-slots", "4096", *common)
        out = dosa("ctl", "job", "add", "--job", "3", "--workers", "2", "--numel", "5000",
                   "--partition-size", "1000", *common).stdout
        assert "job 3" in out and "5 partitions" in out
        dosa("ctl", "worker", "add", "--job", "3", "--worker", "1", "--address", "10.0.0.7",
             "--port", "5555", *common)
        st = json.loads(dosa("ctl", "stats", "--json", *common).stdout)
        assert st["attachments"] == [{"ifname": "v0", "netns": ns, "mode": "auto"}]
        assert {"short_packet", "bad_magic", "unknown_worker", "bad_source", "duplicate",
                "round_too_old", "scale_mismatch"} <= set(st["drops"])
        assert [j["job_id"] for j in st["jobs"]] == [3]
        assert st["flows"] == [{"job_id": 3, "worker_id": 1, "address": "10.0.0.7", "port": 5555}]
        r = dosa("ctl", "job", "add", "--job", "4", "--workers", "2", "--numel", "10000000", *common, ok=False)
        assert r.returncode == 2 and "aggregation slots" in r.stderr and "Traceback" not in r.stderr
        dosa("ctl", "job", "rm", "--job", "3", *common)
        assert json.loads(dosa("ctl", "job", "ls", "--json", *common).stdout) == []
        out = dosa("ctl", "detach", "--iface", "v0", "--netns", ns, *common).stdout
        assert "unloaded" in out
        assert not os.path.exists(f"/sys/fs/bpf/dosa/{inst}")
    finally:
        if os.path.exists(f"/sys/fs/bpf/dosa/{inst}"):
            dosa("ctl", "detach", "--iface", "v0", "--netns", ns, *common, ok=False)


@pytest.mark.parametrize("args,msg", [
    (["ctl", "attach", "--iface", "nosuch9", "--instance", "clierr"], "no network interface 'nosuch9'"),
    (["ctl", "attach", "--iface", "lo", "--netns", "no-such-ns-x"], "namespace 'no-such-ns-x' does not exist"),
    (["ctl", "stats", "--instance", "never-loaded"], "is not loaded"),
    (["ctl", "job", "rm", "--job", "1", "--instance", "bad/name"], "instance name"),
    (["ctl", "stats", "--pin-dir", "/tmp/x"], "under /sys/fs/bpf"),
])
def test_user_errors_are_one_sentence(args, msg):
    r = dosa(*args, ok=False)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ip_netns_exec_explains_the_hidden_bpffs(netns_factory):
    ns = netns_factory("mnt")
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "dosa", "ctl", "attach",
                        "--iface", "lo", "--instance", "hidden"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "nsenter" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_without_root_says_so():
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                        "-m", "dosa", "ctl", "stats"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "needs root" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _wait_health(url, proc, timeout=60):
    import time

    from dosa.join import request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"dosa ctl serve exited: {proc.stderr.read()}")
        try:
            return request(url, "GET", "/v1/health", timeout=1)
        except Exception:
            time.sleep(0.1)
    raise AssertionError("dosa ctl serve did not come up")


@pytest.mark.parametrize("mode", ["userspace", "xdp"])
def test_serve_answers_joins_and_cleans_up_on_sigterm(netns_factory, mode, tmp_path, monkeypatch):
    """`dosa ctl serve` inside a DPU namespace, as the testbed starts it (with the DPUs' secret
    file): a host with the hosts' file joins over HTTP, one without is refused, SIGTERM stops it
    with status 0, and in xdp mode the program is detached and unloaded."""
    import signal

    from dosa.auth import make_files
    from dosa.errors import DosaError
    from dosa.join import join_raw

    make_files(str(tmp_path / "dpu.secret"), str(tmp_path / "host.secret"))
    monkeypatch.setenv("DOSA_SECRET_FILE", str(tmp_path / "host.secret"))

    ns = netns_factory("srv")
    subprocess.run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "p0"], check=True)
    subprocess.run(["ip", "-n", ns, "addr", "add", "10.91.0.1/24", "dev", "eth0"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "p0", "up"], check=True)
    pin = f"/sys/fs/bpf/dosa-srvtest-{uuid.uuid4().hex[:6]}"
    # nsenter --net, as the testbed does: `ip netns exec` would remount /sys and hide the bpffs
    argv = ["nsenter", f"--net=/run/netns/{ns}", "--", sys.executable, "-m", "dosa", "ctl", "serve", "--addr", "10.91.0.1",
            "--listen", "127.0.0.1:17800", "--mode", mode, "--pin-dir", pin,
            "--secret-file", str(tmp_path / "dpu.secret")]
    if mode == "xdp":
        argv += ["--iface", "eth0"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        from control.netns import run_in_netns

        run_in_netns(ns, _wait_health, "127.0.0.1:17800", proc)
        monkeypatch.setenv("DOSA_SECRET_FILE", "")
        with pytest.raises(DosaError, match="needs credentials") as refused:
            run_in_netns(ns, lambda: join_raw("127.0.0.1:17800", 5, "10.91.0.7", 17791, None, 0,
                                              numel=1000, workers=1))
        assert refused.value.status == 401
        monkeypatch.setenv("DOSA_SECRET_FILE", str(tmp_path / "host.secret"))
        resp = run_in_netns(ns, lambda: join_raw("127.0.0.1:17800", 5, "10.91.0.7", 17791, None, 0,
                                                 numel=1000, workers=1))
        assert resp["complete"] and resp["dpus"] == [{"index": 0, "address": "10.91.0.1", "port": 17791}]
        if mode == "xdp":
            assert os.path.exists(f"{pin}/prog") and os.path.exists(f"{pin}/jobs")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
        assert not os.path.exists(pin)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if os.path.exists(pin):
            subprocess.run(["rm", "-rf", pin])
