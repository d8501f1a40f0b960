"""The userspace merge state machine: what the XDP dataplane does, for machines without XDP.

Same rules as the dataplane (docs/protocol.md, *Rounds, buffers, duplicates*): per owned partition
two s64 buffers by round parity, rounds ``base_round`` and ``base_round + 1`` accepted, a dedup bit
per (partition, parity, worker, seq), completion when every worker delivered ``total`` distinct
packets, exactly one completion per (partition, round). The per-packet loop is the Cython kernel
``_merge.merge_batch``; this module owns the arrays and names the verdicts.

With ``state_dir`` the arrays live in files (``/dev/shm/...`` by default from the CLI), so a worker
that is killed and restarted re-opens them and continues exactly where it stopped, like the XDP
mode does with pinned maps.
"""
from __future__ import annotations

import os

import numpy as np

from dataplane import reasons
from dataplane.reasons import Counter
from dosa.wire import MAX_PACKETS_PER_CONTRIBUTION

from . import _merge

#: merge_batch verdicts are dataplane counters (dataplane/reasons.py): code -> the counter's name,
#: the same names ``dosa ctl stats`` shows for the XDP dataplane.
VERDICTS = {int(c): reasons.name(c) for c in Counter}
ACCEPTED, DUPLICATE, DUP_OF_COMPLETE = Counter.MERGED, Counter.DUPLICATE, Counter.PASS_DUP_OF_COMPLETE
SCALE_UNSET = 127


def top_k_abs(indices: np.ndarray, sums: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k entries of largest |sum|, ties broken by the smaller index, kept in index order.

    Deterministic on purpose: every DPU and every test computes the same selection.
    """
    n = len(sums)
    if n <= k:
        return indices, sums
    a = np.abs(sums.astype(np.int64))
    thr = np.partition(a, n - k)[n - k]
    sel = a > thr
    need = k - int(sel.sum())
    if need > 0:
        sel[np.flatnonzero(a == thr)[:need]] = True
    return indices[sel], sums[sel]


class MergeState:
    """Merge state of the partitions one DPU owns for one job (``owned`` = global partition ids)."""

    def __init__(self, owned: np.ndarray, lo: np.ndarray, hi: np.ndarray, workers: int,
                 partition_size: int, state_dir: str | None = None):
        self.owned = np.asarray(owned, np.int64)
        self.lo = np.ascontiguousarray(lo, np.int64)
        self.hi = np.ascontiguousarray(hi, np.int64)
        self.workers = int(workers)
        n = len(self.owned)
        shapes = {
            "base_round": ((n,), np.int64),
            "seen": ((n, 2, workers, MAX_PACKETS_PER_CONTRIBUTION), np.uint8),
            "delivered": ((n, 2, workers), np.int32),
            "totals": ((n, 2, workers), np.int32),
            "done_workers": ((n, 2), np.int32),
            "scale_of": ((n, 2), np.int32),
            "complete": ((n, 2), np.uint8),
            "buf": ((n, 2, partition_size), np.int64),
        }
        self.resumed = False
        for name, (shape, dtype) in shapes.items():
            setattr(self, name, self._array(state_dir, name, shape, dtype))
        if not self.resumed:
            self.scale_of[:] = SCALE_UNSET

    def _array(self, state_dir, name, shape, dtype):
        if state_dir is None:
            return np.zeros(shape, dtype)
        os.makedirs(state_dir, exist_ok=True)
        path = os.path.join(state_dir, name + ".npy")
        if os.path.exists(path):
            arr = np.lib.format.open_memmap(path, mode="r+")
            if arr.shape == shape and arr.dtype == dtype:
                self.resumed = True
                return arr
            del arr
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    def merge(self, lp, rnd, wid, seq, total, count, scale, eidx, evals, eoff):
        """Run one batch (per-packet arrays, already filtered to owned SPARSE_DATA of this job).

        Returns (verdicts int8 per packet, completions [(local partition, round), ...] in order).
        """
        n = len(lp)
        verdict = np.empty(n, np.int8)
        comp = np.empty((n, 2), np.int64)
        c = np.ascontiguousarray
        k = _merge.merge_batch(
            c(eidx, np.uint32), c(evals, np.int32), c(eoff, np.int64), c(lp, np.int32),
            c(rnd, np.int64), c(wid, np.int32), c(seq, np.int32), c(total, np.int32),
            c(count, np.int32), c(scale, np.int32), self.lo, self.hi, self.base_round, self.seen,
            self.delivered, self.totals, self.done_workers, self.scale_of, self.complete, self.buf,
            self.workers, verdict, comp)
        return verdict, [(int(a), int(b)) for a, b in comp[:k]]

    def in_window(self, lp: int, rnd: int) -> bool:
        b = int(self.base_round[lp])
        return b <= rnd <= b + 1

    def is_complete(self, lp: int, rnd: int) -> bool:
        return self.in_window(lp, rnd) and bool(self.complete[lp, rnd & 1])

    def missing_workers(self, lp: int, rnd: int) -> list[int]:
        """Workers that have not delivered their whole contribution to (lp, rnd) (in the window)."""
        par = rnd & 1
        t = self.totals[lp, par]
        missing = (t == 0) | (self.delivered[lp, par] < t)
        return np.flatnonzero(missing).tolist()

    def buffer(self, lp: int, rnd: int) -> np.ndarray:
        return self.buf[lp, rnd & 1]

    def advance(self, lp: int, completed_round: int, nonzero=None) -> None:
        """Round ``completed_round`` of ``lp`` completed while it was base_round + 1: every host has
        moved past the base round, so clear its parity (buffer, bitmap, counters) and make
        ``completed_round`` the base. ``nonzero``: indices of the cleared buffer's non-zeros when
        known (clearing them is O(nnz) instead of a memset of the partition)."""
        old = completed_round - 1
        if int(self.base_round[lp]) != old:
            return
        par = old & 1
        if nonzero is not None:
            _merge.clear_indices(self.buf[lp, par], np.ascontiguousarray(nonzero, np.uint32),
                                 int(self.lo[lp]))
        else:
            self.buf[lp, par].fill(0)
        self.seen[lp, par].fill(0)
        self.delivered[lp, par].fill(0)
        self.totals[lp, par].fill(0)
        self.done_workers[lp, par] = 0
        self.scale_of[lp, par] = SCALE_UNSET
        self.complete[lp, par] = 0
        self.base_round[lp] = completed_round

    def flush(self) -> None:
        for name in ("base_round", "seen", "delivered", "totals", "done_workers", "scale_of",
                     "complete", "buf"):
            arr = getattr(self, name)
            if isinstance(arr, np.memmap):
                arr.flush()
