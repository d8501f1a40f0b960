"""The registry on disk: saved on every change, re-read by a restarted server of the same DPU.

Each job is kept as its job file (JobConfig.to_dict; workers that have not joined are null), with
the digests of the sessions that hold its members' leases (lease.py), written with mode 0600 to a
temporary file and renamed, so a crash mid-write leaves the previous registry."""
from __future__ import annotations

import json
import os

from dosa.errors import DosaError
from dosa.job import JobConfig


def load_jobs(path: str | None) -> tuple[dict[int, JobConfig], dict[int, dict[int, str]]]:
    """(jobs, lease holders) saved at ``path``; ({}, {}) when there is none or it cannot be read:
    a server starts empty rather than refuse to serve."""
    if not path or not os.path.exists(path):
        return {}, {}
    try:
        with open(path) as f:
            saved = json.load(f)
        jobs = [JobConfig.from_dict(d) for d in saved.get("jobs", [])]
        holders = {int(j): {int(w): str(h) for w, h in ws.items()}
                   for j, ws in (saved.get("holders") or {}).items()}
    except (OSError, ValueError, TypeError, AttributeError, DosaError):
        return {}, {}
    return {j.job_id: j for j in jobs}, holders


def save_jobs(path: str | None, jobs, holders: dict | None = None) -> None:
    if not path:
        return
    data = {"jobs": [j.to_dict() for j in jobs],
            "holders": {str(j): {str(w): h for w, h in ws.items()} for j, ws in (holders or {}).items()}}
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        json.dump(data, f)
    os.replace(tmp, path)
