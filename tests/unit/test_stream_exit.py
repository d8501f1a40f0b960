"""A training process may end while the dosa stream's thread is still inside torch (DDP's callbacks
run in the thread that completes a bucket's future). The process must still exit normally: a
daemon thread in libtorch at interpreter exit aborts the process with SIGABRT, which masked a
rank's real outcome in the demo."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dosa.app.demo import free_port
from dosa.job import JobConfig
from userspace_dpus import userspace_dpu_workers

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_process_exits_cleanly_while_the_stream_thread_is_in_torch(tmp_path):
    job = JobConfig(job_id=7, numel=20_000, hosts=[("127.0.0.1", free_port())],
                    dpus=[("127.0.0.1", free_port())], partition_size=4096, scale_exp=12)
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(job.to_dict()))
    with userspace_dpu_workers([cfg]):
        runs = [subprocess.run([sys.executable, str(REPO / "tests/unit/stream_exit_rank.py"), str(cfg)],
                               cwd=REPO, capture_output=True, text=True, timeout=60,
                               env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
                for _ in range(3)]
    for r in runs:
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
        assert "returns while the stream's thread is in torch" in r.stdout
