"""The host's side of the control plane's join API (control/api; docs/control.md): one call
(:func:`request`), the join (:func:`join_raw`: the answer as sent; :func:`join`: the JobConfig,
unset arguments from the rank's DOSA_* environment). Stdlib HTTP only: every layer may call it."""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

from dosa import wire
from dosa.env import RankEnv
from dosa.errors import DosaError
from dosa.job import JobConfig


def _hostport(control) -> str:
    if isinstance(control, (tuple, list)):
        return f"{control[0]}:{int(control[1])}"
    return str(control).removeprefix("http://").rstrip("/")


def request(control, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    """One API call; a DosaError carrying the server's one-sentence message on any failure."""
    hp = _hostport(control)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{hp}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error") or e.reason
        except ValueError:
            msg = e.reason
        err = DosaError(f"control plane at {hp}: {msg}")
        err.status = e.code  # type: ignore[attr-defined]
        raise err from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise DosaError(f"cannot reach the control plane at {hp}: {reason}") from None


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


def join(control, worker_id: int | None = None, numel: int | None = None, *, job_id: int | None = None,
         address: str | None = None, port: int | None = None, workers: int | None = None,
         dpus: list | None = None, wait: float = 60.0, env=None, **job_kw) -> JobConfig:
    """Join a job and return its JobConfig once every worker has joined.

    Unset arguments come from the environment ``dosa testbed run`` (and torchrun) sets
    (:class:`dosa.env.RankEnv`): job_id <- DOSA_JOB_ID, address <- DOSA_HOST_ADDR, port <- DOSA_PORT,
    workers <- WORLD_SIZE, dpus <- DOSA_DPU_ADDRS. numel, workers and dpus let the first joiner
    create the job."""
    e = RankEnv.parse(env)
    if job_id is None:
        if e.job_id is None:
            raise DosaError("no job id: pass job_id or set DOSA_JOB_ID")
        job_id = e.job_id
    address = address or e.host_addr
    if not address:
        raise DosaError("no host address: pass address or set DOSA_HOST_ADDR")
    if port is None:
        port = e.port or wire.DEFAULT_PORT
    if workers is None:
        workers = e.world_size
    if dpus is None and e.dpu_addrs:
        dpus = [{"address": a, "port": e.port or wire.DEFAULT_PORT} for a in e.dpu_addrs]
    shape = dict(job_kw)
    if numel is not None:
        shape["numel"] = int(numel)
    if workers is not None:
        shape["workers"] = int(workers)
    if dpus is not None:
        shape["dpus"] = dpus
    return JobConfig.from_view(join_raw(control, job_id, address, port, worker_id, wait, **shape))
