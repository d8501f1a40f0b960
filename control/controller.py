"""Controller: the control plane of one DPU's dataplane instance.

It loads and attaches the XDP program (also inside a network namespace), installs and removes jobs
(regions sized by the job's aggregation slots, allocated first-fit from the fixed pools: a job that
does not fit is refused with an AdmissionError that says whether it ever could), adds and removes
worker flows, and reads counters. All state lives in the pinned
maps (plus a small record of attachments in /run/dosa/), so a Controller created by a restarted
process picks up exactly where the last one left off.

Example::

    ctl = Controller("dpu0")
    ctl.attach("eth0", netns="tb-d0")
    ctl.add_job(7, workers=4, numel=1 << 20, partition_size=65536)
    ctl.add_worker(7, 0, "10.0.0.2", 17791)
    print(ctl.stats()["drops"])
    ctl.detach("eth0", netns="tb-d0")  # also unloads the instance when it was the last attachment
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from dataclasses import asdict

from dataplane import libbpf, loader, reasons
from dataplane.maps import MODES, DataplaneMaps, JobInfo
from dosa import wire
from dosa.errors import DosaError
from dosa.job import DEFAULT_SCALE_EXP, DEFAULT_SLOTS, MAX_SLOTS

from .alloc import AdmissionError, SlotDemand, admit, touched_list_cap
from .netns import run_in_netns

STATE_DIR = "/run/dosa"
XDP_MODES = {"auto": 0, "native": libbpf.XDP_FLAGS_DRV_MODE, "skb": libbpf.XDP_FLAGS_SKB_MODE}


def _ifindex(ifname: str, netns: str | None) -> int:
    try:
        return socket.if_nametoindex(ifname)
    except OSError:
        where = f"namespace {netns!r}" if netns else "this network namespace"
        raise DosaError(f"there is no network interface {ifname!r} in {where}") from None


class Controller:
    def __init__(self, instance: str = "default"):
        self.instance = loader.check_instance(instance)
        self._maps: DataplaneMaps | None = None
        tag = self.instance.strip("/").replace("/", "_")
        self._state_path = f"{STATE_DIR}/{tag}.json"
        self._lock_path = f"{STATE_DIR}/{tag}.lock"

    # ------------------------------------------------------------------------------------------ state
    @property
    def loaded(self) -> bool:
        return loader.is_loaded(self.instance)

    @property
    def maps(self) -> DataplaneMaps:
        if self._maps is None:
            self._maps = DataplaneMaps.open(self.instance)
        return self._maps

    def close(self) -> None:
        if self._maps is not None:
            self._maps.close()
            self._maps = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @contextlib.contextmanager
    def _locked(self):
        """One writer at a time per instance (two `dosa ctl` processes must not allocate at once)."""
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(self._lock_path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _attachments(self) -> list[dict]:
        try:
            with open(self._state_path) as f:
                return json.load(f)["attachments"]
        except (FileNotFoundError, ValueError, KeyError):
            return []

    def _save_attachments(self, att: list[dict]) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        tmp = self._state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"instance": self.instance, "attachments": att}, f)
        os.replace(tmp, self._state_path)

    def attachments(self) -> list[dict]:
        """[{ifname, netns, mode}] this instance's program is attached to."""
        return self._attachments()

    # ---------------------------------------------------------------------------------- attach/detach
    def load(self, config: loader.LoadConfig | None = None) -> bool:
        """Load and pin the program unless this instance is already loaded. Returns whether it loaded."""
        loader.require_root("loading the XDP dataplane")
        if self.loaded:
            return False
        loader.load(self.instance, config or loader.LoadConfig())
        return True

    def attach(self, ifname: str, netns: str | None = None, mode: str = "auto",
               config: loader.LoadConfig | None = None, port: int | None = wire.DEFAULT_PORT) -> None:
        """Attach the program to ``ifname`` (in ``netns``), loading it first if needed, and mark
        ``port`` as a dosa port. Replaces any XDP program already on the interface."""
        loader.require_root("attaching the XDP dataplane")
        if mode not in XDP_MODES:
            raise DosaError(f"XDP mode must be one of {sorted(XDP_MODES)}, got {mode!r}")
        run_in_netns(netns, _ifindex, ifname, netns)  # fail fast, before a seconds-long compile
        with self._locked():
            loaded_now = self.load(config)
            prog_fd = loader.open_prog(self.instance)
            try:
                def do():
                    idx = _ifindex(ifname, netns)
                    try:
                        libbpf.xdp_attach(idx, prog_fd, XDP_MODES[mode])
                    except OSError as e:
                        raise DosaError(f"cannot attach XDP to {ifname!r} in {mode} mode: "
                                        f"{e.strerror}") from None
                run_in_netns(netns, do)
            except Exception:
                if loaded_now and not self._attachments():
                    self.close()
                    loader.unload(self.instance)
                raise
            finally:
                os.close(prog_fd)
            att = [a for a in self._attachments() if (a["ifname"], a["netns"]) != (ifname, netns)]
            self._save_attachments(att + [{"ifname": ifname, "netns": netns, "mode": mode}])
            if port is not None:
                self.maps.add_port(port)

    def detach(self, ifname: str, netns: str | None = None, keep_state: bool = False) -> None:
        """Detach from ``ifname``; when no attachment is left and not ``keep_state``, unload the
        instance (its pins go; the kernel frees the program and maps)."""
        loader.require_root("detaching the XDP dataplane")
        with self._locked():
            def do():
                idx = _ifindex(ifname, netns)
                libbpf.xdp_detach(idx, 0)
            run_in_netns(netns, do)
            att = [a for a in self._attachments() if (a["ifname"], a["netns"]) != (ifname, netns)]
            self._save_attachments(att)
            if not att and not keep_state:
                self._destroy_locked()

    def destroy(self) -> None:
        """Detach from every recorded interface that still exists and unload the instance."""
        loader.require_root("unloading the XDP dataplane")
        with self._locked():
            for a in self._attachments():
                try:
                    run_in_netns(a["netns"], lambda: libbpf.xdp_detach(_ifindex(a["ifname"], a["netns"]), 0))
                except (DosaError, OSError):
                    pass  # the interface or namespace is gone, and the attachment with it
            self._destroy_locked()

    def _destroy_locked(self) -> None:
        self.close()
        loader.unload(self.instance)
        for path in (self._state_path, self._lock_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # ------------------------------------------------------------------------------------------- jobs
    def jobs(self) -> list[JobInfo]:
        return sorted(self.maps.jobs(), key=lambda j: j.job_id)

    def add_job(self, job_id: int, workers: int, numel: int, partition_size: int = wire.DEFAULT_PARTITION_SIZE,
                num_dpus: int = 1, dpu_index: int = 0, scale_exp: int = DEFAULT_SCALE_EXP, mode: str = "sum",
                port: int = wire.DEFAULT_PORT, slots: int = DEFAULT_SLOTS) -> JobInfo:
        """Install a job: allocate its regions, clear them, write the job entry (last, so XDP never
        sees a job whose memory is not ready). ``slots``: its aggregation slots here (at most the
        partitions it owns here); they, not numel, set its memory (docs/dataplane.md, *Slots*).
        Each buffer gets a touched list (``control.alloc.touched_list_cap``). Errors: DosaError for bad values
        or an existing job, AdmissionError when a pool or table is full (``permanent`` when it
        could never fit this dataplane)."""
        if not 1 <= job_id <= 2**32 - 1:
            raise DosaError(f"job id {job_id} must lie in 1..2^32-1")
        if not 1 <= workers <= wire.MAX_WORKERS:
            raise DosaError(f"a job has 1..{wire.MAX_WORKERS} workers, not {workers}")
        if num_dpus < 1 or not 0 <= dpu_index < num_dpus:
            raise DosaError(f"DPU index {dpu_index} must lie in 0..{num_dpus - 1} (num_dpus {num_dpus})")
        if not wire.SCALE_EXP_MIN <= scale_exp <= wire.SCALE_EXP_MAX:
            raise DosaError(f"scale_exp {scale_exp} outside {wire.SCALE_EXP_MIN}..{wire.SCALE_EXP_MAX}")
        if mode not in MODES:
            raise DosaError(f"job mode must be one of {sorted(MODES)}, got {mode!r}")
        if not 0 < port < 65536:
            raise DosaError(f"UDP port {port} outside 1..65535")
        if numel > 2**32 - 1:
            raise DosaError(f"numel {numel} does not fit the protocol's u32 indices")
        if not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise DosaError(f"slots must be an integer in 1..{MAX_SLOTS}, got {slots!r}")
        try:
            pm = wire.PartitionMap(numel, partition_size, num_dpus)
        except ValueError as e:
            raise DosaError(str(e)) from None
        owned = len(pm.owned_by(dpu_index))
        with self._locked():
            maps = self.maps
            existing = maps.jobs()
            if any(j.job_id == job_id for j in existing):
                raise DosaError(f"job {job_id} is already installed in dataplane {self.instance!r}")
            cap = maps.capacity
            if len(existing) >= cap["jobs"]:
                raise AdmissionError(f"the dataplane already holds its maximum of {cap['jobs']} jobs")
            stride = min(partition_size, numel)
            demand = SlotDemand(job_id, min(slots, owned), stride, workers, touched_list_cap(stride))
            used = {"pool": [(j.pool_off, j.pool_len, j.job_id) for j in existing],
                    "pstate": [(j.pstate_off, j.pstate_len, j.job_id) for j in existing],
                    "wstate": [(j.wstate_off, j.wstate_len, j.job_id) for j in existing]}
            off = admit(demand, used, cap)
            job = JobInfo(job_id=job_id, workers=workers, partition_size=partition_size, numel=numel,
                          num_partitions=pm.num_partitions, dpu_index=dpu_index, num_dpus=num_dpus,
                          num_owned=owned, mode=MODES[mode], pool_off=off["pool"], pstate_off=off["pstate"],
                          wstate_off=off["wstate"], scale_exp=scale_exp, port=port, stride=demand.stride,
                          slots=demand.slots, list_cap=demand.list_cap)
            maps.clear_job_state(job)
            maps.add_port(port)
            maps.put_job(job)
            return job

    def remove_job(self, job_id: int) -> None:
        """Remove the job entry first (its packets become unknown_job at once), then its flows, then
        zero its regions so the next job there starts clean."""
        with self._locked():
            maps = self.maps
            job = maps.job_info(job_id)
            if job is None:
                raise DosaError(f"job {job_id} is not installed in dataplane {self.instance!r}")
            maps.delete_job(job_id)
            for (_, w) in maps.flows(job_id):
                maps.delete_flow(job_id, w)
            maps.clear_job_state(job)
            if job.port != wire.DEFAULT_PORT and all(j.port != job.port for j in maps.jobs()):
                maps.remove_port(job.port)

    def add_worker(self, job_id: int, worker_id: int, address: str, port: int) -> None:
        """Allow (address, port) to send as ``worker_id`` of the job (replaces an earlier flow)."""
        job = self.maps.job_info(job_id)
        if job is None:
            raise DosaError(f"job {job_id} is not installed in dataplane {self.instance!r}")
        if not 0 <= worker_id < job.workers:
            raise DosaError(f"worker id {worker_id} outside 0..{job.workers - 1} for job {job_id}")
        try:
            self.maps.put_flow(job_id, worker_id, address, port)
        except OSError as e:
            raise AdmissionError(f"cannot install the flow of worker {worker_id} of job {job_id}: "
                                 f"{e.strerror} (the flow table may be full)") from None

    def remove_worker(self, job_id: int, worker_id: int) -> None:
        if not self.maps.delete_flow(job_id, worker_id):
            raise DosaError(f"worker {worker_id} of job {job_id} is not installed")

    def workers(self, job_id: int | None = None) -> dict:
        return self.maps.flows(job_id)

    # --------------------------------------------------------------------------------------- counters
    def counters(self) -> dict[str, int]:
        return self.maps.counters()

    def stats(self) -> dict:
        """JSON-ready: counters split into drops by reason and outcomes, jobs, attachments, capacity."""
        c = self.counters()
        drops = {reasons.name(r): c[reasons.name(r)] for r in reasons.DROP_REASONS}
        other = {k: v for k, v in c.items() if k not in drops}
        return {"instance": self.instance, "pin_dir": loader.pin_dir(self.instance),
                "attachments": self.attachments(), "capacity": self.maps.capacity,
                "ports": self.maps.ports(), "drops": drops, "drops_total": sum(drops.values()),
                "outcomes": other, "jobs": [asdict(j) for j in self.jobs()],
                "flows": [{"job_id": k[0], "worker_id": k[1], "address": v[0], "port": v[1]}
                          for k, v in sorted(self.maps.flows().items())]}
