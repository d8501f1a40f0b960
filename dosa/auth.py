"""Who may change the control plane: the deployment's secret, the signature a caller puts on each
request, and the check a server makes of it (docs/control.md, *Credentials*).

Why an HMAC and not a bearer token: TLS is optional, and a token sent in the clear is the
credential itself -- whoever sees one request (a capture on the fabric, a proxy's log) holds the
deployment's key. Here the key never crosses the wire: each request carries
``HMAC-SHA256(key of its role, role, audience, method, path, timestamp, nonce, SHA-256(body))``.
A captured request cannot be changed (the body is signed), sent to another DPU (the audience, the
``ADDR:PORT`` the caller addressed, is signed), or sent again (the server keeps every nonce it
accepted for the whole window in which the timestamp is valid).

Roles, each with a key of its own, so a host's file cannot act as a DPU or an operator:

* ``host``: join, heartbeat and leave (what training processes do); every host has it;
* ``operator``: create and remove jobs, move or remove any member (``dosa ctl`` on a DPU);
* ``peer``: the DPU-to-DPU ``/v1/local/*`` endpoints (only control planes).

A DPU's secret file holds all three keys, a host's only ``host`` (:meth:`Secret.only`). The file is
JSON, written with mode 0600 and refused when others may read it (as ssh refuses a private key).
"""
from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field

from dosa.errors import DosaError

SCHEME = "DOSA-HMAC-SHA256"
ROLES = ("host", "operator", "peer")
#: A request's timestamp may be this far from the server's clock, either way (seconds).
WINDOW_S = 30.0
#: Accepted nonces kept at most (only requests with a valid signature enter: a stranger cannot
#: fill it); a server that holds this many within one window refuses new requests until some expire.
MAX_NONCES = 200_000
_FORMAT = 1
_FIELD_RE = re.compile(r"^[a-z]+=[A-Za-z0-9.:_-]{1,128}$")


