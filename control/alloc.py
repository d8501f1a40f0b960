"""Admission and first-fit allocation of job regions in the dataplane's fixed pools.

A job's DPU memory is set by its aggregation *slots* (docs/dataplane.md, *Slots*), not by its
size: ``slots x 2`` pool buffers (each 65536 s32 sums and a touched list, dataplane.layout.BUF_DTYPE),
``slots`` slot states and ``slots x 2 x workers`` worker states. Admission reasons in those units
and tells two refusals apart: a job that can never
fit this dataplane (``AdmissionError.permanent``: even an empty pool is too small; the message
says how many slots would fit) and one that fits once other jobs end (the message names them).

The allocation is never stored on its own: it is recomputed from the installed jobs (each job's
``pool_off``/``pstate_off``/``wstate_off`` and sizes), so a restarted control process sees exactly
the regions the live dataplane uses.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from dataplane.layout import BUF_DTYPE, touched_list_cap  # noqa: F401 (admission's list rule)
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


@dataclass(frozen=True)
class SlotDemand:
    """What one job asks of one DPU's dataplane."""

    job_id: int
    slots: int  # aggregation slots on this DPU (its window of partitions in flight)
    stride: int  # sums used in each of its buffers: min(partition_size, numel)
    workers: int
    list_cap: int = 0  # u16 offsets in each buffer's touched list (touched_list_cap(stride))

    @property
    def pool(self) -> int:
        """Pool buffers: two (occupant parity) a slot."""
        return self.slots * 2

    @property
    def pstate(self) -> int:
        return self.slots

    @property
    def wstate(self) -> int:
        return self.slots * 2 * self.workers

    def per_slot(self, pool: str) -> int:
        return {"pool": 2, "pstate": 1, "wstate": 2 * self.workers}[pool]


#: the ``dosa ctl attach`` option that sizes each pool (the maps are sized when the program loads)
ATTACH_OPTION = {"pool": "--pool-buffers", "pstate": "--pstate-slots", "wstate": "--wstate-slots"}


def _slots(n: int) -> str:
    return f"{n} slot" + ("" if n == 1 else "s")


def _mib(buffers: int) -> str:
    return f"{buffers * BUF_DTYPE.itemsize / 2**20:.1f} MiB"


def admit(demand: SlotDemand, used: dict[str, list[tuple[int, int, int]]],
          capacity: dict[str, int]) -> dict[str, int]:
    """Offsets {pool, pstate, wstate} of ``demand``'s regions, first fit in each pool.

    ``used[pool]``: (offset, length, job_id) of the installed jobs' regions. Raises AdmissionError:
    permanent (with the largest slot count that would fit an empty dataplane) when a pool is
    smaller than the demand, else naming the jobs whose regions stand in the way."""
    what = {"pool": "pool buffers", "pstate": "slot states", "wstate": "worker states"}
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
            mem = f" ({_mib(size)}: 2 buffers a slot)"
        head = (f"job {demand.job_id} needs {demand.slots} aggregation slots on this DPU: "
                f"{size} {what[name]}{mem}")
        if size > capacity[name]:
            fit = min(capacity[p] // demand.per_slot(p) for p in ("pool", "pstate", "wstate"))
            raise AdmissionError(
                f"{head}, but the dataplane has only {capacity[name]} in all, so it can never fit: "
                + (f"ask for at most {_slots(fit)} (the job's 'slots'), " if fit else "")
                # a buffer is the fixed dosa_buf whatever the partition size: only fewer slots or
                # a bigger dataplane make room
                + f"or attach the dataplane with more (dosa ctl attach {ATTACH_OPTION[name]} N)", permanent=True)
        holders = sorted({j for _, n, j in used[name] if n > 0})
        fit = largest // per
        raise AdmissionError(
            f"{head}, but the largest free region has {largest} (of {capacity[name]}; jobs "
            f"{holders} hold the rest): it fits once one of them ends; retry then"
            + (f", or ask for at most {_slots(fit)}" if fit else ""))
    return out
