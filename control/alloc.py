"""Admission and first-fit allocation of job regions in the dataplane's fixed pools.

A job's DPU memory is set by its aggregation *slots* (docs/dataplane.md, *Slots*), not by its
size: ``slots x 2 x pitch`` pool entries (s64; a buffer's pitch is its ``stride`` sums plus its
touched list, ``list_cap`` u16 offsets packed 4 an entry), ``slots`` slot states and
``slots x 2 x workers`` worker states. Admission reasons in those units and tells two refusals apart: a job that can never
fit this dataplane (``AdmissionError.permanent``: even an empty pool is too small; the message
says how many slots would fit) and one that fits once other jobs end (the message names them).

The allocation is never stored on its own: it is recomputed from the installed jobs (each job's
``pool_off``/``pstate_off``/``wstate_off`` and sizes), so a restarted control process sees exactly
the regions the live dataplane uses.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from dataplane.layout import buffer_pitch
from dosa.errors import DosaError


class AdmissionError(DosaError):
    """A job does not fit in what is left of a fixed pool (or table). ``permanent``: it could not
    fit even if this dataplane held no other job."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


def find_gap(used: list[tuple[int, int]], size: int, capacity: int) -> tuple[int | None, int]:
    """(offset of the first gap of ``size`` elements among ``used`` (offset, length) regions of a
    pool of ``capacity``, or None; the largest gap)."""
    if size <= 0:
        return 0, capacity
    pos = 0
    largest = 0
    for off, length in sorted(r for r in used if r[1] > 0):
        if off - pos >= size:
            return pos, max(largest, off - pos)
        largest = max(largest, off - pos)
        pos = max(pos, off + length)
    largest = max(largest, capacity - pos)
    return (pos if capacity - pos >= size else None), largest


def first_fit(used: list[tuple[int, int]], size: int, capacity: int, what: str) -> int:
    """Offset of the first gap of ``size`` elements; AdmissionError naming ``what`` when there is none."""
    off, largest = find_gap(used, size, capacity)
    if off is None:
        raise AdmissionError(f"the job needs {size} {what} but the largest free region has {largest} "
                             f"(of {capacity})", permanent=size > capacity)
    return off


def touched_list_cap(stride: int) -> int:
    """Touched-list capacity of a buffer of ``stride`` sums: a quarter of them, rounded down to a
    multiple of 4 (4 u16 offsets fill one s64 pool entry), so a list costs stride / 16 entries
    (6.25 % more pool). Up to 25 % density the DPU worker reads only the listed sums; above, the
    list overflows and it scans the buffer, which then costs no more per non-zero than the list
    would. 0 (no lists) for buffers under 16 sums."""
    return (stride // 4) & ~3


def pool_entries(slots: int, stride: int) -> int:
    """Pool entries (s64) ``slots`` aggregation slots of ``stride``-sum buffers take with their
    touched lists: what to size a pool for (LoadConfig.pool_slots) so a job gets its lists."""
    return SlotDemand(0, slots, stride, 1, touched_list_cap(stride)).pool


@dataclass(frozen=True)
class SlotDemand:
    """What one job asks of one DPU's dataplane."""

    job_id: int
    slots: int  # aggregation slots on this DPU (its window of partitions in flight)
    stride: int  # s64 sums per slot buffer: min(partition_size, numel)
    workers: int
    list_cap: int = 0  # u16 offsets in each buffer's touched list (touched_list_cap(stride))

    @property
    def pitch(self) -> int:
        """Pool entries per buffer: its sums, then its touched list packed 4 offsets an entry."""
        return buffer_pitch(self.stride, self.list_cap)

    @property
    def pool(self) -> int:
        return self.slots * 2 * self.pitch

    @property
    def pstate(self) -> int:
        return self.slots

    @property
    def wstate(self) -> int:
        return self.slots * 2 * self.workers

    def per_slot(self, pool: str) -> int:
        return {"pool": 2 * self.pitch, "pstate": 1, "wstate": 2 * self.workers}[pool]


def _slots(n: int) -> str:
    return f"{n} slot" + ("" if n == 1 else "s")


def _mib(entries: int) -> str:
    return f"{entries * 8 / 2**20:.1f} MiB"


def admit(demand: SlotDemand, used: dict[str, list[tuple[int, int, int]]],
          capacity: dict[str, int]) -> dict[str, int]:
    """Offsets {pool, pstate, wstate} of ``demand``'s regions, first fit in each pool.

    ``used[pool]``: (offset, length, job_id) of the installed jobs' regions. Raises AdmissionError:
    permanent (with the largest slot count that would fit an empty dataplane) when a pool is
    smaller than the demand, else naming the jobs whose regions stand in the way."""
    what = {"pool": "pool entries", "pstate": "slot states", "wstate": "worker states"}
    out = {}
    for name in ("pool", "pstate", "wstate"):
        size = getattr(demand, name)
        off, largest = find_gap([(o, n) for o, n, _ in used[name]], size, capacity[name])
        if off is not None:
            out[name] = off
            continue
        per = demand.per_slot(name)
        mem = ""
        if name == "pool":
            lists = (f" + a {demand.list_cap}-offset touched list in {demand.list_cap // 4} entries"
                     if demand.list_cap else "")
            mem = f" ({_mib(size)}: 2 buffers a slot, each {demand.stride} s64 sums{lists})"
        head = (f"job {demand.job_id} needs {demand.slots} aggregation slots on this DPU: "
                f"{size} {what[name]}{mem}")
        if size > capacity[name]:
            fit = min(capacity[p] // demand.per_slot(p) for p in ("pool", "pstate", "wstate"))
            raise AdmissionError(
                f"{head}, but the dataplane has only {capacity[name]} in all, so it can never fit: "
                + (f"ask for at most {_slots(fit)} (the job's 'slots'), " if fit else "")
                + "use a smaller partition_size, or attach the dataplane with a bigger pool", permanent=True)
        holders = sorted({j for _, n, j in used[name] if n > 0})
        fit = largest // per
        raise AdmissionError(
            f"{head}, but the largest free region has {largest} (of {capacity[name]}; jobs "
            f"{holders} hold the rest): it fits once one of them ends; retry then"
            + (f", or ask for at most {_slots(fit)}" if fit else ""))
    return out


def admit_job(demand: SlotDemand, used: dict[str, list[tuple[int, int, int]]],
              capacity: dict[str, int]) -> tuple[SlotDemand, dict[str, int]]:
    """``admit`` with the touched lists optional: (the demand admitted, its offsets). The lists only
    spare the DPU worker a scan of each completed buffer, so a window that fits the pool only
    without them (a pool sized to ``slots x 2 x stride``, as some callers compute it) runs without
    them rather than being refused. One that fits neither way raises admit's error for the demand
    with its lists (what a freed or bigger pool would give the job), unless only that one can
    never fit: then the error of the demand without lists, which fits once other jobs end."""
    try:
        return demand, admit(demand, used, capacity)
    except AdmissionError as e:
        if not demand.list_cap:
            raise
        lean = replace(demand, list_cap=0)
        try:
            return lean, admit(lean, used, capacity)
        except AdmissionError as e2:
            raise (e2 if e.permanent and not e2.permanent else e) from None
