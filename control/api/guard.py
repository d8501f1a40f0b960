"""Who may call what: the roles each route takes, the check of a request's credential against them
(dosa.auth.Verifier), and the counts of refused calls and dropped connections that /metrics serves.

A server without a secret (in-process tests, ``dosa ctl serve --insecure``) checks nothing and takes
every caller for the operator: the API as it was before credentials.
"""
from __future__ import annotations

import collections
import threading
import time

from dosa.auth import WINDOW_S, AuthError, Verifier

#: roles a route takes (None: open to anyone, read-only routes)
OPEN = None
MEMBERS = ("host", "operator")  # join, leave, heartbeat: hosts, and the operator on their behalf
OPERATOR = ("operator",)  # create and remove jobs
PEER = ("peer",)  # /v1/local/*: only another DPU's control plane


class Guard:
    def __init__(self, secret=None, audiences=(), window: float = WINDOW_S):
        self.verifier = Verifier(secret, audiences, window) if secret is not None else None
        self._refused: collections.Counter = collections.Counter()
        self._dropped: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    @property
    def enforcing(self) -> bool:
        return self.verifier is not None

    def check(self, roles, header: str | None, method: str, path: str, body: bytes) -> str | None:
        """The caller's role (None for an open route; "operator" on a server without a secret);
        an AuthError, counted, when the credential is missing, wrong or of another role."""
        if roles is OPEN:
            return None
        if self.verifier is None:
            return "operator"
        try:
            return self.verifier.verify(header, method, path, body, roles)
        except AuthError as e:
            self.refused(e.reason)
            raise

    def now(self) -> float:
        """The clock the timestamps are checked against (what a 401 "stale" tells the client)."""
        return self.verifier.clock() if self.verifier is not None else time.time()

    def refused(self, reason: str) -> None:
        """Count a refused call (also the service's 403s: a member's session that does not match)."""
        with self._lock:
            self._refused[reason] += 1

    def dropped(self, reason: str) -> None:
        """Count a connection the server closed (too many, or a request that missed its deadline)."""
        with self._lock:
            self._dropped[reason] += 1

    def counts(self) -> tuple[dict, dict]:
        """(refused calls by reason, dropped connections by reason)."""
        with self._lock:
            return dict(self._refused), dict(self._dropped)