class AuthError(DosaError):
    """A refused credential: ``status`` 401 (none, malformed, wrong, stale, replayed), 403
    (authenticated, but its role may not make this call) or 429 (the nonce cache is full);
    ``reason`` is the metrics label."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Secret:
    """The keys of the roles its holder has (``{role: 32 random bytes}``); ``path``: where it was
    read from, for messages."""

    keys: dict = field(default_factory=dict)
    path: str | None = None

    @classmethod
    def new(cls) -> "Secret":
        """A fresh deployment secret: a random key for every role."""
        return cls({r: secrets.token_bytes(32) for r in ROLES})

    def has(self, role: str) -> bool:
        return role in self.keys

    def only(self, *roles: str) -> "Secret":
        """The same keys, restricted to ``roles`` (a host's file: ``only("host")``)."""
        return Secret({r: k for r, k in self.keys.items() if r in roles})

    def default_role(self) -> str:
        """The role a caller signs with unless told otherwise: host, else operator."""
        for r in ("host", "operator", "peer"):
            if r in self.keys:
                return r
        raise DosaError(f"secret file {self.path or '(in memory)'} holds no key")

    def dumps(self) -> bytes:
        keys = {r: base64.b64encode(k).decode() for r, k in sorted(self.keys.items())}
        return (json.dumps({"dosa_secret": _FORMAT, "keys": keys}, indent=1) + "\n").encode()

    @classmethod
    def loads(cls, data: bytes, path: str = "(in memory)") -> "Secret":
        try:
            doc = json.loads(data)
            if doc.get("dosa_secret") != _FORMAT or not isinstance(doc.get("keys"), dict):
                raise ValueError
            keys = {r: base64.b64decode(v, validate=True) for r, v in doc["keys"].items()}
        except (ValueError, TypeError, AttributeError):
            raise DosaError(f"{path} is not a dosa secret file (make one with `dosa ctl secret`)") from None
        bad = [r for r, k in keys.items() if r not in ROLES or len(k) < 16]
        if bad or not keys:
            raise DosaError(f"secret file {path} has an unknown role or a key shorter than 16 bytes")
        return cls(keys, path)

    def save(self, path: str) -> str:
        """Write atomically with mode 0600 (never readable by others, not even for a moment)."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, self.dumps())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> "Secret":
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise DosaError(f"cannot read the secret file {path}: {e.strerror}") from None
        try:
            mode = os.fstat(fd).st_mode & 0o777
            if mode & 0o077:
                raise DosaError(f"secret file {path} may be read by others (mode {mode:o}): "
                                f"`chmod 600 {path}`")
            data = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        return cls.loads(data, path)


def make_files(dpu_file: str, host_file: str) -> Secret:
    """A new deployment secret in its two files (mode 0600): the DPUs' (every role) and the
    hosts' (the host key only). What ``dosa testbed up``, ``dosa deploy`` and ``dosa ctl secret``
    write."""
    s = Secret.new()
    s.save(dpu_file)
    s.only("host").save(host_file)
    return Secret(s.keys, dpu_file)


def from_env(env=None) -> Secret | None:
    """The secret ``DOSA_SECRET_FILE`` names (None when unset): how ranks, ``dosa ctl`` and the
    DPU services find it, set by ``dosa testbed`` and ``dosa deploy``."""
    from dosa.env import RankEnv

    path = RankEnv.parse(env).secret_file
    return Secret.load(path) if path else None


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body or b"").hexdigest()


def canonical(role: str, audience: str, method: str, path: str, ts_ms: int, nonce: str,
              body: bytes) -> bytes:
    """The bytes a signature covers: every part of a request whose change would change its effect."""
    return "\n".join([SCHEME, role, audience, method.upper(), path, str(ts_ms), nonce,
                      body_digest(body)]).encode()


def _mac(key: bytes, msg: bytes) -> str:
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def authorization(secret: Secret, role: str, audience: str, method: str, path: str, body: bytes,
                  now: float | None = None, nonce: str | None = None) -> str:
    """The ``Authorization`` header value of one request (``audience``: ``ADDR:PORT`` addressed)."""
    key = secret.keys.get(role)
    if key is None:
        raise DosaError(f"secret file {secret.path or '(in memory)'} holds no {role} key "
                        f"(it has: {', '.join(sorted(secret.keys)) or 'none'})")
    ts = int(round((time.time() if now is None else now) * 1000))
    nonce = nonce or secrets.token_hex(16)
    sig = _mac(key, canonical(role, audience, method, path, ts, nonce, body))
    return f"{SCHEME} role={role},aud={audience},ts={ts},nonce={nonce},sig={sig}"


def parse(header: str | None) -> dict:
    """The fields of an Authorization header (401 AuthError when absent or malformed)."""
    if not header:
        raise AuthError(401, "no_credential", "this control plane needs credentials and the request "
                        "carries none (set DOSA_SECRET_FILE to the deployment's secret file)")
    scheme, _, rest = header.strip().partition(" ")
    parts = [p.strip() for p in rest.split(",")]
    if scheme != SCHEME or len(rest) > 512 or not all(_FIELD_RE.match(p) for p in parts):
        raise AuthError(401, "bad_credential", f"the Authorization header is not a {SCHEME} credential")
    f = dict(p.split("=", 1) for p in parts)
    if set(f) != {"role", "aud", "ts", "nonce", "sig"} or not f["ts"].isdigit() \
            or not re.fullmatch(r"[0-9a-f]{16,64}", f["nonce"]) or not re.fullmatch(r"[0-9a-f]{64}", f["sig"]):
        raise AuthError(401, "bad_credential", f"the Authorization header is not a {SCHEME} credential")
    return f


class Verifier:
    """A server's check of signed requests: its secret, the audiences it answers to
    (``ADDR:PORT`` strings), the time window and the nonces it already accepted. Thread-safe."""

    def __init__(self, secret: Secret, audiences, window: float = WINDOW_S, clock=time.time,
                 max_nonces: int = MAX_NONCES):
        self.secret = secret
        self.audiences = frozenset(audiences)
        self.window = float(window)
        self.clock = clock
        self.max_nonces = max_nonces
        self._seen: dict[str, float] = {}
        self._order: collections.deque = collections.deque()  # (expiry, nonce), in arrival order
        self._lock = threading.Lock()

    def verify(self, header: str | None, method: str, path: str, body: bytes, allowed) -> str:
        """The caller's role when ``header`` signs this request with a key of a role in ``allowed``;
        else AuthError. The signature is checked before anything the caller could learn from."""
        f = parse(header)
        key = self.secret.keys.get(f["role"])
        if key is None:
            raise AuthError(401, "bad_credential", f"this control plane has no role {f['role']!r}")
        if f["aud"] not in self.audiences:
            raise AuthError(401, "wrong_audience", f"the request was signed for {f['aud']}, this is "
                            f"{' / '.join(sorted(self.audiences))}")
        expect = _mac(key, canonical(f["role"], f["aud"], method, path, int(f["ts"]), f["nonce"], body))
        if not hmac.compare_digest(expect, f["sig"]):
            raise AuthError(401, "bad_signature", "the request's signature is wrong (another "
                            "deployment's secret, or the request was changed on the way)")
        now = self.clock()
        skew = int(f["ts"]) / 1000 - now
        if abs(skew) > self.window:
            raise AuthError(401, "stale", f"the request's timestamp is {skew:+.0f} s from this control "
                            f"plane's clock (at most {self.window:g} s either way)")
        with self._lock:
            while self._order and self._order[0][0] < now:
                _, old = self._order.popleft()
                self._seen.pop(old, None)
            if f["nonce"] in self._seen:
                raise AuthError(401, "replayed", "this request was already received once (a replay)")
            if len(self._seen) >= self.max_nonces:
                raise AuthError(429, "busy", "too many signed requests within one time window; retry")
            expiry = now + 2 * self.window
            self._seen[f["nonce"]] = expiry
            self._order.append((expiry, f["nonce"]))
        if f["role"] not in allowed:
            raise AuthError(403, "role_not_allowed", f"the {f['role']} credential may not make this "
                            f"call (it needs: {' or '.join(allowed)})")
        return f["role"]
