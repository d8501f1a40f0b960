"""Two DDP ranks with the dosa hook against real userspace DPU workers on loopback: several
buckets per step streamed while backward runs (overlap) give bit-identical training to one blocking
round per step; fp16 and bf16 models train through the same hook (float32 residuals)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dosa.app.demo import free_port
from dosa.job import JobConfig
from userspace_dpus import userspace_dpu_workers

REPO = Path(__file__).resolve().parents[2]
NUMEL = 32 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
CONFIGS = [("f32_overlap", "float32", 1), ("f32_blocking", "float32", 0),
           ("bf16_overlap", "bfloat16", 1), ("f16_overlap", "float16", 1)]


@pytest.mark.timeout(180)
def test_two_ranks_overlap_equals_blocking_and_half_precision_trains(tmp_path):
    hosts = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    cfgs, specs = [], []
    for j, (name, dtype, overlap) in enumerate(CONFIGS):
        job = JobConfig(job_id=10 + j, numel=NUMEL, hosts=hosts, dpus=[("127.0.0.1", free_port())],
                        partition_size=4096, scale_exp=20)
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps(job.to_dict()))
        cfgs.append(cfg)
        specs.append(f"{name}:{dtype}:{overlap}:{cfg}")
    with userspace_dpu_workers(cfgs):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port(1)), WORLD_SIZE="2",
                   PYTHONPATH=str(REPO))
        ranks = [subprocess.Popen([sys.executable, str(REPO / "tests/unit/hook_ranks.py"),
                                   str(tmp_path / f"rank{r}.json"), *specs],
                                  cwd=REPO, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stderr=subprocess.PIPE, start_new_session=True) for r in range(2)]
        try:
            for r in ranks:
                _, err = r.communicate(timeout=150)
                assert r.returncode == 0, err.decode()[-3000:]
        finally:  # a failed or timed-out rank leaves no process behind (its session is its own)
            for r in ranks:
                if r.poll() is None:
                    os.killpg(r.pid, signal.SIGKILL)
                    r.wait()
    rep = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, _, overlap in CONFIGS:
        a, b = rep[0][name], rep[1][name]
        assert a["params"] == b["params"], f"{name}: the replicas differ"
        st = a["stats"]
        assert st["dosa_rounds"] == 8 and st["buckets_per_step"] > 1
        assert st["overlapped_rounds"] == (7 if overlap else 0)  # the first dosa step always parks
        assert st["residual_remaps"] >= 0 and st["bytes_sent"] > 0
        assert all(np.isfinite(np.concatenate([np.asarray(p) for p in a["params"]])))
        assert np.mean(a["losses"][-4:]) < np.mean(a["losses"][:4]), f"{name} did not learn"
    assert rep[0]["f32_overlap"]["params"] == rep[0]["f32_blocking"]["params"]
