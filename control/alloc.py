"""First-fit allocation of job regions in the dataplane's fixed pools.

The allocation is never stored on its own: it is recomputed from the installed jobs (each job's
``pool_off``/``pstate_off``/``wstate_off`` and sizes), so a restarted control process sees exactly
the regions the live dataplane uses.
"""
from __future__ import annotations

from dosa.errors import DosaError


class AdmissionError(DosaError):
    """A job does not fit in what is left of a fixed pool (or table)."""


def first_fit(used: list[tuple[int, int]], size: int, capacity: int, what: str) -> int:
    """Offset of the first gap of ``size`` elements among ``used`` (offset, length) regions of a
    pool of ``capacity``; AdmissionError naming ``what`` when there is none."""
    if size <= 0:
        return 0
    pos = 0
    largest = 0
    for off, length in sorted(r for r in used if r[1] > 0):
        if off - pos >= size:
            return pos
        largest = max(largest, off - pos)
        pos = max(pos, off + length)
    if capacity - pos >= size:
        return pos
    largest = max(largest, capacity - pos)
    raise AdmissionError(f"the job needs {size} {what} but the largest free region has {largest} "
                         f"(of {capacity}); remove a job or attach the dataplane with a bigger pool")
