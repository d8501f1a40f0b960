"""Leases: a job lives as long as its workers do.

A worker that joins with a ``session`` (a token its process draws once: AggregationClient does)
holds a lease on its rank and keeps it by heartbeats (``POST /v1/heartbeat``, every
:data:`HEARTBEAT_S`). Why leases and not only ``leave``: a crashed run (SIGKILL, OOM, a lost
machine) never says goodbye, and its job would hold the DPU's memory and its job id forever.

* A member silent for :data:`DEAD_AFTER_S` is *dead*: heartbeat answers tell the other members so
  (their stalled round then names it, within seconds whatever the round size), and a new run may
  take the job over.
* A job whose members are all leased and silent for ``lease_s`` (default :data:`LEASE_S`) has run
  out: the server that holds the leases removes it from every DPU (the sweeper, control/api/service).
* Members joined without a session (an admin's ``join`` call, old clients) hold no lease: they never
  expire, and a job with such a member never runs out (``dosa ctl job rm`` removes it).

Each job carries a ``generation`` (a counter of this server's creations): a job re-created under the
same id is another generation, so a heartbeat of the old run is answered 409 ("re-created"), not
mistaken for the new one.

A session is also the member's authority (docs/control.md, *Credentials*): only a request carrying
it may heartbeat, leave or re-join as that member. The server keeps a session's SHA-256 only (a
leaked registry file names no session) and compares in constant time. The digests are saved with
the registry, so a restarted server gives each member a fresh lease held by the same session
(never by whichever session beats first).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import time
from dataclasses import dataclass

HEARTBEAT_S = 0.25  #: how often a client beats
DEAD_AFTER_S = 2.0  #: silence after which a member is reported dead (the 3 s dead-host budget)
LEASE_S = 10.0  #: silence of every member after which a job is released

_generations = itertools.count(1)


def next_generation() -> int:
    return next(_generations)


def digest(session: str) -> str:
    """What the server keeps of a session: its SHA-256 (hex)."""
    return hashlib.sha256(session.encode()).hexdigest()


@dataclass
class Lease:
    holder: str  # the SHA-256 of the session that joined as this member
    last_seen: float
    waiting: int = 0  # joins of this member blocked in the rendezvous: alive while they wait


class Leases:
    """Per job: ``{worker_id: Lease}`` of the members that joined with a session. Thread-safe."""

    def __init__(self, lease_s: float = LEASE_S, dead_after: float = DEAD_AFTER_S, clock=time.monotonic):
        if lease_s <= 0 or dead_after <= 0:
            raise ValueError("lease and dead-after times must be positive")
        self.lease_s = float(lease_s)
        self.dead_after = float(dead_after)
        self.clock = clock
        self._jobs: dict[int, dict[int, Lease]] = {}
        self._lock = threading.Lock()

    def grant(self, job_id: int, wid: int, session: str) -> None:
        self.restore(job_id, wid, digest(session))

    def restore(self, job_id: int, wid: int, holder: str) -> None:
        """A fresh lease held by the session whose digest is ``holder`` (a restarted server)."""
        with self._lock:
            self._jobs.setdefault(job_id, {})[wid] = Lease(holder, self.clock())

    def holds(self, job_id: int, wid: int, session: str | None) -> bool:
        """``session`` is the one that holds this member's lease (constant-time compare)."""
        h = self.holder(job_id, wid)
        return h is not None and session is not None and hmac.compare_digest(h, digest(session))

    def beat(self, job_id: int, wid: int, session: str) -> str | None:
        """Renew; None when renewed, else why not (no lease, or another session holds it)."""
        with self._lock:
            lease = self._jobs.get(job_id, {}).get(wid)
            if lease is None:
                return "holds no lease"
            if not hmac.compare_digest(lease.holder, digest(session)):
                return "is held by another session"
            lease.last_seen = self.clock()
            return None

    def waiting(self, job_id: int, wid: int, on: bool) -> None:
        """A member's join waits for the others (it cannot beat yet): count it alive meanwhile."""
        with self._lock:
            lease = self._jobs.get(job_id, {}).get(wid)
            if lease is not None:
                lease.waiting = max(0, lease.waiting + (1 if on else -1))
                lease.last_seen = self.clock()

    def drop(self, job_id: int, wid: int | None = None) -> None:
        with self._lock:
            if wid is None:
                self._jobs.pop(job_id, None)
            else:
                self._jobs.get(job_id, {}).pop(wid, None)

    def holder(self, job_id: int, wid: int) -> str | None:
        """The digest of the session holding this member's lease (None: no lease)."""
        with self._lock:
            lease = self._jobs.get(job_id, {}).get(wid)
            return None if lease is None else lease.holder

    def holders(self) -> dict[int, dict[int, str]]:
        """Every lease's holder, ``{job_id: {worker_id: digest}}`` (saved with the registry)."""
        with self._lock:
            return {j: {w: l.holder for w, l in ls.items()} for j, ls in self._jobs.items() if ls}

    def ages(self, job_id: int) -> dict[int, float]:
        """Seconds since each leased member's last heartbeat."""
        now = self.clock()
        with self._lock:
            return {w: 0.0 if l.waiting else now - l.last_seen
                    for w, l in self._jobs.get(job_id, {}).items()}

    def dead(self, job_id: int) -> dict[int, float]:
        return {w: a for w, a in self.ages(job_id).items() if a > self.dead_after}

    def all_dead(self, job_id: int, members) -> bool:
        """Every member of ``members`` is leased and dead (a run that is over without leaving)."""
        ages = self.ages(job_id)
        return bool(members) and all(w in ages and ages[w] > self.dead_after for w in members)

    def expired(self, jobs: dict) -> list[int]:
        """Jobs (of ``{job_id: members}``) whose members are all leased and silent for lease_s."""
        out = []
        for job_id, members in jobs.items():
            ages = self.ages(job_id)
            if members and all(w in ages and ages[w] > self.lease_s for w in members):
                out.append(job_id)
        return out

    def view(self, job_id: int, members) -> dict:
        """The job's leases as ``GET /v1/jobs`` and heartbeat answers show them."""
        ages = self.ages(job_id)
        leased = bool(members) and all(w in ages for w in members)
        return {"lease_s": self.lease_s, "dead_after_s": self.dead_after,
                "expires_in_s": (round(max(0.0, self.lease_s - min(ages[w] for w in members)), 3)
                                 if leased else None),
                "members": {str(w): {"heartbeat_age_s": round(ages[w], 3) if w in ages else None,
                                     "alive": (ages[w] <= self.dead_after) if w in ages else None}
                            for w in sorted(members)}}
