"""The network API hosts call to join a job (JSON over HTTP, stdlib only), and its Python client.

Every DPU runs one control server next to its dataplane. A host joins through any one of them
(the testbed uses DPU 0's); that server installs the host's flow in the dataplane of EVERY DPU of
the job: its own directly, the others through their servers' ``/v1/local/*`` endpoints. A job is
created by an admin request (``POST /v1/jobs``) or by its first joiner when the join request carries
the job's shape (numel, workers, dpus), like a torchrun rendezvous.

Every DPU of a job keeps the job's full view (density, mode, dpus, hosts...) in its registry, in XDP
and userspace mode alike: a DPU worker asking its own control plane learns the whole job, and a
host may join through any DPU that knows it.

Endpoints (request and response bodies are JSON objects)::

    POST /v1/join    {job_id, worker_id|rank?, address, port?, wait?, [numel, workers, dpus,
                      partition_size, scale_exp, mode, density]}  -> the job as the host needs it
    POST /v1/leave   {job_id, worker_id}
    POST /v1/jobs    {job_id, workers, numel, dpus, ...}          -> create a job on all its DPUs
    GET  /v1/jobs  |  GET /v1/jobs/<id>  |  DELETE /v1/jobs/<id>
    GET  /v1/stats                                                 -> this DPU's counters
    POST /v1/local/jobs, /v1/local/flows; DELETE /v1/local/jobs/<id>, /v1/local/flows/<id>/<w>
                                                                   (server to server: this DPU only)

Errors are ``{"error": "<one sentence>"}`` with 400 (malformed), 404 (unknown job), 409 (conflict:
rank taken, job full, shape differs), 504 (not every worker joined within ``wait``), 507 (the
dataplane's pools are full).
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dosa import wire
from dosa.errors import DosaError

from .alloc import AdmissionError

DEFAULT_CONTROL_PORT = 17800


class ApiError(DosaError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _bad(msg: str) -> ApiError:
    return ApiError(400, msg)


def _int(req: dict, name: str, lo: int, hi: int, default=None) -> int:
    v = req.get(name, default)
    if v is None:
        raise _bad(f"field {name!r} is required")
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"field {name!r} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise _bad(f"field {name!r} = {v} outside {lo}..{hi}")
    return v


def _addr(v, what: str) -> str:
    import socket

    if not isinstance(v, str):
        raise _bad(f"{what} must be an IPv4 address string, got {v!r}")
    try:
        socket.inet_aton(v)
    except OSError:
        raise _bad(f"{what} {v!r} is not an IPv4 address") from None
    if v.count(".") != 3:
        raise _bad(f"{what} {v!r} is not a dotted IPv4 address")
    return v


@dataclass
class Job:
    job_id: int
    workers: int
    numel: int
    dpus: list  # [(address, data port)], index = DPU index
    partition_size: int = wire.DEFAULT_PARTITION_SIZE
    scale_exp: int = 16
    mode: str = "sum"
    density: float = 0.01
    port: int = wire.DEFAULT_PORT
    members: dict = field(default_factory=dict)  # worker_id -> (address, port)

    def view(self, worker_id: int | None = None) -> dict:
        pm = wire.PartitionMap(self.numel, self.partition_size, len(self.dpus))
        d = {"job_id": self.job_id, "workers": self.workers, "numel": self.numel,
             "partition_size": self.partition_size, "num_partitions": pm.num_partitions,
             "scale_exp": self.scale_exp, "mode": self.mode, "density": self.density, "port": self.port,
             "dpus": [{"index": i, "address": a, "port": p} for i, (a, p) in enumerate(self.dpus)],
             "hosts": [{"worker_id": w, "address": a, "port": p} for w, (a, p) in sorted(self.members.items())],
             "complete": len(self.members) == self.workers}
        if worker_id is not None:
            d["worker_id"] = worker_id
        return d


class ControlService:
    """The API's logic, usable in-process. ``controller`` is this DPU's control.Controller, or None
    when the DPU merges in user space (then only the registry is kept)."""

    def __init__(self, controller=None, address: str = "127.0.0.1", data_port: int = wire.DEFAULT_PORT,
                 control_port: int = DEFAULT_CONTROL_PORT, peer_timeout: float = 5.0,
                 state_path: str | None = None):
        self.controller = controller
        self.address = address
        self.data_port = data_port
        self.control_port = control_port
        self.peer_timeout = peer_timeout
        self.jobs: dict[int, Job] = {}
        # _cv guards the registry (held briefly, never across a call to another DPU) and wakes
        # rendezvous waiters; _op serialises this server's fan-outs to the DPUs of a job
        self._cv = threading.Condition(threading.RLock())
        self._op = threading.Lock()
        self.state_path = state_path
        self._load()

    # ----------------------------------------------------------------------------- persistence
    def _load(self) -> None:
        """Re-read the registry a previous server of this DPU saved, keeping only jobs the local
        dataplane still has (a restarted server must not 404 on, or re-create, a live job)."""
        if not self.state_path or not os.path.exists(self.state_path):
            return
        try:
            with open(self.state_path) as f:
                saved = json.load(f)
            for d in saved.get("jobs", []):
                members = {int(w): tuple(m) for w, m in d.pop("members", {}).items()}
                job = Job(**{**d, "dpus": [tuple(x) for x in d["dpus"]]}, members=members)
                if self.controller is not None and self._my_index(job) is not None \
                        and self.controller.maps.job_info(job.job_id) is None:
                    continue
                self.jobs[job.job_id] = job
        except (OSError, ValueError, TypeError, KeyError):
            self.jobs = {}  # unreadable: start empty rather than refuse to serve

    def _save(self) -> None:
        if not self.state_path:
            return
        data = {"jobs": [{**{k: v for k, v in j.__dict__.items() if k != "members"},
                          "members": {str(w): list(m) for w, m in j.members.items()}}
                         for j in self.jobs.values()]}
        tmp = self.state_path + ".tmp"
        os.makedirs(os.path.dirname(self.state_path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.state_path)

    # ------------------------------------------------------------------------- shape of a new job
    def _parse_job(self, req: dict, port_field: str = "job_port") -> Job:
        job_id = _int(req, "job_id", 1, 2**32 - 1)
        workers = _int(req, "workers", 1, wire.MAX_WORKERS)
        numel = _int(req, "numel", 1, 2**32 - 1)
        psize = _int(req, "partition_size", 1, 2**32 - 1, wire.DEFAULT_PARTITION_SIZE)
        scale = _int(req, "scale_exp", wire.SCALE_EXP_MIN, wire.SCALE_EXP_MAX, 16)
        port = _int(req, port_field, 1, 65535, self.data_port)  # the job's UDP port on the DPUs
        mode = req.get("mode", "sum")
        if mode not in ("sum", "gtopk"):
            raise _bad(f"mode must be 'sum' or 'gtopk', got {mode!r}")
        density = req.get("density", 0.01)
        if not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise _bad(f"density must be a number in (0, 1], got {density!r}")
        dpus_raw = req.get("dpus") or [self.address]
        if not isinstance(dpus_raw, list):
            raise _bad("dpus must be a list of addresses or {address, port} objects")
        dpus = []
        for d in dpus_raw:
            if isinstance(d, dict):
                dpus.append((_addr(d.get("address"), "DPU address"),
                             _int(d, "port", 1, 65535, self.data_port)))
            else:
                dpus.append((_addr(d, "DPU address"), self.data_port))
        try:
            wire.PartitionMap(numel, psize, len(dpus))
        except ValueError as e:
            raise _bad(str(e)) from None
        return Job(job_id, workers, numel, dpus, psize, scale, mode, float(density), port)

    def _same_shape(self, job: Job, req: dict) -> None:
        for name in ("workers", "numel", "partition_size"):
            if name in req and req[name] != getattr(job, name):
                raise ApiError(409, f"job {job.job_id} has {name} {getattr(job, name)}, "
                                    f"the request says {req[name]}")

    # ----------------------------------------------------------------------------- fan-out to DPUs
    def _my_index(self, job: Job) -> int | None:
        for i, (a, _) in enumerate(job.dpus):
            if a == self.address:
                return i
        return None

    def _peer(self, address: str, method: str, path: str, body: dict | None = None) -> dict:
        return request(f"{address}:{self.control_port}", method, path, body, timeout=self.peer_timeout)

    def _on_all_dpus(self, job: Job, local_fn, method: str, path: str, body: dict | None,
                     undo=None) -> None:
        """Run one step on every DPU of the job: this one by ``local_fn(i)``, the others by
        ``method path body`` on their servers. With ``undo(i, address)``, a refusal undoes the step
        on the DPUs that had done it (all or nothing); without, the step stops at the refusal
        (removals, which are idempotent: the caller may retry)."""
        done = []
        try:
            for i, (a, _) in enumerate(job.dpus):
                if a == self.address:
                    local_fn(i)
                else:
                    try:
                        self._peer(a, method, path, dict(body or {}, dpu_index=i))
                    except DosaError as e:
                        st = getattr(e, "status", 502)
                        raise ApiError(st if st in (409, 507) else 502, f"DPU {i} ({a}) refused: {e}") from None
                done.append((i, a))
        except ApiError:
            for i, a in reversed(done if undo is not None else []):
                try:
                    undo(i, a)
                except DosaError:
                    pass  # unreachable now: the job's removal or a restart of that DPU clears it
            raise

    def _job_body(self, job: Job) -> dict:
        """The job as every DPU's registry keeps it (the same view hosts get, plus ``num_dpus``):
        a DPU worker asking its own control plane must learn density, mode, DPUs and hosts."""
        body = job.view()
        for k in ("complete", "num_partitions", "worker_id"):
            body.pop(k, None)
        body["num_dpus"] = len(job.dpus)
        return body

    def _install_job(self, job: Job) -> None:
        """Install on every DPU (dataplane in XDP mode, registry in both modes); when one refuses,
        remove it from those that accepted (a job is on all its DPUs or on none)."""
        def undo(i, a):
            if a == self.address:
                self._remove_job_here(job.job_id)
            else:
                self._peer(a, "DELETE", f"/v1/local/jobs/{job.job_id}")

        self._on_all_dpus(job, lambda i: self._install_job_here(job, i), "POST", "/v1/local/jobs",
                          self._job_body(job), undo)

    # ------------------------------------------------------------------------------------ requests
    def create_job(self, req: dict) -> dict:
        job = self._parse_job(req, "port")
        with self._op:
            with self._cv:
                if job.job_id in self.jobs:
                    raise ApiError(409, f"job {job.job_id} already exists")
            self._install_job(job)
            with self._cv:
                self.jobs[job.job_id] = job
                self._save()
                return job.view()

    def join(self, req: dict) -> dict:
        if not isinstance(req, dict):
            raise _bad("the join request must be a JSON object")
        job_id = _int(req, "job_id", 1, 2**32 - 1)
        address = _addr(req.get("address"), "address")
        wait = req.get("wait", 0)
        if not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
            raise _bad(f"wait must be 0..3600 seconds, got {wait!r}")
        # _op: one fan-out at a time from this server (HTTP to peers happens under it, never under
        # _cv, which every server's /v1/local/* handlers take: two DPUs coordinating joins at once
        # cannot deadlock each other)
        with self._op:
            with self._cv:
                job = self.jobs.get(job_id)
            if job is None:
                if "numel" not in req or "workers" not in req:
                    raise ApiError(404, f"job {job_id} does not exist (a first joiner must give numel "
                                        "and workers to create it)")
                job = self._parse_job(req)
                self._install_job(job)
                with self._cv:
                    self.jobs[job_id] = job
                    self._save()
            else:
                self._same_shape(job, req)
            port = _int(req, "port", 1, 65535, job.port)
            with self._cv:
                wid = req.get("worker_id", req.get("rank"))
                if wid is None:
                    free = [w for w in range(job.workers) if w not in job.members]
                    mine = [w for w, m in job.members.items() if m == (address, port)]
                    if mine:
                        wid = mine[0]
                    elif not free:
                        raise ApiError(409, f"job {job_id} is full: all {job.workers} workers have joined")
                    else:
                        wid = free[0]
                if isinstance(wid, bool) or not isinstance(wid, int) or not 0 <= wid < job.workers:
                    raise _bad(f"worker id {wid!r} outside 0..{job.workers - 1} for job {job_id}")
                have = job.members.get(wid)
            if have is not None and have != (address, port) and not req.get("replace"):
                raise ApiError(409, f"worker {wid} of job {job_id} already joined from {have[0]}:{have[1]}")
            flow = {"job_id": job_id, "worker_id": wid, "address": address, "port": port}
            old = None if have is None else dict(flow, address=have[0], port=have[1])

            def undo(i, a):  # put back what the DPU had before this join
                if a == self.address:
                    if old is None:
                        self.local_remove_flow(job_id, wid)
                    else:
                        self.local_install_flow(old)
                elif old is None:
                    self._peer(a, "DELETE", f"/v1/local/flows/{job_id}/{wid}")
                else:
                    self._peer(a, "POST", "/v1/local/flows", dict(old, dpu_index=i))

            self._on_all_dpus(job, lambda i: self.local_install_flow(flow), "POST", "/v1/local/flows",
                              flow, undo)
            with self._cv:
                job.members[wid] = (address, port)  # already there when this server is a DPU of the job
                self._save()
                self._cv.notify_all()
        with self._cv:
            deadline = time.monotonic() + wait
            while wait and len(job.members) < job.workers:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [w for w in range(job.workers) if w not in job.members]
                    raise ApiError(504, f"only {len(job.members)} of {job.workers} workers joined job "
                                        f"{job_id} within {wait} s; missing ranks {missing}")
                self._cv.wait(left)
            return job.view(wid)

    def leave(self, req: dict) -> dict:
        job_id = _int(req, "job_id", 1, 2**32 - 1)
        wid = _int(req, "worker_id", 0, wire.MAX_WORKERS - 1)
        with self._op:
            with self._cv:
                job = self._job(job_id)
                if wid not in job.members:
                    raise ApiError(404, f"worker {wid} is not a member of job {job_id}")
            self._on_all_dpus(job, lambda i: self.local_remove_flow(job_id, wid), "DELETE",
                              f"/v1/local/flows/{job_id}/{wid}", None)
            with self._cv:
                job.members.pop(wid, None)
                self._save()
                return job.view()

    def _job(self, job_id: int) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"job {job_id} does not exist")
        return job

    def get_job(self, job_id: int) -> dict:
        with self._cv:
            return self._job(job_id).view()

    def list_jobs(self) -> dict:
        with self._cv:
            return {"jobs": [j.view() for j in self.jobs.values()]}

    def remove_job(self, job_id: int) -> dict:
        with self._op:
            with self._cv:
                job = self._job(job_id)
            self._on_all_dpus(job, lambda i: self._remove_job_here(job_id), "DELETE",
                              f"/v1/local/jobs/{job_id}", None)
            with self._cv:
                self.jobs.pop(job_id, None)
                self._save()
                return {"removed": job_id}

    def stats(self) -> dict:
        if self.controller is None:
            return {"mode": "userspace", "jobs": self.list_jobs()["jobs"]}
        return self.controller.stats()

    # ------------------------------------------------------------------------ this DPU's dataplane
    # and registry: what /v1/local/* does, and what a coordinating server does for itself. Every DPU
    # of a job keeps the job (and its members) in its registry, in both modes, so its DPU worker
    # learns the whole job from its own control plane.
    def _install_job_here(self, job: Job, dpu_index: int) -> None:
        with self._cv:
            have = self.jobs.get(job.job_id)
            if have is not None and have is not job:
                raise ApiError(409, f"job {job.job_id} already exists on DPU {self.address}")
            if self.controller is not None:
                try:
                    self.controller.add_job(job.job_id, workers=job.workers, numel=job.numel,
                                            partition_size=job.partition_size, num_dpus=len(job.dpus),
                                            dpu_index=dpu_index, scale_exp=job.scale_exp, mode=job.mode,
                                            port=job.port)
                except AdmissionError as e:
                    raise ApiError(507, str(e)) from None
                except DosaError as e:
                    raise ApiError(409, str(e)) from None
            self.jobs[job.job_id] = job
            self._save()

    def _remove_job_here(self, job_id: int) -> None:
        with self._cv:
            self.jobs.pop(job_id, None)
            if self.controller is not None:
                try:
                    self.controller.remove_job(job_id)
                except DosaError:
                    pass  # already gone: removal is idempotent
            self._save()
            self._cv.notify_all()

    def local_install_job(self, req: dict) -> dict:
        """A peer installs a job here. The body is the job's full view (``_job_body``) plus this
        DPU's ``dpu_index``."""
        if not isinstance(req.get("dpus"), list) or not req["dpus"]:
            raise _bad("a job installed on a DPU must list the job's dpus")
        job = self._parse_job(req, "port")
        idx = _int(req, "dpu_index", 0, len(job.dpus) - 1)
        if _int(req, "num_dpus", 1, 1 << 16, len(job.dpus)) != len(job.dpus):
            raise _bad(f"num_dpus {req['num_dpus']} differs from the {len(job.dpus)} dpus listed")
        job.members = self._parse_hosts(req.get("hosts") or [], job)
        self._install_job_here(job, idx)
        return {"installed": True, "dataplane": self.controller is not None}

    @staticmethod
    def _parse_hosts(hosts, job: Job) -> dict:
        if not isinstance(hosts, list):
            raise _bad("hosts must be a list of {worker_id, address, port} objects")
        out = {}
        for h in hosts:
            if not isinstance(h, dict):
                raise _bad("hosts must be a list of {worker_id, address, port} objects")
            out[_int(h, "worker_id", 0, job.workers - 1)] = (_addr(h.get("address"), "host address"),
                                                            _int(h, "port", 1, 65535))
        return out

    def local_install_flow(self, req: dict) -> dict:
        """Record the member in the registry first, then the flow in the dataplane: a worker that
        sees the flows complete in the maps finds the registry complete too."""
        job_id = _int(req, "job_id", 1, 2**32 - 1)
        wid = _int(req, "worker_id", 0, wire.MAX_WORKERS - 1)
        member = (_addr(req.get("address"), "address"), _int(req, "port", 1, 65535))
        with self._cv:
            job = self.jobs.get(job_id)
            if job is None and self.controller is None:
                raise ApiError(404, f"job {job_id} is not installed on DPU {self.address}")
            if job is not None and wid >= job.workers:
                raise _bad(f"worker id {wid} outside 0..{job.workers - 1} for job {job_id}")
            old = job.members.get(wid) if job is not None else None
            if job is not None:
                job.members[wid] = member
            if self.controller is not None:
                try:
                    self.controller.add_worker(job_id, wid, *member)
                except DosaError as e:
                    if job is not None:  # put the registry back as it was
                        if old is None:
                            job.members.pop(wid, None)
                        else:
                            job.members[wid] = old
                    raise ApiError(507 if isinstance(e, AdmissionError) else 404, str(e)) from None
            self._save()
            self._cv.notify_all()
        return {"installed": True, "dataplane": self.controller is not None}

    def local_remove_flow(self, job_id: int, worker_id: int) -> dict:
        with self._cv:
            job = self.jobs.get(job_id)
            if job is not None:
                job.members.pop(worker_id, None)
            if self.controller is not None:
                try:
                    self.controller.remove_worker(job_id, worker_id)
                except DosaError:
                    pass  # already gone: removal is idempotent
            self._save()
        return {"removed": True}

    def local_remove_job(self, job_id: int) -> dict:
        self._remove_job_here(job_id)
        return {"removed": True}


