"""DataplaneMaps: the pinned state of one dataplane instance, usable from ANY process.

The DPU worker (another process) uses the read/advance side::

    from dataplane.maps import DataplaneMaps
    dp = DataplaneMaps.open("dpu0")
    for c in dp.poll_completions(timeout_ms=100):       # Completion(job_id, partition, round, scale_exp)
        sums = dp.buffer(c.job_id, c.partition, c.round)  # int32 view, zero-copy: index lo + i
        lst, n = dp.touched(c.job_id, c.partition, c.round)  # offsets of its non-zeros (n <= len(lst))
        ...  # build and send result packets from sums
        dp.advance(c.job_id, c.partition, c.round)        # clear the slot's previous occupant

The control plane (control.Controller) uses the write side: put_job / delete_job / put_flow /
delete_flow / add_port and clear_job_state. Layout and reasons: docs/dataplane.md.

Maps are opened by their pins (/sys/fs/bpf/dosa/<instance>/); the pool, state and settings arrays
are mmap'ed and viewed with numpy, the completion rings read through their mmap (dataplane.ring), so reading a buffer or clearing a parity costs no syscall per element.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
from dataclasses import dataclass

import numpy as np

from dosa.errors import DosaError
from dosa.job import RESULT_MODES

from . import layout, libbpf, loader, reasons
from .ring import Ring, wait_readable


#: a job's result mode as the jobs map stores it: its index in dosa.job.RESULT_MODES
MODES = {name: code for code, name in enumerate(RESULT_MODES)}
MODE_SUM = MODES["sum"]  # exact sums of every index any worker sent
MODE_GTOPK = MODES["gtopk"]  # results carry only the k largest sums (the DPU worker applies it)


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
    stride: int = 0  # s64 sums per buffer; 0 = min(partition_size, numel)
    slots: int = 0  # aggregation slots of the job on this DPU (docs/dataplane.md); 0 = num_owned
    list_cap: int = 0  # u16 offsets in each buffer's touched list (a multiple of 4); 0 = no lists

    def __post_init__(self):
        if not self.stride:
            object.__setattr__(self, "stride", min(self.partition_size, self.numel))
        if not self.slots:
            object.__setattr__(self, "slots", self.num_owned)
        if self.list_cap % 4 or not 0 <= self.list_cap <= layout.LIST_CAP:
            raise DosaError(f"job {self.job_id}: touched-list capacity {self.list_cap} is not a "
                            f"multiple of 4 in 0..{layout.LIST_CAP} (a buffer's list holds "
                            f"{layout.LIST_CAP} u16 offsets, 4 a word)")
        if self.stride > layout.BUF_SUMS:
            raise DosaError(f"job {self.job_id}: {self.stride} sums a buffer, more than the "
                            f"{layout.BUF_SUMS} a buffer holds")

    @property
    def pool_len(self) -> int:
        """Pool buffers the job holds: two (occupant parity) per slot, whatever numel."""
        return self.slots * 2

    @property
    def pstate_len(self) -> int:
        return self.slots

    @property
    def wstate_len(self) -> int:
        return self.slots * 2 * self.workers

    # ---- slots: owned partition j aggregates in slot j % slots as occupant (generation)
    # g = round * n_s + j // slots, n_s = the slot's occupants a round (docs/dataplane.md)
    def slot(self, p: int) -> int:
        return self.local(p) % self.slots

    def per_round(self, slot: int) -> int:
        """Occupants of ``slot`` in one round: owned partitions slot, slot + slots, ..."""
        return -(-(self.num_owned - slot) // self.slots)

    def gen(self, p: int, round: int) -> int:
        """(partition, round) as its slot's occupant number (0, 1, 2, ... without gaps)."""
        local = self.local(p)
        s = local % self.slots
        return round * self.per_round(s) + local // self.slots

    def occupant(self, slot: int, gen: int) -> tuple[int, int]:
        """(partition, round) that is occupant ``gen`` of ``slot``."""
        rnd, k = divmod(gen, self.per_round(slot))
        return (slot + k * self.slots) * self.num_dpus + self.dpu_index, rnd

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
    """The state of a partition's slot: its base occupant (the shadow copy once the next one
    started) as generation and as (partition, round), and per parity its completion and scale."""

    base_round: int
    workers_done: tuple[int, int]  # by parity
    scale_exp: tuple[int | None, int | None]  # by parity; None = no packet yet
    base_gen: int = 0
    base_partition: int = 0


