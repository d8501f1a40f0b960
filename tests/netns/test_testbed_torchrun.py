"""``dosa testbed run --torchrun``: one real torchrun agent per host namespace, c10d rendezvous over
the fabric, a plain DDP script with the dosa hook through the testbed's DPU (end to end)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]
REPO = Path(__file__).resolve().parents[2]


def test_torchrun_agents_rendezvous_over_the_fabric_and_train_through_dosa(tmp_path):
    with scratch_testbed(hosts=2, dpus=1) as tb:
        env = {**os.environ, "DOSA_TESTBED_PREFIX": tb.prefix, "DOSA_TESTBED_STATE_DIR": str(tb.state_dir)}
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "run", "--torchrun", "--timeout", "180",
                            "--log-dir", str(tmp_path), "--", "examples/ddp_dosa.py", "--steps", "12"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=220)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        nodes = {n["name"]: n["address"] for n in tb.status()["nodes"]}
    recs = []
    for line in p.stdout.splitlines():
        _, _, payload = line.partition("] ")
        if payload.startswith("{"):
            recs.append(json.loads(payload))
    assert sorted(r["rank"] for r in recs) == [0, 1]
    assert {r["dosa_host_addr"] for r in recs} == {nodes["h0"], nodes["h1"]}
    for r in recs:
        assert r["torchelastic_run_id"] and r["world_size"] == 2  # started by torchrun's agent
        assert r["master_addr"] in (nodes["h0"], nodes["h1"])  # rendezvous over the fabric
        assert r["replicas_identical"] and r["last_loss"] < r["first_loss"]
        st = r["stats"]
        assert st["dosa_rounds"] == 12 and st["fallbacks"] == 0 and st["bytes_sent"] > 0
        assert st["overlapped_rounds"] == 11 and st["buckets_per_step"] > 1