# ------------------------------------------------------------------------------------------ server
class _Handler(BaseHTTPRequestHandler):
    service: ControlService  # set on the subclass the server makes
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: the DPU log is for events, not every request
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > 1 << 20:
            raise _bad("request body larger than 1 MiB")
        raw = self.rfile.read(n) if n else b"{}"
        try:
            body = json.loads(raw)
        except ValueError:
            raise _bad("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _bad("request body must be a JSON object")
        return body

    def _route(self, method: str):
        s = self.service
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        if parts[:1] != ["v1"]:
            raise ApiError(404, f"no endpoint {self.path}")
        p = parts[1:]

        def num(x):
            try:
                return int(x)
            except ValueError:
                raise _bad(f"{x!r} is not a number") from None

        if method == "POST" and p == ["join"]:
            return s.join(self._body())
        if method == "POST" and p == ["leave"]:
            return s.leave(self._body())
        if method == "POST" and p == ["jobs"]:
            return s.create_job(self._body())
        if method == "GET" and p == ["jobs"]:
            return s.list_jobs()
        if method == "GET" and len(p) == 2 and p[0] == "jobs":
            return s.get_job(num(p[1]))
        if method == "DELETE" and len(p) == 2 and p[0] == "jobs":
            return s.remove_job(num(p[1]))
        if method == "GET" and p == ["stats"]:
            return s.stats()
        if method == "GET" and p == ["health"]:
            return {"ok": True}
        if method == "POST" and p == ["local", "jobs"]:
            return s.local_install_job(self._body())
        if method == "POST" and p == ["local", "flows"]:
            return s.local_install_flow(self._body())
        if method == "DELETE" and len(p) == 3 and p[:2] == ["local", "jobs"]:
            return s.local_remove_job(num(p[2]))
        if method == "DELETE" and len(p) == 4 and p[:2] == ["local", "flows"]:
            return s.local_remove_flow(num(p[2]), num(p[3]))
        raise ApiError(404, f"no endpoint {method} {self.path}")

    def _handle(self, method: str):
        try:
            self._reply(200, self._route(method))
        except ApiError as e:
            self._reply(e.status, {"error": str(e)})
        except DosaError as e:
            self._reply(400, {"error": str(e)})
        except Exception as e:  # a bug: say so, keep serving
            self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


class ControlServer:
    """HTTP server around a ControlService; ``start()`` serves on a daemon thread, ``serve_forever``
    in the caller's thread. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, service: ControlService, host: str = "127.0.0.1", port: int = DEFAULT_CONTROL_PORT):
        handler = type("Handler", (_Handler,), {"service": service})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise DosaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.httpd.daemon_threads = True
        self.service = service
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "ControlServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dosa-ctl-api", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ------------------------------------------------------------------------------------------ client
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
    """POST /v1/join and return the response dict (see the module doc)."""
    body = {"job_id": job_id, "address": address, "wait": wait, **job_shape}
    if port is not None:
        body["port"] = port
    if worker_id is not None:
        body["worker_id"] = worker_id
    return request(control, "POST", "/v1/join", body, timeout=wait + 10)


def join(control, worker_id: int | None = None, numel: int | None = None, *, job_id: int | None = None,
         address: str | None = None, port: int | None = None, workers: int | None = None,
         dpus: list | None = None, wait: float = 60.0, **job_kw):
    """Join a job and return its host_lib.transport.JobConfig once every worker has joined.

    Unset arguments come from the environment ``dosa testbed run`` (and torchrun) sets:
    job_id <- DOSA_JOB_ID, address <- DOSA_HOST_ADDR, port <- DOSA_PORT, workers <- WORLD_SIZE,
    dpus <- DOSA_DPU_ADDRS. numel, workers and dpus let the first joiner create the job."""
    env = os.environ
    if job_id is None:
        if not env.get("DOSA_JOB_ID"):
            raise DosaError("no job id: pass job_id or set DOSA_JOB_ID")
        job_id = int(env["DOSA_JOB_ID"])
    address = address or env.get("DOSA_HOST_ADDR")
    if not address:
        raise DosaError("no host address: pass address or set DOSA_HOST_ADDR")
    if port is None:
        port = int(env.get("DOSA_PORT", wire.DEFAULT_PORT))
    if workers is None and env.get("WORLD_SIZE"):
        workers = int(env["WORLD_SIZE"])
    if dpus is None and env.get("DOSA_DPU_ADDRS"):
        dport = int(env.get("DOSA_PORT", wire.DEFAULT_PORT))
        dpus = [{"address": a, "port": dport} for a in env["DOSA_DPU_ADDRS"].split(",") if a]
    shape = dict(job_kw)
    if numel is not None:
        shape["numel"] = int(numel)
    if workers is not None:
        shape["workers"] = int(workers)
    if dpus is not None:
        shape["dpus"] = dpus
    resp = join_raw(control, job_id, address, port, worker_id, wait, **shape)
    return job_config(resp)


def job_config(resp: dict):
    """host_lib.transport.JobConfig of a join response (the dict itself if host_lib is absent)."""
    try:
        from host_lib.transport import JobConfig
    except ImportError:
        return resp
    return JobConfig(job_id=resp["job_id"], numel=resp["numel"],
                     hosts=[(h["address"], h["port"]) for h in resp["hosts"]],
                     dpus=[(d["address"], d["port"]) for d in resp["dpus"]],
                     partition_size=resp["partition_size"], mode=resp["mode"], density=resp["density"],
                     scale_exp=resp["scale_exp"])


__all__ = ["ApiError", "ControlServer", "ControlService", "Job", "join", "join_raw", "job_config",
           "request", "DEFAULT_CONTROL_PORT"]
