"""dosa.packetizer: vectorized building and parsing agree with dosa.wire, packet by packet."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dosa import wire
from dosa.wire import Flags, PacketType, PartitionMap
from dosa.packetizer import (
    packetize, packetize_dense_result, packetize_partition_result, packetize_results, parse_batch,
    results_to_dense, results_to_sparse,
)

pytestmark = pytest.mark.timeout(120)


def _random_sparse(rng, numel, k):
    idx = np.unique(rng.integers(0, numel, k)).astype(np.uint32)
    val = rng.integers(-(2**31) + 1, 2**31 - 1, len(idx)).astype(np.int32)
    return idx, val


def _check_against_wire(batch, pmap, *, worker_id, ptype=PacketType.SPARSE_DATA):
    """Every packet parses with dosa.wire.parse_packet, obeys the partition rules, and the per
    partition seq/total are complete; returns the concatenated entries."""
    seen = {}
    all_idx, all_val = [], []
    for i in range(len(batch)):
        h, e = wire.parse_packet(batch.packet(i))
        assert h.type == ptype and h.worker_id == worker_id
        lo, hi = pmap.bounds(h.partition)
        assert np.all((e["index"] >= lo) & (e["index"] < hi))
        assert np.all(np.diff(e["index"].astype(np.int64)) > 0)
        if ptype == PacketType.SPARSE_DATA:
            assert batch.dest[i] == pmap.owner(h.partition)
        seen.setdefault(h.partition, []).append((h.seq, h.total, h.count))
        all_idx.append(e["index"].astype(np.uint32))
        all_val.append(e["value"].astype(np.int32))
    for p, lst in seen.items():
        totals = {t for _, t, _ in lst}
        assert len(totals) == 1
        assert sorted(s for s, _, _ in lst) == list(range(totals.pop()))
    return seen, np.concatenate(all_idx), np.concatenate(all_val)


def test_every_partition_gets_a_packet_and_entries_round_trip():
    rng = np.random.default_rng(1)
    pmap = PartitionMap(1_000_000, partition_size=50_000, num_dpus=3)
    idx, val = _random_sparse(rng, 1_000_000, 20_000)
    b = packetize(idx, val, pmap, job_id=7, worker_id=5, round=9, scale_exp=12)
    seen, wi, wv = _check_against_wire(b, pmap, worker_id=5)
    assert sorted(seen) == list(range(pmap.num_partitions))
    np.testing.assert_array_equal(wi, idx)
    np.testing.assert_array_equal(wv, val)
    p = parse_batch(b)
    np.testing.assert_array_equal(p.indices, idx)
    np.testing.assert_array_equal(p.values, val)
    assert p.dropped == 0 and len(p) == len(b)
    assert set(p.headers["round"]) == {9} and set(p.headers["scale_exp"]) == {12}


def test_empty_contribution_is_one_empty_packet_per_partition():
    pmap = PartitionMap(1000, partition_size=100, num_dpus=2)
    b = packetize(np.zeros(0, np.uint32), np.zeros(0, np.int32), pmap, job_id=1, worker_id=0,
                  round=0, scale_exp=0)
    assert len(b) == 10
    for i in range(10):
        h, e = wire.parse_packet(b.packet(i))
        assert (h.partition, h.count, h.total, h.seq, h.flags) == (i, 0, 1, 0, Flags.LAST)
        assert b.dest[i] == i % 2


def test_packet_split_at_240_entries_with_last_flag():
    pmap = PartitionMap(1000, partition_size=1000)
    idx = np.arange(0, 722, 2, dtype=np.uint32)  # 361 entries at half density: sparse is smaller
    b = packetize(idx, idx.astype(np.int32), pmap, job_id=1, worker_id=1, round=0, scale_exp=0,
                  flags=int(Flags.RETRANSMIT))
    hs = [wire.parse_packet(b.packet(i))[0] for i in range(len(b))]
    assert [h.count for h in hs] == [240, 121]
    assert [h.seq for h in hs] == [0, 1] and {h.total for h in hs} == {2}
    assert [h.flags for h in hs] == [Flags.RETRANSMIT, Flags.RETRANSMIT | Flags.LAST]
    assert list(b.lengths) == [32 + 6 * 240, 32 + 6 * 121 + 2]  # an odd count pads the offsets
    big = packetize(np.arange(1000, dtype=np.uint32)[::2], np.ones(500, np.int32), pmap, job_id=1,
                    worker_id=1, round=0, scale_exp=0, mtu=wire.MAX_MTU)
    assert big.headers()["count"].tolist() == [500] and big.stride == wire.stride_for_mtu(wire.MAX_MTU)


def test_partition_subset_only_builds_those():
    pmap = PartitionMap(1000, partition_size=100)
    idx = np.array([105, 110, 350], np.uint32)
    b = packetize(idx, np.array([1, 2, 3], np.int32), pmap, job_id=1, worker_id=0, round=0,
                  scale_exp=0, partitions=[1, 3, 4])
    p = parse_batch(b)
    assert list(p.headers["partition"]) == [1, 3, 4]
    assert list(p.indices) == [105, 110, 350]
    with pytest.raises(ValueError, match="partition 1"):
        packetize(idx, np.array([1, 2, 3], np.int32), pmap, job_id=1, worker_id=0, round=0,
                  scale_exp=0, partitions=[3])


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 5000), psize=st.integers(1, 700), ndpu=st.integers(1, 4),
       density=st.floats(0, 1), seed=st.integers(0, 2**32 - 1),
       mtu=st.sampled_from([wire.MIN_MTU, wire.DEFAULT_MTU, wire.MAX_MTU]))
def test_hypothesis_round_trip_matches_wire(numel, psize, ndpu, density, seed, mtu):
    pmap = PartitionMap(numel, partition_size=psize, num_dpus=ndpu)
    rng = np.random.default_rng(seed)
    mask = rng.random(numel) < density
    idx = np.flatnonzero(mask).astype(np.uint32)
    val = rng.integers(-(2**31), 2**31, len(idx)).astype(np.int32)
    val[val == 0] = 1  # a dense run's zeros are filler: keep every sent value non-zero
    auto = packetize(idx, val, pmap, job_id=3, worker_id=2, round=5, scale_exp=-3, mtu=mtu)
    p = parse_batch(auto)  # whatever the encodings, the non-zero entries are exactly the sent ones
    nz = p.values != 0
    np.testing.assert_array_equal(p.indices[nz], idx)
    np.testing.assert_array_equal(p.values[nz], val)
    sparse_b, dense_b = wire.encoded_bytes(*_counts_spans(idx, pmap), mtu)
    assert auto.lengths.sum() + len(auto) * 42 == np.minimum(sparse_b, dense_b).sum()  # the cheaper one
    b = packetize(idx, val, pmap, job_id=3, worker_id=2, round=5, scale_exp=-3, mtu=mtu, encoding="sparse")
    seen, wi, wv = _check_against_wire(b, pmap, worker_id=2)
    assert len(seen) == pmap.num_partitions
    np.testing.assert_array_equal(wi, idx)
    np.testing.assert_array_equal(wv, val)
    p = parse_batch(b)
    np.testing.assert_array_equal(p.indices, idx)
    np.testing.assert_array_equal(p.values, val)
    for i in range(len(b)):  # per-packet offsets line up with dosa.wire's view of each packet
        _, e = wire.parse_packet(b.packet(i))
        np.testing.assert_array_equal(p.indices[p.offsets[i]:p.offsets[i + 1]], e["index"])


def _counts_spans(idx, pmap):
    part = idx.astype(np.int64) // pmap.partition_size
    counts = np.bincount(part, minlength=pmap.num_partitions)
    first = np.full(pmap.num_partitions, -1)
    last = np.full(pmap.num_partitions, -2)
    np.maximum.at(last, part, idx.astype(np.int64))
    np.minimum.at(first := np.where(counts > 0, 2**40, -1), part, idx.astype(np.int64))
    return counts, np.where(counts > 0, last - first + 1, 0)


def test_partition_result_and_dense_helpers():
    idx = np.array([70_000, 70_001, 99_999], np.uint32)
    sums = np.array([-5, 2**31 - 1, 7], np.int64)
    b = packetize_partition_result(idx, sums, job_id=4, partition=1, round=2, scale_exp=3,
                                   flags=int(Flags.GTOPK), bounds=(65536, 131072))
    h, e = wire.parse_packet(b.packet(0))
    assert h.type == PacketType.SPARSE_RESULT and h.worker_id == wire.DPU_SENDER_ID
    assert h.flags == Flags.GTOPK | Flags.LAST and h.partition == 1
    assert list(e["value"]) == [-5, 2**31 - 1, 7] and b.dest[0] == -1
    d = packetize_dense_result(np.arange(-400, 400), base=1000, job_id=4, partition=0, round=2,
                               scale_exp=1)
    assert len(d) == 3
    p = parse_batch(d)
    np.testing.assert_array_equal(p.indices, np.arange(1000, 1800))
    np.testing.assert_array_equal(p.values, np.arange(-400, 400))
    dense = results_to_dense(p, 2000)
    np.testing.assert_array_equal(dense[1000:1800], np.arange(-400, 400) / 2)
    assert not dense[:1000].any() and not dense[1800:].any()


def test_results_to_dense_and_sparse_rescale_and_dedupe():
    pmap = PartitionMap(10_000, partition_size=1000)
    rng = np.random.default_rng(3)
    idx, val = _random_sparse(rng, 10_000, 3000)
    b = packetize_results(idx, val, pmap, job_id=1, round=0, scale_exp=8)
    # a duplicated result packet must not double any value
    dup = wire.PacketBatch(np.concatenate([b.data, b.data[:2]]), np.concatenate([b.lengths, b.lengths[:2]]),
                           np.concatenate([b.dest, b.dest[:2]]))
    p = parse_batch(dup)
    dense = results_to_dense(p, 10_000)
    expect = np.zeros(10_000, np.float32)
    expect[idx] = (val.astype(np.float64) / 256).astype(np.float32)
    np.testing.assert_array_equal(dense, expect)
    si, sv, s = results_to_sparse(p)
    np.testing.assert_array_equal(si, idx)
    np.testing.assert_array_equal(sv, val)
    assert s == 8


def test_results_helpers_reject_data_packets():
    pmap = PartitionMap(100)
    p = parse_batch(packetize([1], [1], pmap, job_id=1, worker_id=0, round=0, scale_exp=0))
    with pytest.raises(ValueError, match="not a result packet"):
        results_to_dense(p, 100)


def test_parse_mixed_types_and_drop_mode_counts_malformed():
    pkts = [
        wire.build_packet(wire.Header(type=PacketType.SPARSE_DATA, flags=Flags.LAST),
                          np.array([[3, -4], [9, 5]])),
        wire.build_packet(wire.Header(type=PacketType.RETX_REQUEST), np.array([2, 7])),
        wire.build_packet(wire.Header(type=PacketType.HEARTBEAT)),
        b"\x00" * 20,
        wire.build_packet(wire.Header(type=PacketType.DENSE_DATA, base=50, flags=Flags.LAST),
                          np.array([1, -1, 2])),
    ]
    b = wire.PacketBatch.from_packets(pkts)
    with pytest.raises(wire.TruncatedPacket, match="^packet 3:"):
        parse_batch(b)
    p = parse_batch(b, on_error="drop")
    assert p.dropped == 1 and list(p.kept) == [0, 1, 2, 4]
    assert list(p.indices) == [3, 9, 2, 7, 50, 51, 52]
    assert list(p.values) == [-4, 5, 0, 0, 1, -1, 2]
    assert list(p.offsets) == [0, 2, 4, 4, 7]


def test_parse_empty_batch():
    p = parse_batch(wire.PacketBatch.empty(0))
    assert len(p) == 0 and len(p.indices) == 0 and list(p.offsets) == [0]
    assert results_to_sparse(p)[2] is None


@settings(max_examples=150, deadline=None)
@given(byte=st.integers(0, 31), value=st.integers(0, 255), length_delta=st.integers(-3, 3),
       ptype=st.sampled_from(list(PacketType)))
def test_vectorized_validation_agrees_with_wire(byte, value, length_delta, ptype):
    """Corrupt one header byte and/or the length: parse_batch rejects exactly what dosa.wire
    rejects, with the same exception class."""
    sparse = ptype in (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT)
    n_entries = {PacketType.HEARTBEAT: None}.get(ptype, np.array([[1, 2], [3, 4]]) if sparse
                                                 else np.array([1, 2]))
    raw = bytearray(wire.build_packet(wire.Header(type=ptype, flags=Flags.LAST), n_entries))
    raw[byte] = value
    raw = bytes(raw[: max(0, len(raw) + length_delta)]) if length_delta < 0 else bytes(raw) + b"\0" * length_delta
    good = bytes(wire.build_packet(wire.Header(flags=Flags.LAST)))
    b = wire.PacketBatch.from_packets([good, raw])
    try:
        wire.parse_packet(raw)
        expected = None
    except wire.ProtocolError as e:
        expected = type(e)
    if expected is None:
        p = parse_batch(b)
        assert p.dropped == 0
        h, e = wire.parse_packet(raw)
        got_i = p.indices[p.offsets[1]:p.offsets[2]]
        got_v = p.values[p.offsets[1]:p.offsets[2]]
        if e.dtype.names:  # sparse
            np.testing.assert_array_equal(got_i, e["index"])
            np.testing.assert_array_equal(got_v, e["value"])
        elif h.type in (PacketType.DENSE_DATA, PacketType.DENSE_RESULT):
            np.testing.assert_array_equal(got_i, h.base + np.arange(h.count))
            np.testing.assert_array_equal(got_v, e)
        else:  # RETX_REQUEST / STATUS: u32 entries in indices; HEARTBEAT: none
            np.testing.assert_array_equal(got_i, e.astype(np.uint32) if h.count else [])
    else:
        with pytest.raises(expected, match="^packet 1:"):
            parse_batch(b)
        assert parse_batch(b, on_error="drop").dropped == 1


def test_status_packets_parse_back():
    from dosa.packetizer import packetize_status

    b = packetize_status([3, 0, 7], [5, 5, 6], [[1, 2], [], [63]], job_id=9)
    p = parse_batch(b)
    assert list(p.headers["type"]) == [PacketType.STATUS] * 3
    assert list(p.headers["partition"]) == [3, 0, 7] and list(p.headers["round"]) == [5, 5, 6]
    assert [p.indices[p.offsets[i]:p.offsets[i + 1]].tolist() for i in range(3)] == [[1, 2], [], [63]]
    for i in range(3):
        wire.parse_packet(b.packet(i))  # and dosa.wire agrees
