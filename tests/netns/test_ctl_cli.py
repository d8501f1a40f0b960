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
        dosa("ctl", "attach", "--iface", "v0", "--netns", ns, "--pool-slots", "65536",
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


def test_without_root_says_so():
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                        "-m", "dosa", "ctl", "stats"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "needs root" in r.stderr and "Traceback" not in r.stderr, r.stderr
