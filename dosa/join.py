"""The host's side of the control plane's join API (control/api; docs/control.md): a connection
(:class:`Channel`: TLS when a CA is given, every call signed with the deployment's secret), one
call (:func:`request`), the join (:func:`join_raw`: one request, the answer as sent;
:func:`join_view`: the join, its unset arguments from the rank's DOSA_* environment; :func:`join`:
the same, as a JobConfig). Stdlib HTTP only: every layer may call it."""
from __future__ import annotations

import http.client
import json
import logging
import ssl
import time

from dosa import auth
from dosa.env import RankEnv
from dosa.errors import DosaError
from dosa.job import JobConfig
from dosa.net import local_address_towards


_UNSET = object()
#: per control plane (``ADDR:PORT``): its clock minus ours, learnt from a 401 "stale" answer, so a
#: DPU whose clock is off (an ARM SoC without a battery-backed clock) is still reachable
_skew: dict[str, float] = {}


def _hostport(control) -> str:
    if isinstance(control, (tuple, list)):
        return f"{control[0]}:{int(control[1])}"
    return str(control).removeprefix("http://").removeprefix("https://").rstrip("/")


class Channel:
    """How this process talks to one control plane: the address, TLS when a CA certificate is given
    (``DOSA_CONTROL_CA``: https, the server's certificate checked against it), and the secret that
    signs each call (``DOSA_SECRET_FILE``; see dosa.auth). Keeps its connection alive between
    calls (the heartbeat thread makes four a second); ``close()`` ends it."""

    def __init__(self, control, *, secret=_UNSET, ca=_UNSET, role: str | None = None):
        self.hostport = _hostport(control)
        host, _, port = self.hostport.rpartition(":")
        if not host or not port.isdigit():
            raise DosaError(f"control plane address {self.hostport!r} must be ADDR:PORT")
        self.host, self.port = host, int(port)
        self.secret = auth.from_env() if secret is _UNSET else secret
        self.ca = RankEnv.parse().control_ca if ca is _UNSET else ca
        self.role = role
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if not self.ca:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            ctx = ssl.create_default_context(cafile=self.ca)
        except (OSError, ssl.SSLError) as e:
            raise DosaError(f"cannot read the control plane's CA certificate {self.ca}: {e}") from None
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=ctx)

    def _headers(self, method: str, path: str, data: bytes, role: str | None) -> dict:
        h = {"Content-Type": "application/json", "Content-Length": str(len(data))}
        if self.secret is not None:
            role = role or self.role or self.secret.default_role()
            h["Authorization"] = auth.authorization(self.secret, role, self.hostport, method, path, data,
                                                    now=time.time() + _skew.get(self.hostport, 0.0))
        return h

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0,
             role: str | None = None) -> tuple[int, dict]:
        """(HTTP status, answer) of one call. A kept-alive connection the server closed meanwhile
        is opened again once; a 401 for a clock that is off is signed again once with the server's
        time. A DosaError when the control plane cannot be reached."""
        data = json.dumps(body).encode() if body is not None else b""
        reconnect, resign = self._conn is not None, True
        while True:
            try:
                if self._conn is None:
                    self._conn = self._connect(timeout)
                self._conn.timeout = timeout
                if self._conn.sock is not None:
                    self._conn.sock.settimeout(timeout)
                self._conn.request(method, path, data, self._headers(method, path, data, role))
                r = self._conn.getresponse()
                raw = r.read()
                if r.will_close:
                    self.close()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if reconnect:  # the server had closed the kept-alive connection (idle): once more
                    reconnect = False
                    continue
                raise DosaError(self._unreachable(e)) from None
            reconnect = False
            try:
                ans = json.loads(raw or b"{}")
            except ValueError:
                ans = {}
            if not isinstance(ans, dict):
                ans = {}
            if r.status == 401 and ans.get("reason") == "stale" and resign \
                    and isinstance(ans.get("server_time"), (int, float)):
                _skew[self.hostport] = ans["server_time"] - time.time()
                resign = False
                continue
            return r.status, ans

    def _unreachable(self, e: Exception) -> str:
        reason = getattr(e, "reason", None) or e
        hint = ""
        if not self.ca and isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError)):
            hint = " (if it serves TLS, set DOSA_CONTROL_CA to its CA certificate)"
        return f"cannot reach the control plane at {self.hostport}: {reason}{hint}"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def request(control, method: str, path: str, body: dict | None = None, timeout: float = 10.0, *,
            role: str | None = None, secret=_UNSET, ca=_UNSET) -> dict:
    """One API call; a DosaError carrying the server's one-sentence message (and its HTTP status
    as ``.status``) on any failure. ``secret`` and ``ca`` default to DOSA_SECRET_FILE and
    DOSA_CONTROL_CA; ``role`` to the secret's host key (operator and peer calls name theirs)."""
    ch = Channel(control, secret=secret, ca=ca, role=role)
    try:
        status, ans = ch.call(method, path, body, timeout)
    finally:
        ch.close()
    if status != 200:
        err = DosaError(f"control plane at {ch.hostport}: {ans.get('error') or f'HTTP {status}'}")
        err.status = status  # type: ignore[attr-defined]
        raise err
    return ans


