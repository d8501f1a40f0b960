"""The hosts' compiled result intake (host_lib/_round.pyx ``absorb``, what Round._absorb runs on
every received batch) against its specification written out packet by packet in Python with the
wire's own rules (``wire.header_verdicts``): the same packets taken, in the same order, the same
state, on batches of valid results mixed with corrupted headers, wrong lengths, other jobs, rounds,
senders and scales, duplicates and STATUS packets."""
from __future__ import annotations

import numpy as np
import pytest

from dosa import wire
from dosa.packetizer import packetize_results, packetize_status
from dosa.wire import HEADER_DTYPE, PacketBatch, PacketType, PartitionMap
from host_lib import _round

pytestmark = pytest.mark.timeout(60)

JOB, ROUND, SCALE = 9, 3, 10
K = wire.MAX_PACKETS_PER_CONTRIBUTION


class State:
    def __init__(self, P: int):
        self.P = P
        self.got = np.zeros((P, K), np.uint8)
        self.done = np.zeros(P, np.uint8)
        self.res_total = np.zeros(P, np.int64)
        self.res_got = np.zeros(P, np.int64)


def spec_absorb(st: State, b: PacketBatch):
    """absorb's docstring, one packet at a time."""
    rows, keys, status, completed = [], [], [], []
    hv = b.data.view(HEADER_DTYPE)[:, 0]
    verdict = wire.header_verdicts(hv, b.lengths)
    for i in range(len(b)):
        h = hv[i]
        if b.lengths[i] < wire.HDR_LEN or b.lengths[i] > b.stride:
            continue
        if int(h["job_id"]) != JOB or int(h["round"]) != ROUND or int(h["partition"]) >= st.P \
                or int(h["worker_id"]) != wire.DPU_SENDER_ID:
            continue
        t = int(h["type"])
        if t == PacketType.STATUS:
            status.append(i)
            continue
        if t not in (PacketType.SPARSE_RESULT, PacketType.DENSE_RESULT) or int(h["scale_exp"]) != SCALE:
            continue
        if verdict[i]:
            continue
        p, s = int(h["partition"]), int(h["seq"])
        if st.done[p] or st.got[p, s]:
            continue
        st.got[p, s] = 1
        st.res_total[p] = int(h["total"])
        st.res_got[p] += 1
        rows.append(i)
        keys.append(p * K + s)
        if st.res_got[p] >= st.res_total[p]:
            st.done[p] = 1
            completed.append(p)
    return rows, keys, status, completed


def compiled_absorb(st: State, b: PacketBatch):
    n = len(b)
    out = np.full((4, n), -7, np.int64)
    nn, ns, nc = _round.absorb(b.data, b.lengths, n, JOB, ROUND, st.P, SCALE, st.got, st.done,
                               st.res_total, st.res_got, out[0], out[1], out[2], out[3])
    return out[0, :nn].tolist(), out[1, :nn].tolist(), out[2, :ns].tolist(), out[3, :nc].tolist()


def _traffic(seed: int) -> PacketBatch:
    rng = np.random.default_rng(seed)
    pmap = PartitionMap(5 * 65536 - 1000, 65536, 1)
    idx = np.unique(rng.integers(0, pmap.numel, 9000)).astype(np.uint32)
    val = rng.integers(-500, 500, len(idx)).astype(np.int32)
    val[val == 0] = 3
    good = packetize_results(idx, val, pmap, job_id=JOB, round=ROUND, scale_exp=SCALE, mtu=1500)
    parts = [good]
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
    # duplicates, then corruption: a random header byte, a payload length, a sender
    dup = np.concatenate([np.arange(len(data)), rng.integers(0, len(data), len(data) // 3)])
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
def test_compiled_intake_takes_what_the_spec_takes(seed):
    b = _traffic(seed)
    P = 5
    a, c = State(P), State(P)
    rng = np.random.default_rng(seed + 100)
    cuts = np.unique(np.concatenate([[0, len(b)], rng.integers(0, len(b), 12)]))
    taken = 0
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        sub = PacketBatch(b.data[lo:hi], b.lengths[lo:hi], b.dest[lo:hi])
        want, got = spec_absorb(a, sub), compiled_absorb(c, sub)
        assert got == want
        taken += len(want[0])
        for name in ("got", "done", "res_total", "res_got"):
            assert np.array_equal(getattr(a, name), getattr(c, name)), name
    assert taken > 20 and a.done.sum() >= 1, "the traffic must complete partitions"


def test_a_clean_round_completes_every_partition_once():
    pmap = PartitionMap(300_000, 65536, 1)
    rng = np.random.default_rng(5)
    idx = np.unique(rng.integers(0, pmap.numel, 20_000)).astype(np.uint32)
    b = packetize_results(idx, np.ones(len(idx), np.int32), pmap, job_id=JOB, round=ROUND,
                          scale_exp=SCALE, mtu=3500)
    st = State(pmap.num_partitions)
    rows, keys, status, completed = compiled_absorb(st, b)
    assert rows == list(range(len(b))) and status == []
    assert sorted(completed) == list(range(pmap.num_partitions)) and st.done.all()
    assert compiled_absorb(st, b) == ([], [], [], [])  # a second copy adds nothing


def test_short_outputs_are_refused():
    st = State(2)
    b = PacketBatch.empty(4)
    small = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="shorter than the batch"):
        _round.absorb(b.data, b.lengths, 4, JOB, ROUND, 2, SCALE, st.got, st.done, st.res_total,
                      st.res_got, small, small, small, small)
