"""Jobs end, on a real testbed (XDP dataplane, control plane and DPU worker in their namespaces):
the same launch (same DOSA_JOB_ID) five times in a row, a crashed run followed at once by the same
launch, the README's `testbed exec d0 dosa ctl ...` commands, and `testbed restart` of a DPU worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]

# one rank: join the job the environment names, 3 exact rounds, then leave (close) or crash
RANK = r"""
import os, sys
import numpy as np
from host_lib.client import AggregationClient
numel, crash = 200_000, sys.argv[1] == "crash"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
def inputs(r, w):
    g = np.random.default_rng([r, w])
    return np.sort(g.choice(numel, 500, replace=False)).astype(np.uint32), g.integers(-99, 99, 500).astype(np.int32)
c = AggregationClient.from_env(numel=numel, timeout=20)
for r in range(3):
    gi, gs = c.allreduce_sparse(*inputs(r, rank), c.job.scale_exp)
    tot = np.zeros(numel, np.int64)
    for w in range(world):
        i, q = inputs(r, w)
        np.add.at(tot, i.astype(np.int64), q)
    nz = np.flatnonzero(tot)
    assert np.array_equal(gi.astype(np.int64), nz) and np.array_equal(gs.astype(np.int64), tot[nz]), r
print("EXACT", c.job.job_id, flush=True)
if crash:
    os._exit(0)  # no close, no atexit: the job is left behind with its leases
c.close()
"""


def _cli(tb, *argv, check=True):
    env = {**os.environ, "DOSA_TESTBED_PREFIX": tb.prefix, "DOSA_TESTBED_STATE_DIR": str(tb.state_dir)}
    p = subprocess.run([sys.executable, "-m", "dosa", *argv], env=env, capture_output=True, text=True,
                       timeout=120)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def _run(tb, tmp_path, tag, mode="leave", job_id=77):
    res = tb.run([sys.executable, "-c", RANK, mode], env={"DOSA_JOB_ID": job_id}, timeout=90, echo=False,
                 log_dir=tmp_path / tag)
    outs = [(tmp_path / tag / f"rank{r}.out").read_text() for r in range(2)]
    errs = [(tmp_path / tag / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
    assert res.ok and all(f"EXACT {job_id}" in o for o in outs), (res.summary(), errs)


def _jobs(tb):
    return json.loads(_cli(tb, "testbed", "exec", "d0", sys.executable, "-m", "dosa", "ctl", "job", "ls",
                           "--json").stdout)


def test_same_launch_five_times_then_a_crash_and_at_once_again(tmp_path):
    with scratch_testbed(hosts=2, dpus=1) as tb:
        for i in range(5):  # the same job id every time: released when its workers leave
            _run(tb, tmp_path, f"run{i}")
            assert _jobs(tb) == [], f"run {i} left its job behind"
        # the README's command, as written, inside the DPU
        st = json.loads(_cli(tb, "testbed", "exec", "d0", ".venv/bin/dosa", "ctl", "stats", "--json").stdout)
        assert "drops" in st and st["jobs"] == []
        # a run that crashes leaves its job with leases; `ctl job ls` shows them
        _run(tb, tmp_path, "crash", mode="crash")
        (job,) = _jobs(tb)
        assert job["job_id"] == 77 and job["lease"]["expires_in_s"] is not None
        assert set(job["lease"]["members"]) == {"0", "1"}
        text = _cli(tb, "testbed", "exec", "d0", sys.executable, "-m", "dosa", "ctl", "job", "ls").stdout
        assert "lease expires in" in text and "heartbeat" in text, text
        # the same launch right away: it waits for the dead run's members to fall silent, then
        # gets the job re-created (not the stale one whose DPU state sits at round 3)
        _run(tb, tmp_path, "after-crash")
        assert _jobs(tb) == []


def test_restart_of_a_dpu_worker_is_recorded_and_it_serves_again(tmp_path):
    with scratch_testbed(hosts=2, dpus=1) as tb:
        st = tb.status()
        before = {p["name"]: p for p in st["processes"]}["d0-dpu"]
        # status reads interfaces over netlink: the same as iproute2's own view, XDP included
        d0 = {n["name"]: n for n in st["nodes"]}["d0"]
        assert d0["interfaces"] == _iproute2_interfaces(d0["namespace"])
        assert any(i["xdp"] and i["xdp_prog"] for i in d0["interfaces"]), d0["interfaces"]
        out = _cli(tb, "testbed", "restart", "d0").stdout
        assert "restarted d0-dpu" in out and "(restart 1)" in out
        after = {p["name"]: p for p in tb.status()["processes"]}["d0-dpu"]
        assert after["alive"] and after["pid"] != before["pid"] and after["restarts"] == 1
        assert "alive (restarted 1x)" in _cli(tb, "testbed", "status").stdout
        _run(tb, tmp_path, "after-restart", job_id=78)
        p = _cli(tb, "testbed", "restart", "h0", check=False)
        assert p.returncode == 2 and "'h0' is not a DPU" in p.stderr and "Traceback" not in p.stderr


def _iproute2_interfaces(namespace: str) -> list[dict]:
    """testbed.status()'s interface records, built from ``ip -j -d addr`` and ``tc -j qdisc``."""
    qd: dict = {}
    for q in json.loads(subprocess.run(["tc", "-j", "-n", namespace, "qdisc", "show"], check=True,
                                       capture_output=True, text=True).stdout or "[]"):
        qd.setdefault(q.get("dev"), []).append(q.get("kind"))
    out = []
    for link in json.loads(subprocess.run(["ip", "-j", "-n", namespace, "-d", "addr", "show"], check=True,
                                          capture_output=True, text=True).stdout):
        if link.get("ifname") == "lo":
            continue
        xdp = link.get("xdp")
        out.append({"name": link.get("ifname"), "mac": link.get("address"), "mtu": link.get("mtu"),
                    "up": "UP" in link.get("flags", []), "master": link.get("master"),
                    "addresses": [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                                  if a.get("family") == "inet"],
                    "xdp": bool(xdp), "xdp_prog": (xdp or {}).get("prog", {}).get("id") if xdp else None,
                    "qdiscs": qd.get(link.get("ifname"), [])})
    return out
