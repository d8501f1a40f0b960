"""The rendezvous part of a join, torchrun style: which rank a joiner gets, and waiting until every
worker of the job has joined. Both run under the registry's condition variable."""
from __future__ import annotations

import threading
import time

from dosa.job import JobConfig

from .validation import ApiError, bad


def assign_rank(job: JobConfig, wid, address: str, port: int) -> int:
    """The joiner's worker id: the one it asked for, else the one it already holds from this
    address and port (a re-join), else the lowest free one (409 when the job is full)."""
    if wid is None:
        mine = [w for w, m in job.joined.items() if m == (address, port)]
        free = [w for w, m in enumerate(job.hosts) if m is None]
        if mine:
            wid = mine[0]
        elif not free:
            raise ApiError(409, f"job {job.job_id} is full: all {job.workers} workers have joined")
        else:
            wid = free[0]
    if isinstance(wid, bool) or not isinstance(wid, int) or not 0 <= wid < job.workers:
        raise bad(f"worker id {wid!r} outside 0..{job.workers - 1} for job {job.job_id}")
    return wid


def wait_complete(cv: threading.Condition, job: JobConfig, wait: float) -> None:
    """Block (holding ``cv``) until every worker joined or ``wait`` seconds passed (504 naming the
    missing ranks). ``wait=0`` returns at once."""
    deadline = time.monotonic() + wait
    while wait and not job.complete:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [w for w, m in enumerate(job.hosts) if m is None]
            raise ApiError(504, f"only {len(job.joined)} of {job.workers} workers joined job "
                                f"{job.job_id} within {wait} s; missing ranks {missing}")
        cv.wait(left)
