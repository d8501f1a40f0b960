"""DataplaneMaps: the pinned state of one dataplane instance, usable from ANY process.

The DPU worker (another process) uses the read/advance side::

    from dataplane.maps import DataplaneMaps
    dp = DataplaneMaps.open("dpu0")
    for c in dp.poll_completions(timeout_ms=100):       # Completion(job_id, partition, round, scale_exp)
        sums = dp.buffer(c.job_id, c.partition, c.round)  # int64 view, zero-copy: index lo + i
        ...  # build and send result packets from sums
        dp.advance(c.job_id, c.partition, c.round)        # clear round-1's parity, base_round = round

The control plane (control.Controller) uses the write side: put_job / delete_job / put_flow /
delete_flow / add_port and clear_job_state. Layout and reasons: docs/dataplane.md.

Maps are opened by their pins (/sys/fs/bpf/dosa/<instance>/); the three state arrays are mmap'ed and
viewed with numpy, so reading a buffer or clearing a parity costs no syscall per element.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct
from dataclasses import dataclass

import numpy as np

from dosa.errors import DosaError

from . import layout, libbpf, loader, reasons


MODE_SUM = 0  # exact sums of every index any worker sent
MODE_GTOPK = 1  # results carry only the k largest sums (the DPU worker applies it)
MODES = {"sum": MODE_SUM, "gtopk": MODE_GTOPK}  # names as in dosa.job.JobConfig.mode


@dataclass(frozen=True)
class Completion:
    """One (job, partition, round) whose contributions from every worker are all merged."""

    job_id: int
    partition: int
    round: int
    scale_exp: int


@dataclass(frozen=True)
class JobInfo:
    """A job as installed in this DPU's dataplane (the ``jobs`` map entry)."""

    job_id: int
    workers: int
    partition_size: int
    numel: int
    num_partitions: int
    dpu_index: int
    num_dpus: int
    num_owned: int
    mode: int
    pool_off: int
    pstate_off: int
    wstate_off: int
    scale_exp: int
    port: int
    stride: int = 0  # slots per buffer; 0 = min(partition_size, numel)

    def __post_init__(self):
        if not self.stride:
            object.__setattr__(self, "stride", min(self.partition_size, self.numel))

    @property
    def pool_len(self) -> int:
        return self.num_owned * 2 * self.stride

    @property
    def wstate_len(self) -> int:
        return self.num_owned * 2 * self.workers

    def owns(self, p: int) -> bool:
        return 0 <= p < self.num_partitions and p % self.num_dpus == self.dpu_index

    def owned_partitions(self) -> np.ndarray:
        return np.arange(self.dpu_index, self.num_partitions, self.num_dpus)

    def bounds(self, p: int) -> tuple[int, int]:
        lo = p * self.partition_size
        return lo, min(lo + self.partition_size, self.numel)

    def local(self, p: int) -> int:
        if not self.owns(p):
            raise DosaError(f"partition {p} of job {self.job_id} is not owned by DPU {self.dpu_index} "
                            f"of {self.num_dpus}")
        return p // self.num_dpus

    def to_struct(self) -> layout.Job:
        return layout.Job(**{f: getattr(self, f) for f, _ in layout.Job._fields_})

    @classmethod
    def from_struct(cls, job_id: int, s: layout.Job) -> "JobInfo":
        return cls(job_id=job_id, **{f: getattr(s, f) for f, _ in layout.Job._fields_})


@dataclass(frozen=True)
class RoundState:
    base_round: int
    workers_done: tuple[int, int]  # by parity
    scale_exp: tuple[int | None, int | None]  # by parity; None = no packet yet