def join_raw(control, job_id: int, address: str, port: int | None = None, worker_id: int | None = None,
             wait: float = 60.0, **job_shape) -> dict:
    """POST /v1/join and return the response dict (see the module doc).

    A 503 means a DPU has no room for the job's aggregation slots until other jobs end
    (docs/dataplane.md, *Slots*): the join is retried every second, with one log line, until
    ``wait`` runs out; then the DPU's sentence (which names the jobs in the way) is the error."""
    deadline = time.monotonic() + wait
    said = False
    while True:
        left = max(0.0, deadline - time.monotonic())
        body = {"job_id": job_id, "address": address, "wait": left, **job_shape}
        if port is not None:
            body["port"] = port
        if worker_id is not None:
            body["worker_id"] = worker_id
        try:
            return request(control, "POST", "/v1/join", body, timeout=left + 10)
        except DosaError as e:
            if getattr(e, "status", None) != 503 or deadline - time.monotonic() < 1.0:
                raise
            if not said:
                logging.getLogger("dosa.host").warning("%s; waiting up to %.0f s", e, left)
                said = True
            time.sleep(1.0)


def join_view(control, worker_id: int | None = None, numel: int | None = None, *,
              job_id: int | None = None, address: str | None = None, port: int | None = None,
              workers: int | None = None, dpus: list | None = None, wait: float = 60.0, env=None,
              **job_kw) -> dict:
    """Join a job and return its view (the API's JSON, with ``generation``) once every worker has
    joined. The one place a rank's environment becomes a join: each argument left unset comes from
    the ``DOSA_*`` variables ``dosa testbed run``, the deploy and torchrun set
    (:class:`dosa.env.RankEnv`; ``env``: a RankEnv, a mapping, None for ``os.environ``, ``{}`` for
    none): job_id <- DOSA_JOB_ID, address <- DOSA_HOST_ADDR (else the local address towards the
    control plane), port <- DOSA_PORT + LOCAL_RANK (else the job's), workers <- WORLD_SIZE, dpus <-
    DOSA_DPU_ADDRS. numel, workers, dpus and ``job_kw`` (mode, density, partition_size, scale_exp,
    slots, mtu, session...) let the first joiner create the job."""
    e = env if isinstance(env, RankEnv) else RankEnv.parse(env)
    job_id = e.job_id if job_id is None else job_id
    if job_id is None:
        raise DosaError("no job id: pass job_id or set DOSA_JOB_ID")
    port = e.own_port if port is None else port  # DOSA_PORT + LOCAL_RANK: a node's ranks share its address
    if not address:
        address = e.host_addr or local_address_towards(_hostport(control).rpartition(":")[0])
    if workers is None:
        workers = e.world_size
    if dpus is None and e.dpu_addrs:
        dpus = [{"address": a, "port": e.port} if e.port else a for a in e.dpu_addrs]
    shape = dict(job_kw)
    if numel is not None:
        shape["numel"] = int(numel)
    if workers is not None:
        shape["workers"] = int(workers)
    if dpus:
        shape["dpus"] = list(dpus)
    return join_raw(control, job_id, address, port, worker_id, wait, **shape)


def join(control, worker_id: int | None = None, numel: int | None = None, **kw) -> JobConfig:
    """:func:`join_view` (the same arguments), as a JobConfig."""
    return JobConfig.from_view(join_view(control, worker_id, numel, **kw))
