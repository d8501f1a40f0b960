"""From completed aggregation buffers to result packets, several partitions per call.

The DPU worker's completion path (docs/dpu_worker.md *Building results*): one Cython call
(``_merge.extract_many``) packs the non-zeros of all partitions into a scratch, reading each
partition's sums at the offsets of its touched list (XDP mode, when the list did not overflow) or
in one pass over its whole s64 buffer, the encoding rule of dosa.wire (``wire.encoded_bytes``) is
evaluated once for all of them, and when every partition goes sparse ``_merge.write_sparse_results`` writes the SPARSE_RESULT packets
straight into one PacketBatch: a handful of calls per batch of partitions instead of ~40 numpy
calls. A partition whose dense run is fewer bytes (or with more entries than the protocol allows)
is built by ``dosa.packetizer.packetize_results`` from the same entries and copied into its rows;
both give the same bytes (tests/unit/test_emit.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dosa import wire
from dosa.packetizer import packetize_results
from dosa.wire import MAX_PACKETS_PER_CONTRIBUTION, PacketBatch, PacketType, PartitionMap

from . import _merge


@dataclass
class Results:
    """The result packets of partitions ``parts`` (ascending) of one round: partition k's packets
    are rows ``rows[k]:rows[k+1]`` of ``batch``; its non-zero sums were at the absolute indices
    ``idx[starts[k]:starts[k+1]]`` (``sums`` alike, saturated; a view of the scratch, valid until
    its next use), ``nsat[k]`` of them saturated."""

    batch: PacketBatch
    rows: np.ndarray
    idx: np.ndarray
    sums: np.ndarray
    starts: np.ndarray
    nsat: np.ndarray
    fast: bool  # every partition written by the Cython writer (False: some by packetize_results)


class Scratch:
    """Reusable worst-case arrays for extract_many (grown on demand) and its bitmap (65536 bits,
    zero between calls)."""

    def __init__(self):
        self.idx = np.empty(0, np.uint32)
        self.val = np.empty(0, np.int32)
        self.bits = np.zeros(1024, np.uint64)

    def ensure(self, n: int) -> None:
        if len(self.idx) < n:
            self.idx = np.empty(n, np.uint32)
            self.val = np.empty(n, np.int32)


def extract(bufs: list, lo: np.ndarray, scratch: Scratch | None = None, lists: list | None = None):
    """Non-zeros of every buffer (``bufs[k][i]`` is index ``lo[k] + i``) as (idx u32, sums s32,
    starts int64 n+1, nsat int64 n), one Cython call; idx is a fresh array, sums (with a scratch
    given) a view of the scratch, valid until its next use. ``lists[k]``: None or buffer k's
    touched list as (uint16 array, count) (``DataplaneMaps.touched``): read instead of the whole
    buffer unless it overflowed; the output is the same."""
    scratch = scratch or Scratch()
    n = len(bufs)
    scratch.ensure(sum(len(b) for b in bufs))
    starts = np.empty(n + 1, np.int64)
    nsat = np.empty(n, np.int64)
    m = _merge.extract_many(bufs, np.ascontiguousarray(lo, np.int64), scratch.idx, scratch.val,
                            starts, nsat, lists, scratch.bits)
    return scratch.idx[:m].copy(), scratch.val[:m], starts, nsat


def build_results(bufs: list, parts, lo, pmap: PartitionMap, *, job_id: int, round: int,
                  scale_exp: int, flags: int = 0, mtu: int = wire.DEFAULT_MTU,
                  scratch: Scratch | None = None, lists: list | None = None) -> Results:
    """Result packets of partitions ``parts`` (ascending, unique) of one round from their sum
    buffers (``bufs[k]`` holds partition ``parts[k]``'s sums, element i is index ``lo[k] + i``):
    byte for byte what ``packetize_results`` builds from the buffers' non-zeros (``dest`` -1).
    ``lists``: the buffers' touched lists or None (``extract``)."""
    parts = np.ascontiguousarray(parts, np.int64)
    lo = np.ascontiguousarray(lo, np.int64)
    idx, sums, starts, nsat = extract(bufs, lo, scratch, lists)
    counts = np.diff(starts)
    n = len(parts)
    per_s = wire.entries_per_packet(PacketType.SPARSE_RESULT, mtu)
    npk = np.maximum(1, -(-counts // per_s))
    nonempty = counts > 0
    slow = npk > MAX_PACKETS_PER_CONTRIBUTION  # packetize_results raises the protocol's error
    if nonempty.any():
        ne = np.flatnonzero(nonempty)
        span = np.zeros(n, np.int64)
        span[ne] = idx[starts[1:][ne] - 1].astype(np.int64) - idx[starts[:-1][ne]] + 1
        sparse_b, dense_b = wire.encoded_bytes(counts, span, mtu)
        slow |= nonempty & (dense_b < sparse_b)  # a dense run is fewer bytes
    if not 1 <= job_id <= 2**32 - 1 or not wire.SCALE_EXP_MIN <= scale_exp <= wire.SCALE_EXP_MAX \
            or not 0 <= round <= 2**32 - 1 or flags & ~wire.FLAGS_VALID_MASK or flags & wire.Flags.LAST:
        raise ValueError(f"build_results: bad header arguments (job {job_id}, round {round}, "
                         f"scale_exp {scale_exp}, flags 0x{flags:04x})")
    fast = not slow.any()
    if not fast:
        # the partitions the writer does not take, from the same entries by packetize_results
        sl = np.flatnonzero(slow)
        take = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in sl.tolist()])
        other = packetize_results(idx[take], sums[take], pmap, job_id=job_id, round=round,
                                  scale_exp=scale_exp, flags=flags, partitions=parts[sl], mtu=mtu)
        hp = other.headers()["partition"].astype(np.int64)
        first = np.searchsorted(hp, parts[sl], "left")
        npk[sl] = np.diff(np.append(first, len(other)))
    rows = np.zeros(n + 1, np.int64)
    np.cumsum(npk, out=rows[1:])
    batch = PacketBatch.empty(int(rows[-1]), wire.stride_for_mtu(mtu))
    sp = np.flatnonzero(~slow)
    _merge.write_sparse_results(batch.data, batch.lengths, batch.dest, idx, sums, starts[:-1][sp],
                                starts[1:][sp], parts[sp], np.minimum(lo[sp], wire.MAX_SPARSE_BASE),
                                rows[:-1][sp], npk[sp], per_s, job_id, round, scale_exp, flags, -1)
    if not fast:
        at = np.repeat(rows[:-1][sl], npk[sl]) + np.arange(len(other)) - np.repeat(first, npk[sl])
        batch.data[at] = other.data
        batch.lengths[at] = other.lengths
        batch.dest[at] = other.dest
    return Results(batch, rows, idx, sums, starts, nsat, fast)

