"""The hosts' compiled result intake (host_lib/_engine.pyx ``RoundEngine``: what every received
packet of a round goes through, on the socket path and through ``intake``) against its
specification written out packet by packet in Python with the wire's own rules
(``wire.header_verdicts``, ``wire.parse_packet``): the same packets taken, the same state, and the
same entries decoded, on traffic of valid results mixed with corrupted headers, wrong lengths,
other jobs, rounds, senders and scales, indices outside their partition, a partition's packets that
disagree on its total, duplicates and STATUS packets."""
from __future__ import annotations

import numpy as np
import pytest

from dosa import _net, wire
from dosa.packetizer import packetize_results, packetize_status
from dosa.wire import HEADER_DTYPE, PacketBatch, PacketType, PartitionMap
from host_lib import _engine

pytestmark = pytest.mark.timeout(60)

JOB, ROUND, SCALE = 9, 3, 10
K = wire.MAX_PACKETS_PER_CONTRIBUTION
PS = 65536
NUMEL = 5 * PS - 1000


class Spec:
    """The intake, one packet at a time (host_lib/_engine.pyx, its module docstring, step 3)."""

    def __init__(self, P: int):
        self.P = P
        self.got = np.zeros((P, K), np.uint8)
        self.done = np.zeros(P, np.uint8)
        self.res_total = np.zeros(P, np.int64)
        self.res_got = np.zeros(P, np.int64)
        self.entries: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.status: list[bytes] = []
        self.completed: list[int] = []

    def take(self, b: PacketBatch) -> None:
        hv = b.data.view(HEADER_DTYPE)[:, 0]
        verdict = wire.header_verdicts(hv, np.clip(b.lengths, 0, b.stride))
        for i in range(len(b)):
            h, n = hv[i], int(b.lengths[i])
            if n < wire.HDR_LEN or n > b.stride:
                continue
            if int(h["job_id"]) != JOB or int(h["round"]) != ROUND or int(h["partition"]) >= self.P \
                    or int(h["worker_id"]) != wire.DPU_SENDER_ID:
                continue
            t = int(h["type"])
            if t == PacketType.STATUS:
                self.status.append(bytes(b.data[i, :n]))
                continue
            if t not in (PacketType.SPARSE_RESULT, PacketType.DENSE_RESULT) or int(h["scale_exp"]) != SCALE:
                continue
            if verdict[i]:
                continue
            p, s, total = int(h["partition"]), int(h["seq"]), int(h["total"])
            if self.done[p] or self.got[p, s]:
                continue
            if self.res_got[p] and self.res_total[p] != total:
                continue
            lo, hi = p * PS, min((p + 1) * PS, NUMEL)
            hdr, ent = wire.parse_packet(bytes(b.data[i, :n]))
            if t == PacketType.SPARSE_RESULT:
                idx, val = ent["index"].astype(np.int64), ent["value"].astype(np.int64)
            else:
                idx = hdr.base + np.arange(hdr.count, dtype=np.int64)
                val = ent.astype(np.int64)
            if len(idx) and (idx.min() < lo or idx.max() >= hi):
                continue
            if t == PacketType.DENSE_RESULT:  # a dense run's zero sums are no entries
                idx, val = idx[val != 0], val[val != 0]
            self.entries[(p, s)] = (idx, val)
            self.got[p, s] = 1
            self.res_total[p] = total
            self.res_got[p] += 1
            if self.res_got[p] >= total:
                self.done[p] = 1
                self.completed.append(p)

    def result(self, p: int):
        e = [self.entries[(p, s)] for s in range(int(self.res_total[p]))]
        return np.concatenate([x[0] for x in e]), np.concatenate([x[1] for x in e])


def _engine_for(P: int) -> _engine.RoundEngine:
    eng = _engine.RoundEngine(P, PS, NUMEL, np.full(P, -1, np.int64), JOB, np.zeros(1, np.uint32),
                              np.zeros(1, np.uint16), 256, np.zeros(1, np.int64),
                              np.zeros(len(_net.COUNTERS), np.int64))
    eng.begin(ROUND, SCALE, P)
    return eng


