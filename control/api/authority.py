"""Who may act as a member of a job: the session the member joined with (docs/control.md,
*Credentials*).

The deployment's host key says that a caller is one of the deployment's hosts, not which job or
rank is its own: every host has the same key. A member's session does: a random token its process
draws at its join (AggregationClient, the DDP hook), of which the server keeps a digest (lease.py).
So

* a heartbeat or a leave as member w needs w's session;
* a join as an existing member w (the one request that may move w's flow to another address or
  port) needs w's session: a worker's flow moves only by its own re-join, never by another member;
* a member that joined without a session (an admin's raw join) may be moved or removed by the
  operator only, or re-joined unchanged (same address and port, again without a session);

and the operator (``dosa ctl`` on a DPU; every caller of a server without a secret) may do all of it.
Each refusal is a 403 counted in /metrics as ``not_the_holder``."""
from __future__ import annotations

from .validation import ApiError

REASON = "not_the_holder"


def _refuse(msg: str) -> ApiError:
    return ApiError(403, msg, REASON)


def check_rejoin(svc, job, wid: int, session: str | None, member: tuple, role: str | None) -> None:
    """Before a join as worker ``wid`` of ``job`` from ``member`` (address, port)."""
    have = job.hosts[wid]
    if have is None or role == "operator":
        return
    if svc.leases.holder(job.job_id, wid) is not None:
        if not svc.leases.holds(job.job_id, wid, session):
            raise _refuse(f"worker {wid} of job {job.job_id} is held by another session: only its own "
                          "process may join as it again")
    elif session is not None or have != member:
        raise _refuse(f"worker {wid} of job {job.job_id} joined without a session: only the operator "
                      "may move it")


def check_leave(svc, job_id: int, wid: int, session: str | None, role: str | None) -> None:
    """Before a leave as worker ``wid`` of job ``job_id``."""
    if role == "operator":
        return
    if svc.leases.holder(job_id, wid) is None:
        raise _refuse(f"worker {wid} of job {job_id} joined without a session: only the operator may "
                      "remove it")
    if not svc.leases.holds(job_id, wid, session):
        raise _refuse(f"worker {wid} of job {job_id} is held by another session: only its own process "
                      "may leave as it")