class DataplaneMaps:
    """Open with ``DataplaneMaps.open(instance)``; ``close()`` (or ``with``) releases fds and mmaps."""

    def __init__(self, instance: str, fds: dict[str, int]):
        self.instance = instance
        self._fds = fds
        self._mmaps: list[mmap.mmap] = []
        #: the aggregation buffers (layout.BUF_DTYPE): ``pool["sums"][b]`` is buffer b's s32 sums
        self.pool = self._map_array("pool", layout.BUF_DTYPE)
        self.pstate = self._map_array("pstate", layout.PSTATE_DTYPE)
        self.wstate = self._map_array("wstate", layout.WSTATE_DTYPE)
        self.settings = self._map_array("settings", layout.SETTINGS_DTYPE)
        self.ncpus = libbpf.num_possible_cpus()
        self._rings: dict[int, Ring] = {}

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
        for r in self._rings.values():
            r.close()
        self._rings = {}
        self.pool = self.pstate = self.wstate = self.settings = None
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
    def ring(self, shard: int = 0) -> Ring:
        """The completion ring of DPU worker shard ``shard`` (records of the slots with
        ``slot % shards == shard``), mapped once per process."""
        if not 0 <= shard < layout.MAX_SHARDS:
            raise DosaError(f"shard {shard} outside 0..{layout.MAX_SHARDS - 1}")
        r = self._rings.get(shard)
        if r is None:
            r = self._rings[shard] = Ring(self._fds[loader.RING_NAMES[shard]])
        return r

    def poll_completions(self, timeout_ms: int = 0, shard: int | None = None) -> list[Completion]:
        """Completion events since the last call (of ``shard``'s ring, or of every ring), waiting
        up to ``timeout_ms`` for the first one; consumed (committed) on return."""
        shards = range(layout.MAX_SHARDS) if shard is None else [shard]
        out: list[Completion] = []
        for attempt in (0, 1):
            for i in shards:
                r = self.ring(i)
                recs = r.read()
                r.commit()
                out += [Completion(int(c["job_id"]), int(c["partition"]), int(c["round"]),
                                   int(c["scale_exp"])) for c in recs]
            if out or timeout_ms <= 0 or attempt:
                return out
            wait_readable([self.ring(i).fd for i in shards], timeout_ms)
        return out

    def completion_fd(self, shard: int = 0) -> int:
        """An fd that polls readable while completion records wait in ``shard``'s ring (select or
        poll it next to a socket, then ``poll_completions(0)``)."""
        return self.ring(shard).fd

    def set_shards(self, n: int) -> None:
        """How many completion rings XDP spreads the slots over (one per DPU worker shard)."""
        if not 1 <= n <= layout.MAX_SHARDS:
            raise DosaError(f"{n} DPU worker shards: 1..{layout.MAX_SHARDS} are possible")
        self.settings["shards"][0] = n

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

    def buffer_index(self, j: JobInfo, partition: int, round: int) -> int:
        """Pool buffer of (partition, round): its slot's buffer of that occupant's parity."""
        return j.pool_off + j.slot(partition) * 2 + (j.gen(partition, round) & 1)

    def buffer(self, job_id: int, partition: int, round: int, job: JobInfo | None = None) -> np.ndarray:
        """Zero-copy int32 view of the sums of (partition, round) in its slot's buffer of that
        occupant's parity: element i is index lo + i. Meaningful while (partition, round) is one of
        the slot's two accepted occupants (``in_window``)."""
        j = job or self._job(job_id)
        lo, hi = j.bounds(partition)
        return self.pool["sums"][self.buffer_index(j, partition, round), :hi - lo]

    def touched(self, job_id: int, partition: int, round: int,
                job: JobInfo | None = None) -> tuple[np.ndarray, int] | None:
        """The touched list of (partition, round)'s buffer (see ``buffer``) as (zero-copy uint16
        view of its ``list_cap`` positions, count): every merged sparse packet copies its offsets
        (index - lo) there in whole 4-offset words, so when ``count <= list_cap`` the first
        ``count`` positions name every non-zero sum (most more than once, some whose sum is zero,
        some past the partition); a larger count means the list overflowed (scan the buffer).
        None: the job keeps no lists."""
        j = job or self._job(job_id)
        if not j.list_cap:
            return None
        b = self.buffer_index(j, partition, round)
        lst = self.pool["list"][b].view(np.uint16)[:j.list_cap]
        return lst, int(self.pstate["touched"][j.pstate_off + j.slot(partition), j.gen(partition, round) & 1])

    def _ps_index(self, j: JobInfo, partition: int) -> int:
        return j.pstate_off + j.slot(partition)

    def _ws_slice(self, j: JobInfo, slot: int, parity: int) -> slice:
        start = j.wstate_off + (slot * 2 + parity) * j.workers
        return slice(start, start + j.workers)

    def worker_state(self, job_id: int, partition: int, round: int) -> np.ndarray:
        """The per-worker states (dedup bits, received, total) of (partition, round)'s slot parity."""
        j = self._job(job_id)
        return self.wstate[self._ws_slice(j, j.slot(partition), j.gen(partition, round) & 1)]

    def round_state(self, job_id: int, partition: int) -> RoundState:
        j = self._job(job_id)
        ps = self.pstate[self._ps_index(j, partition)]
        tags = [int(t) for t in ps["scale_tag"]]
        gen = int(ps["base_gen"])
        bp, br = j.occupant(j.slot(partition), gen)
        return RoundState(br, (int(ps["workers_done"][0]), int(ps["workers_done"][1])),
                          tuple(t - layout.SCALE_TAG_BIAS if t else None for t in tags), gen, bp)

    def in_window(self, job_id: int, partition: int, round: int, job: JobInfo | None = None) -> bool:
        """Whether (partition, round) is its slot's base occupant or the one after it."""
        j = job or self._job(job_id)
        base = int(self.pstate["base_gen"][self._ps_index(j, partition)])
        return base <= j.gen(partition, round) <= base + 1

    def is_complete(self, job_id: int, partition: int, round: int, job: JobInfo | None = None) -> bool:
        j = job or self._job(job_id)
        ps = self.pstate[self._ps_index(j, partition)]
        base, g = int(ps["base_gen"]), j.gen(partition, round)
        return base <= g <= base + 1 and int(ps["workers_done"][g & 1]) >= j.workers

    def advance(self, job_id: int, partition: int, completed_round: int, nonzero=None,
                job: JobInfo | None = None, clear=None) -> bool:
        """(partition, completed_round) is complete: if it is its slot's occupant after the base,
        every host holds the base occupant's result (a host sends a slot's next occupant only
        then), so clear the base's buffer, dedup bitmaps, counters and touched count (its parity)
        and make (partition, completed_round) the base (docs/dataplane.md, *Slots*). Call it BEFORE
        sending the result of completed_round. Idempotent: returns False (and touches nothing) when the
        slot's base is already that occupant or a later one.

        ``nonzero``: offsets (from the first index of the *cleared* occupant's partition) of every
        non-zero entry of the buffer being cleared, when the caller knows them (the DPU worker
        extracted them for that result): only those are zeroed. None zeroes the whole buffer.
        ``clear``: instead of ``nonzero``, a function ``clear(buf)`` that zeroes the non-zeros of
        the cleared buffer (``buf``: its int32 sums view) itself, e.g. one compiled loop."""
        j = job or self._job(job_id)
        i = self._ps_index(j, partition)
        g = j.gen(partition, completed_round)
        base = int(self.pstate["base_gen"][i])
        if g <= base:
            return False
        if g != base + 1:
            bp, br = j.occupant(j.slot(partition), base)
            raise DosaError(f"cannot advance job {job_id} partition {partition} to round "
                            f"{completed_round}: its slot {j.slot(partition)} holds partition {bp} "
                            f"round {br}, only the occupant after it can complete")
        # base first: from now on a late copy of occupant `base` is too_old and touches nothing we clear
        self.pstate["base_gen"][i] = g
        self._clear_parity(j, j.slot(partition), base & 1, nonzero, clear)
        return True

    def _clear_parity(self, j: JobInfo, slot: int, par: int, nonzero=None, clear=None) -> None:
        i = j.pstate_off + slot
        buf = self.pool["sums"][j.pool_off + slot * 2 + par, :j.stride]
        if clear is not None:
            clear(buf)
        elif nonzero is None:
            buf[:] = 0
        else:
            buf[nonzero] = 0
        self.wstate[self._ws_slice(j, slot, par)] = 0
        self.pstate["workers_done"][i, par] = 0
        self.pstate["scale_tag"][i, par] = 0
        self.pstate["touched"][i, par] = 0  # the list's positions need no clearing: past the count

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
        self.pool["sums"][j.pool_off:j.pool_off + j.pool_len] = 0
        self.pstate[j.pstate_off:j.pstate_off + j.pstate_len] = 0
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
