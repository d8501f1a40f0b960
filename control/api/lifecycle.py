"""Jobs end: the parts of ControlService that release a job and answer heartbeats (docs/control.md
*Job lifecycle*). Kept here so service.py stays the endpoints' logic; every function takes the
service (its registry, locks, leases) as its first argument.

A job is released (removed from every DPU, its memory freed, its id free again) when
* its last member leaves (``POST /v1/leave``: AggregationClient and the hook leave on close and at
  exit), or
* its lease runs out: every member leased and silent for ``lease_s`` (a crashed run), found by the
  sweeper thread twice a second, or
* a new run joins it while every member of the old one is dead (no heartbeat for ``dead_after``):
  the job is re-created, a new generation at round 0, instead of handing the new run a job whose
  DPU state sits at the old run's round (the dataplane would drop every packet as round_too_old).

A released id stays unusable for :data:`REUSE_DELAY_S` (a join waits it out): a DPU worker polls its
jobs twice a second and must see the old job gone before a new one of the same id appears, or it
would keep serving the old one's addresses and shadow copies.
"""
from __future__ import annotations

import threading
import time

from dosa import wire

from .lease import next_generation
from .validation import ApiError, bad, req_int

REUSE_DELAY_S = 1.0
SWEEP_S = 0.5
_GONE_KEPT = 1024  # why a job id was released, for the 404s of late heartbeats


def req_session(req: dict) -> str | None:
    s = req.get("session")
    if s is None:
        return None
    if not isinstance(s, str) or not 1 <= len(s) <= 64:
        raise bad("session must be a string of 1..64 characters")
    return s


def note_created(svc, job_id: int) -> int:
    g = next_generation()
    svc.generations[job_id] = g
    svc.gone.pop(job_id, None)
    return g


def release(svc, job_id: int, reason: str) -> None:
    """Remove the job from every DPU (idempotent, best effort on unreachable DPUs) and remember why."""
    with svc._cv:
        job = svc.jobs.get(job_id)
    if job is not None:
        try:
            svc.peers.on_all_dpus(job, lambda i: svc._remove_job_here(job_id), "DELETE",
                                  f"/v1/local/jobs/{job_id}", None)
        except ApiError:
            svc._remove_job_here(job_id)  # this DPU at least; the others' restart forgets it
    with svc._cv:
        svc.jobs.pop(job_id, None)
        svc._save()
        svc.leases.drop(job_id)
        svc.generations.pop(job_id, None)
        svc.released_at[job_id] = time.monotonic()
        svc.gone[job_id] = reason
        while len(svc.gone) > _GONE_KEPT:
            svc.gone.pop(next(iter(svc.gone)))
        svc._cv.notify_all()


def gone_message(svc, job_id: int) -> str:
    why = svc.gone.get(job_id)
    return f"job {job_id} does not exist" + (f" any more: it was released ({why})" if why else "")


def wait_reusable(svc, job_id: int) -> None:
    """Block until ``job_id`` was released at least REUSE_DELAY_S ago (called under svc._op)."""
    t = svc.released_at.get(job_id)
    if t is not None:
        left = REUSE_DELAY_S - (time.monotonic() - t)
        if left > 0:
            time.sleep(left)


def reclaim_for_join(svc, job, wid, session: str | None, wait: float) -> bool:
    """Before a join with ``session`` into the existing ``job``: True when the job belongs to a run
    that is over (every member leased and dead, waiting up to dead_after + 1 s for a member that
    is still beating to fall silent) and was released, so the caller creates it anew. A rank held
    by a live member of another session is a 409 naming it."""
    if session is None:
        return False
    deadline = time.monotonic() + min(wait, svc.leases.dead_after + 1.0)
    while True:
        with svc._cv:
            members = list(job.joined)
            mine = isinstance(wid, int) and svc.leases.holds(job.job_id, wid, session)
        if not members:
            return False
        if svc.leases.all_dead(job.job_id, members):
            release(svc, job.job_id, "a new run joined while every worker of the old one was silent")
            return True
        held = isinstance(wid, int) and wid in members and not mine
        if not held:
            return False
        if time.monotonic() > deadline:
            ages = svc.leases.ages(job.job_id)
            age = ages.get(wid)
            who = f"{job.hosts[wid][0]}:{job.hosts[wid][1]}"
            raise ApiError(409, f"worker {wid} of job {job.job_id} is held by a live run ({who}" +
                           (f", heartbeat {age:.1f} s ago" if age is not None else ", no lease") +
                           "); wait for it to end or use another job id")
        time.sleep(0.1)


