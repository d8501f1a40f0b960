"""The API's logic, usable in-process: ControlService answers every endpoint (router.py maps HTTP
onto it) from its registry of jobs, installing jobs and flows in this DPU's dataplane and, through
the other DPUs' servers, in theirs (peers.py), all or nothing."""
from __future__ import annotations

import threading

from dosa import wire
from dosa.errors import DosaError
from dosa.job import DpuMode, JobConfig
from dosa.net import DEFAULT_CONTROL_PORT

from ..alloc import AdmissionError
from . import authority, lifecycle
from .lease import Leases
from .peers import Peers, registry_body
from .persistence import load_jobs, save_jobs
from .rendezvous import assign_rank, wait_complete
from .validation import ApiError, bad, check_same_shape, parse_hosts, parse_job, req_addr, req_int, req_wait



class ControlService:
    """The API's logic, usable in-process. ``controller`` is this DPU's control.Controller, or None
    when the DPU merges in user space (then only the registry is kept). ``secret`` (dosa.auth.Secret,
    the DPU's: every role) makes the server check every mutating call (router.py, guard.py) and
    signs this server's calls to the other DPUs with the peer key; ``peer_ca``: their TLS CA."""

    def __init__(self, controller=None, address: str = "127.0.0.1", data_port: int = wire.DEFAULT_PORT,
                 control_port: int = DEFAULT_CONTROL_PORT, peer_timeout: float = 5.0,
                 state_path: str | None = None, lease_s: float | None = None,
                 dead_after: float | None = None, sweep: bool = True, secret=None, peer_ca: str | None = None):
        self.controller = controller
        self.address = address
        self.data_port = data_port
        self.control_port = control_port
        self.peer_timeout = peer_timeout
        self.secret = secret
        self.peers = Peers(address, control_port, peer_timeout, secret, peer_ca)
        self.jobs: dict[int, JobConfig] = {}
        # _cv guards the registry (held briefly, never across a call to another DPU) and wakes
        # rendezvous waiters; _op serialises this server's fan-outs to the DPUs of a job
        self._cv = threading.Condition(threading.RLock())
        self._op = threading.Lock()
        self.state_path = state_path
        # job lifecycle (control/api/lifecycle.py): leases of the members that joined through this
        # server, each job's generation, when and why an id was released
        self.leases = Leases(**{k: v for k, v in (("lease_s", lease_s), ("dead_after", dead_after))
                                if v is not None})
        self.generations: dict[int, int] = {}
        self.released_at: dict[int, float] = {}
        self.gone: dict[int, str] = {}
        self._load()
        self._sweeper = lifecycle.Sweeper(self) if sweep else None

    def close(self) -> None:
        """Stop the lease sweeper (the registry stays as it is)."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None

    # ----------------------------------------------------------------------------- persistence
    def _load(self) -> None:
        """Re-read the registry a previous server of this DPU saved, keeping only jobs the local
        dataplane still has (a restarted server must not 404 on, or re-create, a live job)."""
        jobs, holders = load_jobs(self.state_path)
        for job in jobs.values():
            if self.controller is not None and job.dpu_index(self.address) is not None \
                    and self.controller.maps.job_info(job.job_id) is None:
                continue
            self.jobs[job.job_id] = job
            lifecycle.note_created(self, job.job_id)
            for w, holder in holders.get(job.job_id, {}).items():  # a fresh lease, the same session's
                if w in job.joined:
                    self.leases.restore(job.job_id, w, holder)

    def _save(self) -> None:
        save_jobs(self.state_path, self.jobs.values(), self.leases.holders())

    def _parse_job(self, req: dict, port_field: str = "job_port") -> JobConfig:
        return parse_job(req, self.address, self.data_port, port_field)

    # ----------------------------------------------------------------------------- fan-out to DPUs
    def _install_job(self, job: JobConfig) -> None:
        gen = lifecycle.note_created(self, job.job_id)  # the same generation on every DPU
        """Install on every DPU (dataplane in XDP mode, registry in both modes); when one refuses,
        remove it from those that accepted (a job is on all its DPUs or on none)."""
        def undo(i, a):
            if a == self.address:
                self._remove_job_here(job.job_id)
            else:
                self.peers.call(a, "DELETE", f"/v1/local/jobs/{job.job_id}")

        self.peers.on_all_dpus(job, lambda i: self._install_job_here(job, i), "POST",
                               "/v1/local/jobs", dict(registry_body(job), generation=gen), undo)

    # ------------------------------------------------------------------------------------ requests
    def create_job(self, req: dict) -> dict:
        job = self._parse_job(req, "port")
        with self._op:
            with self._cv:
                if job.job_id in self.jobs:
                    raise ApiError(409, f"job {job.job_id} already exists")
            lifecycle.wait_reusable(self, job.job_id)
            self._install_job(job)
            with self._cv:
                self.jobs[job.job_id] = job
                self._save()
                return lifecycle.decorate(self, job.view())

    def join(self, req: dict, role: str | None = "operator") -> dict:
        """``role``: the caller's (router.py); per-job authority in authority.py."""
        if not isinstance(req, dict):
            raise bad("the join request must be a JSON object")
        job_id = req_int(req, "job_id", 1, 2**32 - 1)
        address = req_addr(req.get("address"), "address")
        wait = req_wait(req)
        session = lifecycle.req_session(req)
        # _op: one fan-out at a time from this server (HTTP to peers happens under it, never under
        # _cv, which every server's /v1/local/* handlers take: two DPUs coordinating joins at once
        # cannot deadlock each other)
        with self._op:
            with self._cv:
                job = self.jobs.get(job_id)
            if job is not None and lifecycle.reclaim_for_join(
                    self, job, req.get("worker_id", req.get("rank")), session, wait):
                if "numel" not in req or "workers" not in req:  # re-create it in its own shape
                    req = {**registry_body(job), "job_port": job.port, **req}
                    req["dpus"] = [{"address": a, "port": p} for a, p in job.dpus]
                job = None
            if job is None:
                lifecycle.wait_reusable(self, job_id)
                if "numel" not in req or "workers" not in req:
                    raise ApiError(404, f"job {job_id} does not exist (a first joiner must give numel "
                                        "and workers to create it)")
                job = self._parse_job(req)
                self._install_job(job)
                with self._cv:
                    self.jobs[job_id] = job
                    self._save()
            else:
                check_same_shape(job, req)
            port = req_int(req, "port", 1, 65535, job.port)
            with self._cv:
                wid = assign_rank(job, req.get("worker_id", req.get("rank")), address, port)
                have = job.hosts[wid]
                authority.check_rejoin(self, job, wid, session, (address, port), role)
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
                    self.peers.call(a, "DELETE", f"/v1/local/flows/{job_id}/{wid}")
                else:
                    self.peers.call(a, "POST", "/v1/local/flows", dict(old, dpu_index=i))

            self.peers.on_all_dpus(job, lambda i: self.local_install_flow(flow), "POST",
                                   "/v1/local/flows", flow, undo)
            with self._cv:
                job.hosts[wid] = (address, port)  # already there when this server is a DPU of the job
                if session is not None:
                    self.leases.grant(job_id, wid, session)
                self._save()
                self._cv.notify_all()
        with self._cv:
            if session is not None:
                self.leases.waiting(job_id, wid, True)
            try:
                wait_complete(self._cv, job, wait)
            finally:
                if session is not None:
                    self.leases.waiting(job_id, wid, False)
            if self.jobs.get(job_id) is not job:
                raise ApiError(409, f"job {job_id} was released while this worker waited for the "
                                    f"others ({self.gone.get(job_id, 'removed')})")
            return lifecycle.decorate(self, job.view(wid))

    def leave(self, req: dict, role: str | None = "operator") -> dict:
        job_id = req_int(req, "job_id", 1, 2**32 - 1)
        wid = req_int(req, "worker_id", 0, wire.MAX_WORKERS - 1)
        session = lifecycle.req_session(req)
        with self._op:
            with self._cv:
                job = self._job(job_id)
                if wid >= job.workers or job.hosts[wid] is None:
                    raise ApiError(404, f"worker {wid} is not a member of job {job_id}")
                authority.check_leave(self, job_id, wid, session, role)
            self.peers.on_all_dpus(job, lambda i: self.local_remove_flow(job_id, wid), "DELETE",
                              f"/v1/local/flows/{job_id}/{wid}", None)
            with self._cv:
                job.hosts[wid] = None
                self.leases.drop(job_id, wid)
                self._save()
                view = lifecycle.decorate(self, job.view())
            view["released"] = lifecycle.after_leave(self, job_id)
            return view

    def _job(self, job_id: int) -> JobConfig:
        job = self.jobs.get(job_id)
        if job is None:
            raise ApiError(404, lifecycle.gone_message(self, job_id))
        return job

    def get_job(self, job_id: int) -> dict:
        with self._cv:
            return lifecycle.decorate(self, self._job(job_id).view())

    def list_jobs(self) -> dict:
        with self._cv:
            return {"jobs": [lifecycle.decorate(self, j.view()) for j in self.jobs.values()]}

    def heartbeat(self, req: dict) -> dict:
        return lifecycle.heartbeat(self, req)

    def remove_job(self, job_id: int) -> dict:
        with self._op:
            with self._cv:
                job = self._job(job_id)
            self.peers.on_all_dpus(job, lambda i: self._remove_job_here(job_id), "DELETE",
                              f"/v1/local/jobs/{job_id}", None)
            lifecycle.release(self, job_id, "removed by an admin")
            return {"removed": job_id}

    def stats(self) -> dict:
        if self.controller is None:
            return {"mode": DpuMode.USERSPACE.value, "jobs": self.list_jobs()["jobs"]}
        return self.controller.stats()

    # ------------------------------------------------------------------------ this DPU's dataplane
    # and registry: what /v1/local/* does, and what a coordinating server does for itself. Every DPU
    # of a job keeps the job (and its members) in its registry, in both modes, so its DPU worker
    # learns the whole job from its own control plane.
    def _install_job_here(self, job: JobConfig, dpu_index: int) -> None:
        with self._cv:
            have = self.jobs.get(job.job_id)
            if have is not None and have is not job:
                raise ApiError(409, f"job {job.job_id} already exists on DPU {self.address}")
            if self.controller is not None:
                try:
                    self.controller.add_job(job.job_id, workers=job.workers, numel=job.numel,
                                            partition_size=job.partition_size, num_dpus=len(job.dpus),
                                            dpu_index=dpu_index, scale_exp=job.scale_exp, mode=job.mode,
                                            port=job.port, slots=job.slots)
                except AdmissionError as e:
                    # 507: can never fit this DPU; 503: fits once other jobs end (joiners retry)
                    raise ApiError(507 if e.permanent else 503, str(e)) from None
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
        """A peer installs a job here. The body is the job's full view (``peers.registry_body``) plus this
        DPU's ``dpu_index``."""
        if not isinstance(req.get("dpus"), list) or not req["dpus"]:
            raise bad("a job installed on a DPU must list the job's dpus")
        job = self._parse_job(req, "port")
        idx = req_int(req, "dpu_index", 0, len(job.dpus) - 1)
        if req_int(req, "num_dpus", 1, 1 << 16, len(job.dpus)) != len(job.dpus):
            raise bad(f"num_dpus {req['num_dpus']} differs from the {len(job.dpus)} dpus listed")
        for w, h in parse_hosts(req.get("hosts") or [], job).items():
            job.hosts[w] = h
        self._install_job_here(job, idx)
        if isinstance(req.get("generation"), int):  # the coordinating DPU's, so views agree
            self.generations[job.job_id] = req["generation"]
        return {"installed": True, "dataplane": self.controller is not None}

    def local_install_flow(self, req: dict) -> dict:
        """Record the member in the registry first, then the flow in the dataplane: a worker that
        sees the flows complete in the maps finds the registry complete too."""
        job_id = req_int(req, "job_id", 1, 2**32 - 1)
        wid = req_int(req, "worker_id", 0, wire.MAX_WORKERS - 1)
        member = (req_addr(req.get("address"), "address"), req_int(req, "port", 1, 65535))
        with self._cv:
            job = self.jobs.get(job_id)
            if job is None and self.controller is None:
                raise ApiError(404, f"job {job_id} is not installed on DPU {self.address}")
            if job is not None and wid >= job.workers:
                raise bad(f"worker id {wid} outside 0..{job.workers - 1} for job {job_id}")
            old = job.hosts[wid] if job is not None else None
            if job is not None:
                job.hosts[wid] = member
            if self.controller is not None:
                try:
                    self.controller.add_worker(job_id, wid, *member)
                except DosaError as e:
                    if job is not None:  # put the registry back as it was
                        job.hosts[wid] = old
                    raise ApiError(507 if isinstance(e, AdmissionError) else 404, str(e)) from None
            self._save()
            self._cv.notify_all()
        return {"installed": True, "dataplane": self.controller is not None}

    def local_remove_flow(self, job_id: int, worker_id: int) -> dict:
        with self._cv:
            job = self.jobs.get(job_id)
            if job is not None and worker_id < job.workers:
                job.hosts[worker_id] = None
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
