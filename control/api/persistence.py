"""The registry on disk: saved on every change, re-read by a restarted server of the same DPU.

Written to a temporary file and renamed, so a crash mid-write leaves the previous registry."""
from __future__ import annotations

import json
import os

from .job import Job


def load_jobs(path: str | None) -> dict[int, Job]:
    """The jobs saved at ``path`` ({} when there is none or it cannot be read: a server starts empty
    rather than refuse to serve)."""
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            saved = json.load(f)
        jobs = {}
        for d in saved.get("jobs", []):
            members = {int(w): tuple(m) for w, m in d.pop("members", {}).items()}
            job = Job(**{**d, "dpus": [tuple(x) for x in d["dpus"]]}, members=members)
            jobs[job.job_id] = job
        return jobs
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def save_jobs(path: str | None, jobs) -> None:
    if not path:
        return
    data = {"jobs": [{**{k: v for k, v in j.__dict__.items() if k != "members"},
                      "members": {str(w): list(m) for w, m in j.members.items()}}
                     for j in jobs]}
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