def heartbeat(svc, req: dict) -> dict:
    """``POST /v1/heartbeat {job_id, worker_id, session, generation?}``: renew this member's lease;
    the answer shows every member's liveness (the client names a dead one from it)."""
    job_id = req_int(req, "job_id", 1, 2**32 - 1)
    wid = req_int(req, "worker_id", 0, wire.MAX_WORKERS - 1)
    session = req_session(req)
    if session is None:
        raise bad("a heartbeat must carry the session its worker joined with")
    with svc._cv:
        job = svc.jobs.get(job_id)
        if job is None:
            raise ApiError(404, gone_message(svc, job_id))
        gen = svc.generations.get(job_id)
        if "generation" in req and req["generation"] != gen:
            raise ApiError(409, f"job {job_id} was re-created by another run (generation {gen}, "
                                f"this worker joined generation {req['generation']})")
        if wid >= job.workers or job.hosts[wid] is None:
            raise ApiError(404, f"worker {wid} is not a member of job {job_id} any more")
        why = svc.leases.beat(job_id, wid, session)
        if why is not None:  # another session's: a 403 (authority.py); no lease: a 409
            held = svc.leases.holder(job_id, wid) is not None
            raise ApiError(403 if held else 409, f"worker {wid} of job {job_id} {why}",
                           "not_the_holder" if held else None)
        return {"job_id": job_id, "generation": gen, "lease": svc.leases.view(job_id, list(job.joined))}


def decorate(svc, view: dict) -> dict:
    """A job view plus its generation and leases (what GET /v1/jobs and joins answer)."""
    job_id = view["job_id"]
    view["generation"] = svc.generations.get(job_id)
    view["lease"] = svc.leases.view(job_id, [h["worker_id"] for h in view.get("hosts", [])])
    return view


def after_leave(svc, job_id: int) -> bool:
    """Release the job when its last member has left; True when it did."""
    with svc._cv:
        job = svc.jobs.get(job_id)
        empty = job is not None and not job.joined
    if empty:
        release(svc, job_id, "every worker left")
    return empty


def sweep(svc) -> list[int]:
    """Release every job whose lease ran out; returns their ids."""
    with svc._cv:
        members = {j: list(job.joined) for j, job in svc.jobs.items()}
    out = []
    for job_id in svc.leases.expired(members):
        with svc._op:
            release(svc, job_id, f"its lease ran out: no heartbeat from any worker for "
                                 f"{svc.leases.lease_s:g} s")
        out.append(job_id)
    return out


class Sweeper:
    """The daemon thread that calls :func:`sweep` every SWEEP_S until ``stop()``."""

    def __init__(self, svc, interval: float = SWEEP_S):
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(svc, interval), name="dosa-lease-sweeper",
                                   daemon=True)
        self._t.start()

    def _loop(self, svc, interval):
        import logging

        log = logging.getLogger("dosa.ctl")
        while not self._stop.wait(interval):
            try:
                for j in sweep(svc):
                    log.warning("job %d released: its lease ran out", j)
            except Exception as e:  # noqa: BLE001 - the sweeper must outlive one bad pass
                log.error("lease sweep failed: %s", e)

    def stop(self):
        self._stop.set()
        self._t.join(2)