class DataplaneMaps:
    """Open with ``DataplaneMaps.open(instance)``; ``close()`` (or ``with``) releases fds and mmaps."""

    def __init__(self, instance: str, fds: dict[str, int]):
        self.instance = instance
        self._fds = fds
        self._mmaps: list[mmap.mmap] = []
        self.pool = self._map_array("pool", np.dtype("<i8"))
        self.pstate = self._map_array("pstate", layout.PSTATE_DTYPE)
        self.wstate = self._map_array("wstate", layout.WSTATE_DTYPE)
        self.ncpus = libbpf.num_possible_cpus()
        self._pending: list[Completion] = []
        self._rb = libbpf.RingBuffer(fds["completions"], self._on_completion)

    @classmethod
    def open(cls, instance: str = "default") -> "DataplaneMaps":
        loader.require_root("opening the dataplane maps")
        d = loader.pin_dir(instance)
        if not loader.is_loaded(instance):
            if not loader.bpffs_mounted() and loader.under_ip_netns_exec():
                raise DosaError(loader.BPFFS_HINT)
            raise DosaError(f"dataplane instance {instance!r} is not loaded (no pins in {d}); "
                            "run `dosa ctl attach` first")
        fds: dict[str, int] = {}
        try:
            for name in loader.MAP_NAMES:
                fds[name] = libbpf.obj_get(f"{d}/{name}")
            return cls(instance, fds)
        except Exception:
            for fd in fds.values():
                os.close(fd)
            raise

    def _map_array(self, name: str, dtype: np.dtype) -> np.ndarray:
        info = libbpf.map_info(self._fds[name])
        if info.value_size != dtype.itemsize:
            raise DosaError(f"map {name} has {info.value_size}-byte values, this code expects "
                            f"{dtype.itemsize}: the pinned program is from another dosa version")
        mm = mmap.mmap(self._fds[name], info.max_entries * dtype.itemsize, mmap.MAP_SHARED,
                       mmap.PROT_READ | mmap.PROT_WRITE)
        self._mmaps.append(mm)
        return np.frombuffer(mm, dtype, count=info.max_entries)

    def close(self) -> None:
        if self._rb is not None:
            self._rb.close()
            self._rb = None
        self.pool = self.pstate = self.wstate = None
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a buffer() view; the mapping goes when it does
        self._mmaps = []
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------------------------------------
    # DPU worker side
    # ---------------------------------------------------------------------------------------------
    def _on_completion(self, raw: bytes) -> None:
        ev = layout.Completion_.from_buffer_copy(raw[:ctypes.sizeof(layout.Completion_)])
        self._pending.append(Completion(ev.job_id, ev.partition, ev.round, ev.scale_exp))

    def poll_completions(self, timeout_ms: int = 0) -> list[Completion]:
        """Completion events since the last call, waiting up to ``timeout_ms`` for the first one."""
        try:
            if timeout_ms > 0:
                self._rb.poll(timeout_ms)
            else:
                self._rb.consume()
        except OSError as e:
            if e.errno != errno.EINTR:
                raise
        out, self._pending = self._pending, []
        return out

    def job_info(self, job_id: int) -> JobInfo | None:
        s = layout.Job()
        if not libbpf.lookup(self._fds["jobs"], layout.U32(job_id), s):
            return None
        return JobInfo.from_struct(job_id, s)

    def _job(self, job_id: int) -> JobInfo:
        j = self.job_info(job_id)
        if j is None:
            raise DosaError(f"job {job_id} is not installed in dataplane {self.instance!r}")
        return j

    def jobs(self) -> list[JobInfo]:
        return [j for k in libbpf.keys(self._fds["jobs"], layout.U32)
                if (j := self.job_info(k.value)) is not None]

    def buffer(self, job_id: int, partition: int, round: int, job: JobInfo | None = None) -> np.ndarray:
        """Zero-copy int64 view of the sums of (partition, round parity): element i is index lo + i."""
        j = job or self._job(job_id)
        local = j.local(partition)
        lo, hi = j.bounds(partition)
        start = j.pool_off + (local * 2 + (round & 1)) * j.stride
        return self.pool[start:start + (hi - lo)]

    def _ps_index(self, j: JobInfo, partition: int) -> int:
        return j.pstate_off + j.local(partition)

    def _ws_slice(self, j: JobInfo, partition: int, parity: int) -> slice:
        start = j.wstate_off + (j.local(partition) * 2 + parity) * j.workers
        return slice(start, start + j.workers)

    def round_state(self, job_id: int, partition: int) -> RoundState:
        j = self._job(job_id)
        ps = self.pstate[self._ps_index(j, partition)]
        tags = [int(t) for t in ps["scale_tag"]]
        return RoundState(int(ps["base_round"]), (int(ps["workers_done"][0]), int(ps["workers_done"][1])),
                          tuple(t - layout.SCALE_TAG_BIAS if t else None for t in tags))

    def is_complete(self, job_id: int, partition: int, round: int) -> bool:
        j = self._job(job_id)
        ps = self.pstate[self._ps_index(j, partition)]
        base = int(ps["base_round"])
        return base <= round <= base + 1 and int(ps["workers_done"][round & 1]) >= j.workers

    def advance(self, job_id: int, partition: int, completed_round: int, nonzero=None) -> bool:
        """Round ``completed_round`` of ``partition`` is complete: clear the buffer, dedup bitmaps and
        counters of the previous round's parity and set base_round = completed_round (docs/protocol.md,
        *Rounds*). Call it BEFORE sending the result of completed_round. Idempotent: returns False
        (and touches nothing) when base_round is already >= completed_round.

        ``nonzero``: offsets (from the partition's first index) of every non-zero entry of the
        buffer being cleared, when the caller knows them (the DPU worker extracted them for the
        result): only those are zeroed. A 25M-entry job's buffers are 200 MB a round; its non-zeros
        a few MB. None zeroes the whole buffer."""
        j = self._job(job_id)
        i = self._ps_index(j, partition)
        base = int(self.pstate["base_round"][i])
        if completed_round <= base:
            return False
        if completed_round != base + 1:
            raise DosaError(f"cannot advance job {job_id} partition {partition} to round "
                            f"{completed_round}: base round is {base}, only {base + 1} can complete")
        par = base & 1
        # base first: from now on a late copy of round `base` is too_old and touches nothing we clear
        self.pstate["base_round"][i] = completed_round
        self._clear_parity(j, partition, par, nonzero)
        return True

    def _clear_parity(self, j: JobInfo, partition: int, par: int, nonzero=None) -> None:
        i = self._ps_index(j, partition)
        buf = self.buffer(j.job_id, partition, par, job=j)
        if nonzero is None:
            buf[:] = 0
        else:
            buf[nonzero] = 0
        self.wstate[self._ws_slice(j, partition, par)] = 0
        self.pstate["workers_done"][i, par] = 0
        self.pstate["scale_tag"][i, par] = 0

    # ---------------------------------------------------------------------------------------------
    # counters
    # ---------------------------------------------------------------------------------------------
    def counters_array(self) -> np.ndarray:
        """Counter values summed over CPUs, indexed by reasons.Counter."""
        fd = self._fds["counters"]
        val = (ctypes.c_uint64 * self.ncpus)()
        out = np.zeros(reasons.NUM_COUNTERS, np.uint64)
        for c in range(reasons.NUM_COUNTERS):
            if libbpf.lookup(fd, layout.U32(c), val):
                out[c] = sum(val)
        return out

    def counters(self) -> dict[str, int]:
        """{counter name: value summed over CPUs}, names from reasons.Counter in lower case."""
        arr = self.counters_array()
        return {reasons.name(c): int(arr[c]) for c in reasons.Counter}

    def reset_counters(self) -> None:
        zero = (ctypes.c_uint64 * self.ncpus)()
        for c in range(reasons.NUM_COUNTERS):
            libbpf.update(self._fds["counters"], layout.U32(c), zero)

    # ---------------------------------------------------------------------------------------------
    # control-plane side (control.Controller decides; these only write)
    # ---------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> dict[str, int]:
        return {"pool": len(self.pool), "pstate": len(self.pstate), "wstate": len(self.wstate),
                "jobs": libbpf.map_info(self._fds["jobs"]).max_entries,
                "flows": libbpf.map_info(self._fds["flows"]).max_entries}

    def clear_job_state(self, j: JobInfo) -> None:
        """Zero the job's whole region (buffers, partition and worker states)."""
        self.pool[j.pool_off:j.pool_off + j.pool_len] = 0
        self.pstate[j.pstate_off:j.pstate_off + j.num_owned] = 0
        self.wstate[j.wstate_off:j.wstate_off + j.wstate_len] = 0

    def put_job(self, j: JobInfo) -> None:
        libbpf.update(self._fds["jobs"], layout.U32(j.job_id), j.to_struct())

    def delete_job(self, job_id: int) -> bool:
        return libbpf.delete(self._fds["jobs"], layout.U32(job_id))

    def put_flow(self, job_id: int, worker_id: int, address: str, port: int) -> None:
        try:
            saddr = struct.unpack("<I", socket.inet_aton(address))[0]  # network order in memory
        except OSError:
            raise DosaError(f"worker address {address!r} is not an IPv4 address") from None
        if not 0 < port < 65536:
            raise DosaError(f"worker port {port} outside 1..65535")
        libbpf.update(self._fds["flows"], layout.FlowKey(job_id, worker_id),
                      layout.Flow(saddr, socket.htons(port), 0))

    def delete_flow(self, job_id: int, worker_id: int) -> bool:
        return libbpf.delete(self._fds["flows"], layout.FlowKey(job_id, worker_id))

    def flows(self, job_id: int | None = None) -> dict[tuple[int, int], tuple[str, int]]:
        """{(job, worker): (address, port)}."""
        out = {}
        for k in libbpf.keys(self._fds["flows"], layout.FlowKey):
            if job_id is not None and k.job_id != job_id:
                continue
            v = layout.Flow()
            if libbpf.lookup(self._fds["flows"], k, v):
                out[(k.job_id, k.worker_id)] = (socket.inet_ntoa(struct.pack("<I", v.saddr)),
                                                socket.ntohs(v.sport))
        return out

    def add_port(self, port: int) -> None:
        libbpf.update(self._fds["ports"], layout.U32(port), layout.U32(1))

    def remove_port(self, port: int) -> bool:
        return libbpf.delete(self._fds["ports"], layout.U32(port))

    def ports(self) -> list[int]:
        return sorted(k.value for k in libbpf.keys(self._fds["ports"], layout.U32))
