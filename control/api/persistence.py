"""The registry on disk: saved on every change, re-read by a restarted server of the same DPU.

Each job is kept as its job file (JobConfig.to_dict; workers that have not joined are null), written
to a temporary file and renamed, so a crash mid-write leaves the previous registry."""
from __future__ import annotations

import json
import os

from dosa.errors import DosaError
from dosa.job import JobConfig


def load_jobs(path: str | None) -> dict[int, JobConfig]:
    """The jobs saved at ``path`` ({} when there is none or it cannot be read: a server starts empty
    rather than refuse to serve)."""
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            saved = json.load(f)
        jobs = [JobConfig.from_dict(d) for d in saved.get("jobs", [])]
    except (OSError, ValueError, TypeError, AttributeError, DosaError):
        return {}
    return {j.job_id: j for j in jobs}


def save_jobs(path: str | None, jobs) -> None:
    if not path:
        return
    data = {"jobs": [j.to_dict() for j in jobs]}
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
