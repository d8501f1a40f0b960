"""A host's membership in a job joined through the control plane: heartbeats, leave, and what the
heartbeat answers say about the other members (docs/control.md *Job lifecycle*).

Why: a job must end when its run ends, also when the run crashed. The client joins with a
``session`` token, beats every HEARTBEAT_S on a daemon thread (one kept-alive HTTP connection), and
leaves on close and at interpreter exit; a crashed run's lease runs out on the server. Each answer
lists every member's heartbeat age, so a round that stalls can name a dead host within seconds
(:meth:`Membership.problem`) instead of waiting out the no-progress timeout, and a job that was
released or re-created under this host is named as the cause (:attr:`Membership.broken`) instead of
the DPUs that drop its packets.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref

from dosa.errors import DosaError
from dosa.join import Channel

log = logging.getLogger("dosa.host")
HEARTBEAT_S = 0.25  # the server's control.api.lease.HEARTBEAT_S (host_lib does not import control)
#: a heartbeat answer older than this is not trusted to name anyone dead (the control plane may be
#: slow or unreachable; then the round's own timeout speaks)
FRESH_S = 1.5


def new_session() -> str:
    return uuid.uuid4().hex


class Membership:
    """Heartbeats of worker ``worker_id`` in ``job`` to the control plane at ``control``."""

    def __init__(self, control, job, worker_id: int, session: str, generation=None,
                 interval: float = HEARTBEAT_S):
        self.control = (str(control[0]), int(control[1]))
        self.job = job
        self.worker_id = int(worker_id)
        self.session = session
        self.generation = generation
        self.interval = float(interval)
        #: why this host's job is gone (released, re-created, rank taken), from the server; None: fine
        self.broken: str | None = None
        self.members: dict[int, dict] = {}
        self.answered_at = -1.0
        self._left = False
        self._pid = os.getpid()  # a forked child (a DataLoader worker) must not leave for its parent
        self._stop = threading.Event()
        self._conn: Channel | None = None
        self._t = threading.Thread(target=self._loop, name="dosa-heartbeat", daemon=True)
        self._t.start()
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() is not None and ref().close())
        atexit.register(self._atexit)

    # ---------------------------------------------------------------------------- HTTP
    def _call(self, method: str, path: str, body: dict, timeout: float):
        """(status, answer) over the kept-alive, signed connection (dosa.join.Channel)."""
        if self._conn is None:
            self._conn = Channel(self.control)
        return self._conn.call(method, path, body, timeout)

    def _beat(self) -> None:
        body = {"job_id": self.job.job_id, "worker_id": self.worker_id, "session": self.session}
        if self.generation is not None:
            body["generation"] = self.generation
        try:
            status, ans = self._call("POST", "/v1/heartbeat", body, timeout=max(1.0, 4 * self.interval))
        except DosaError as e:
            log.debug("heartbeat to %s:%d failed: %s", *self.control, e)
            return
        if status == 200:
            self.members = {int(w): m for w, m in (ans.get("lease") or {}).get("members", {}).items()}
            self.answered_at = time.monotonic()
        elif status in (401, 403, 404, 409):
            self.broken = ans.get("error") or f"the control plane answered {status}"
            self._stop.set()  # nothing to keep alive any more

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._beat()
            self._stop.wait(self.interval)

    # ---------------------------------------------------------------------------- what rounds ask
    def problem(self) -> dict[int, str] | None:
        """{worker id: sentence} of members that are dead (no heartbeat for the server's
        dead-after time) or have left, from a fresh heartbeat answer; None when all look alive."""
        if time.monotonic() - self.answered_at > FRESH_S:
            return None
        out = {w: f"worker {w} ({self._addr(w)}) is dead: no heartbeat for {m['heartbeat_age_s']:.1f} s"
               for w, m in self.members.items() if m.get("alive") is False}
        out.update({w: f"worker {w} ({self._addr(w)}) left the job"
                    for w in range(self.job.workers) if w not in self.members})
        return out or None

    def _addr(self, w: int) -> str:
        h = self.job.hosts[w] if 0 <= w < len(self.job.hosts) else None
        return f"{h[0]}:{h[1]}" if h else "?"

    # ---------------------------------------------------------------------------- the end
    def close(self) -> None:
        """Stop beating and leave the job (once; errors are logged, never raised: a host that
        cannot reach the control plane at exit leaves by its lease running out)."""
        if self._left or os.getpid() != self._pid:
            return
        self._left = True
        self._stop.set()
        if self._t is not threading.current_thread():
            self._t.join(2)
        try:
            atexit.unregister(self._atexit)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
        if self.broken is None:
            try:
                status, ans = self._call("POST", "/v1/leave", {"job_id": self.job.job_id,
                                                             "worker_id": self.worker_id,
                                                             "session": self.session}, timeout=2.0)
                if status != 200:
                    log.info("leaving job %d: %s", self.job.job_id, ans.get("error", status))
            except DosaError as e:
                log.info("leaving job %d: cannot reach the control plane (%s); its lease will run out",
                         self.job.job_id, e)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class StaleJobError(DosaError):
    """This host's job no longer exists as it joined it (released, re-created, rank taken over)."""