def _traffic(seed: int) -> PacketBatch:
    rng = np.random.default_rng(seed)
    pmap = PartitionMap(NUMEL, PS, 1)
    idx = np.unique(rng.integers(0, pmap.numel, 9000)).astype(np.uint32)
    val = rng.integers(-500, 500, len(idx)).astype(np.int32)
    val[val == 0] = 3
    good = packetize_results(idx, val, pmap, job_id=JOB, round=ROUND, scale_exp=SCALE, mtu=1500)
    # partition 4 as one dense run (its sums are dense), partition 3's packets claiming another total
    dense_idx = np.arange(4 * PS + 10, 4 * PS + 900, dtype=np.uint32)
    dense = packetize_results(dense_idx, np.arange(len(dense_idx), dtype=np.int32) % 5, pmap,
                              job_id=JOB, round=ROUND, scale_exp=SCALE, partitions=[4], mtu=1500)
    parts = [good, dense]
    for kw in ({"job_id": JOB + 1}, {"round": ROUND + 1}, {"scale_exp": SCALE + 1}):
        parts.append(packetize_results(idx[:800], val[:800], pmap, **{
            "job_id": JOB, "round": ROUND, "scale_exp": SCALE, **kw}, mtu=1500))
    parts.append(packetize_status([0, 2, 4], [ROUND, ROUND, ROUND + 1], [[1], [], [0, 3]], job_id=JOB))
    stride = max(p.stride for p in parts)
    rows, lens = [], []
    for p in parts:
        d = np.zeros((len(p), stride), np.uint8)
        d[:, :p.stride] = p.data
        rows.append(d)
        lens.append(p.lengths)
    data, lengths = np.concatenate(rows), np.concatenate(lens)
    hv = data.view(HEADER_DTYPE)[:, 0]
    # copies with indices outside their partition (base moved one partition on) and with a wrong total
    moved = np.flatnonzero((hv["type"] == PacketType.SPARSE_RESULT) & (hv["partition"] < 3))[:6]
    wrong_total = np.flatnonzero((hv["type"] == PacketType.SPARSE_RESULT) & (hv["partition"] == 3))[:2]
    extra = np.concatenate([moved, wrong_total])
    xd = data[extra].copy()
    xh = xd.view(HEADER_DTYPE)[:, 0]
    xh["base"][:len(moved)] = xh["base"][:len(moved)] + PS
    xh["total"][len(moved):] = xh["total"][len(moved):] + 1
    xh["flags"][len(moved):] = 0
    data, lengths = np.concatenate([xd, data]), np.concatenate([lengths[extra], lengths])
    # duplicates (every packet at least twice), then corruption: a random header byte, a payload
    # length, a sender
    dup = np.concatenate([np.arange(len(data)), np.arange(len(data)),
                          rng.integers(0, len(data), len(data) // 3)])
    data, lengths = np.concatenate([data, data[dup]]), np.concatenate([lengths, lengths[dup]])
    n = len(data)
    hit = rng.random(n) < 0.15
    data[hit, rng.integers(0, wire.HDR_LEN, int(hit.sum()))] = rng.integers(0, 256, int(hit.sum()))
    off = rng.random(n) < 0.05
    lengths[off] += rng.integers(-40, 40, int(off.sum()))
    lengths[rng.random(n) < 0.01] = stride + 8  # longer than the receive slot
    lengths = np.maximum(lengths, 0)
    hv = data.view(HEADER_DTYPE)[:, 0]
    hv["worker_id"][rng.random(n) < 0.03] = 1
    order = rng.permutation(n)
    return PacketBatch(np.ascontiguousarray(data[order]), lengths[order].astype(np.int64),
                       np.zeros(n, np.int64))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_compiled_intake_takes_and_decodes_what_the_spec_does(seed):
    b = _traffic(seed)
    P = 5
    spec, eng = Spec(P), _engine_for(P)
    rng = np.random.default_rng(seed + 100)
    cuts = np.unique(np.concatenate([[0, len(b)], rng.integers(0, len(b), 12)]))
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        sub = PacketBatch(np.ascontiguousarray(b.data[lo:hi]), b.lengths[lo:hi], b.dest[lo:hi])
        # the socket path runs the same per-packet code on its receive buffer
        flags = eng.intake(sub.data, sub.lengths, len(sub))
        n0 = len(spec.completed)
        s0 = len(spec.status)
        spec.take(sub)
        assert bool(flags & _engine.COMPLETED) == (len(spec.completed) > n0)
        assert bool(flags & _engine.SIDE) == (len(spec.status) > s0)
        for name in ("got", "done", "res_total", "res_got"):
            assert np.array_equal(getattr(spec, name), getattr(eng, name)), name
    assert eng.n_side == len(spec.status) and [
        bytes(eng.side_data[i, :eng.side_len[i]]) for i in range(eng.n_side)] == spec.status
    assert spec.done.sum() >= 2, "the traffic must complete partitions"
    assert spec.done[4], "the dense partition must complete"
    for p in np.flatnonzero(spec.done).tolist():
        gi, gv = eng.result(p, p + 1)
        wi, wv = spec.result(p)
        assert np.array_equal(gi.astype(np.int64), wi) and np.array_equal(gv.astype(np.int64), wv), p
    st = dict(zip(_engine.STATS, eng.stats.tolist()))
    assert st["malformed"] > 0 and st["duplicate"] > 0 and st["other"] > 0


def test_a_clean_round_completes_every_partition_once_and_returns_every_entry():
    pmap = PartitionMap(NUMEL, PS, 1)
    rng = np.random.default_rng(5)
    idx = np.unique(rng.integers(0, pmap.numel, 20_000)).astype(np.uint32)
    val = rng.integers(1, 1000, len(idx)).astype(np.int32)
    b = packetize_results(idx, val, pmap, job_id=JOB, round=ROUND, scale_exp=SCALE, mtu=3500)
    eng = _engine_for(pmap.num_partitions)
    order = np.random.default_rng(6).permutation(len(b))  # any arrival order
    flags = eng.intake(np.ascontiguousarray(b.data[order]), b.lengths[order], len(b))
    assert flags & _engine.DONE and eng.complete and eng.n_completed == pmap.num_partitions
    ri, rv = eng.result()
    assert np.array_equal(ri, idx) and np.array_equal(rv, val)
    assert eng.intake(b.data, b.lengths, len(b)) & _engine.COMPLETED == 0  # a second copy adds nothing
    assert eng.stats[_engine.STATS.index("duplicate")] == len(b)


def test_result_of_an_incomplete_partition_is_refused():
    eng = _engine_for(2)
    with pytest.raises(ValueError, match="not complete"):
        eng.result(0, 1)
    with pytest.raises(ValueError, match="outside"):
        eng.result(1, 3)


def test_the_dense_output_is_written_partition_by_partition_as_each_completes():
    """dense_output: a partition's result lands in ``out`` when its last packet comes in (the
    previous round's indices there zeroed first, everything else untouched), dequantized as
    host_lib.quantize.dequantize does."""
    from host_lib.quantize import dequantize

    pmap = PartitionMap(NUMEL, PS, 1)
    rng = np.random.default_rng(8)
    idx = np.unique(rng.integers(0, pmap.numel, 30_000)).astype(np.uint32)
    val = rng.integers(-2**30, 2**30, len(idx)).astype(np.int32)
    val[val == 0] = 1
    b = packetize_results(idx, val, pmap, job_id=JOB, round=ROUND, scale_exp=SCALE, mtu=1500)
    prev = np.unique(rng.integers(0, pmap.numel, 20_000)).astype(np.uint32)
    out = np.full(pmap.numel, 7.0, np.float32)
    out[prev] = 3.0
    eng = _engine_for(pmap.num_partitions)
    eng.dense_output(out, prev)
    part = b.headers()["partition"].astype(np.int64)
    first = np.flatnonzero(part == 0)
    eng.intake(b.data[first], b.lengths[first], len(first))  # partition 0 only
    lo1 = PS
    assert (out[lo1:][np.isin(np.arange(lo1, pmap.numel), prev)] == 3.0).all()  # not yet written
    rest = np.flatnonzero(part != 0)
    eng.intake(np.ascontiguousarray(b.data[rest]), b.lengths[rest], len(rest))
    want = np.full(pmap.numel, 7.0, np.float32)
    want[prev] = 0.0
    want[idx] = dequantize(val, SCALE)
    assert eng.complete and np.array_equal(out, want)
    with pytest.raises(ValueError, match="ascending"):
        _engine_for(2).dense_output(np.zeros(NUMEL, np.float32), prev[::-1].copy())
    with pytest.raises(ValueError, match="float32"):
        _engine_for(2).dense_output(np.zeros(NUMEL, np.float64), prev)
