"""Userspace DPU workers as subprocesses on loopback, for the tests that run ranks against real
workers (tests/unit/test_torch_hook.py, test_torch_hook_ranks.py, test_stream_exit.py)."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from dosa.app.demo import stop_processes
from dosa.job import JobConfig

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def userspace_dpu_workers(job_configs, ready_timeout: float = 60.0):
    """Start ``dosa dpu run --mode userspace`` once per job config file, on 127.0.0.1 at the port
    of that job's first DPU, and wait until every worker has written its pid file (one deadline of
    ``ready_timeout`` seconds for all of them, counted once all are started). A worker that exits
    first fails the test with its stderr. Yields the processes; all are stopped on leaving the
    block, also when the start-up or the block fails."""
    workers: list[tuple[subprocess.Popen, Path]] = []
    try:
        for cfg in map(Path, job_configs):
            port = JobConfig.load(str(cfg)).dpus[0][1]
            ready = cfg.with_suffix(".ready")
            workers.append((subprocess.Popen(
                [sys.executable, "-m", "dosa", "dpu", "run", "--mode", "userspace", "--job-config",
                 str(cfg), "--addr", "127.0.0.1", "--port", str(port), "--pid-file", str(ready)],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True), ready))
        end = time.monotonic() + ready_timeout
        for p, ready in workers:
            while not ready.exists():
                assert p.poll() is None, p.stderr.read().decode()
                assert time.monotonic() < end, "DPU worker not ready"
                time.sleep(0.05)
        yield [p for p, _ in workers]
    finally:
        stop_processes([p for p, _ in workers])
