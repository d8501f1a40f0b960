"""Touched lists through BPF_PROG_TEST_RUN: every merged sparse packet copies its offset block into
its buffer's list (whole 4-offset words, reserved with one fetch-add), so the DPU worker reads the
listed sums instead of scanning the buffer. The list names every touched entry (and may name more:
the same entry once per packet, the bytes after a packet's offsets in its last word), the worker's
extraction from it equals the scan, an overflowing list keeps counting without writing past its
capacity, dense blocks and offsets not counted from the partition's start overflow it, advance()
resets the count; and the index check pass 1 skips for a full-width partition at base == lo loses
nothing."""
from __future__ import annotations

import numpy as np
import pytest

from dataplane.reasons import Counter
from dataplane_harness import XDP_DROP, Harness
from dosa import wire
from dpu_fw._results import extract_py

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]


def listed(h, j, p, rnd):
    """(the list's first count offsets as an array, count) of (p, rnd)'s buffer."""
    lst, count = h.maps.touched(j.job_id, p, rnd, job=j)
    assert len(lst) == j.list_cap
    return lst[:min(count, j.list_cap)].copy(), count


def positive(rng, j, p, density):
    """Sorted unique indices of partition p and values >= 1: sums of them never cancel."""
    lo, hi = j.bounds(p)
    idx = np.sort(rng.choice(np.arange(lo, hi), rng.binomial(hi - lo, density), replace=False))
    return idx, rng.integers(1, 1000, len(idx))


def sparse_frame(j, worker, p, rnd, base, idx, val, seq=0, total=1):
    hd = wire.Header(type=wire.PacketType.SPARSE_DATA, job_id=j.job_id, worker_id=worker,
                     partition=p, round=rnd, seq=seq, total=total, base=base,
                     flags=int(wire.Flags.LAST) if seq == total - 1 else 0)
    ent = np.stack([np.asarray(idx, np.int64), np.asarray(val, np.int64)], axis=1)
    return Harness.frame(wire.build_packet(hd, ent), worker)


def words(n: int) -> int:
    """List positions a packet of n entries reserves: whole 4-offset words."""
    return 4 * (-(-n // 4))


def extraction_equals_the_scan(h, j, p, rnd):
    buf = np.ascontiguousarray(h.maps.buffer(j.job_id, p, rnd))
    lo = j.bounds(p)[0]
    got = extract_py(buf, *h.maps.touched(j.job_id, p, rnd, job=j), lo)
    nz = np.flatnonzero(buf)
    return np.array_equal(got[0], lo + nz) and np.array_equal(got[1], buf[nz])


def test_the_list_names_every_touched_entry_and_extracts_like_the_scan(h):
    rng = np.random.default_rng(11)
    j = h.job(workers=3, numel=1800, partition_size=512)
    assert j.list_cap == 128
    touched, reserved = {}, {}
    for p in j.owned_partitions():
        lo, hi = j.bounds(p)
        ref = np.zeros(hi - lo, np.int64)
        reserved[int(p)] = 0
        for w in range(j.workers):
            idx, val = positive(rng, j, int(p), 0.04)
            np.add.at(ref, idx - lo, val)
            frames = h.data(j, w, int(p), 0, idx, val, per_packet=20)
            h.run_all(frames)
            reserved[int(p)] += sum(words(len(c)) for c in np.array_split(idx, len(frames))) \
                if len(idx) else 0
        touched[int(p)] = set(np.flatnonzero(ref).tolist())
        assert np.array_equal(h.maps.buffer(j.job_id, int(p), 0), ref)
    assert h.counters()[Counter.MERGED] > 0 and h.counters()[Counter.INDEX_OUT_OF_PARTITION] == 0
    for p, want in touched.items():
        lst, count = listed(h, j, p, 0)
        assert count == reserved[p] <= j.list_cap and set(lst.tolist()) >= want, p
        assert extraction_equals_the_scan(h, j, p, 0), p
        assert listed(h, j, p, 1)[1] == 0  # the slot's other parity has touched nothing


def test_a_packet_lists_its_offsets_in_whole_words(h):
    """6 offsets take two words: the last two positions of the second hold the bytes that follow
    the offsets in the packet (here the first value), extra names the reader drops (out of the
    partition, or a zero sum) or that name a non-zero sum anyway."""
    j = h.job(workers=1, numel=256, partition_size=256)
    frame = sparse_frame(j, 0, 0, 0, 0, [3, 5, 9, 17, 100, 200], [1, 7, 2, 3, 4, -4])
    assert h.run(frame) == XDP_DROP and h.counters()[Counter.MERGED] == 1
    lst, count = listed(h, j, 0, 0)
    assert count == 8 and lst[:6].tolist() == [3, 5, 9, 17, 100, 200]
    assert extraction_equals_the_scan(h, j, 0, 0)
    idx, sums = extract_py(np.ascontiguousarray(h.maps.buffer(j.job_id, 0, 0)), lst, count, 0)
    assert idx.tolist() == [3, 5, 9, 17, 100, 200] and sums.tolist() == [1, 7, 2, 3, 4, -4]


def test_dense_blocks_and_offsets_from_another_base_overflow_the_list(h):
    j = h.job(workers=2, numel=512, partition_size=512)
    vals = np.zeros(40, np.int64)
    vals[[0, 7, 8, 39]] = [1, -2, 3, 2**31 - 1]
    hd = wire.Header(type=wire.PacketType.DENSE_DATA, job_id=j.job_id, partition=0, total=1,
                     flags=int(wire.Flags.LAST), base=100)
    assert h.run(Harness.frame(wire.build_packet(hd, vals))) == XDP_DROP
    assert h.counters()[Counter.MERGED] == 1
    assert listed(h, j, 0, 0)[1] > j.list_cap  # the worker scans this buffer
    assert extraction_equals_the_scan(h, j, 0, 0)
    # worker 1's offsets count from 50, not from the partition's first index: overflow too
    k = h.job(workers=1, numel=512, partition_size=512)
    assert h.run(sparse_frame(k, 0, 0, 0, 50, [60, 70], [1, 2])) == XDP_DROP
    assert listed(h, k, 0, 0)[1] > k.list_cap and extraction_equals_the_scan(h, k, 0, 0)


def test_a_sum_that_cancels_to_zero_is_listed_and_not_extracted(h):
    j = h.job(workers=3, numel=256, partition_size=256)
    frames = [sparse_frame(j, 0, 0, 0, 0, [3, 10], [5, 6]), sparse_frame(j, 1, 0, 0, 0, [3, 10], [-5, -6]),
              sparse_frame(j, 2, 0, 0, 0, [3], [7])]
    assert h.run_all(frames) == [XDP_DROP] * 3
    assert [(c.partition, c.round) for c in h.maps.poll_completions(0)] == [(0, 0)]
    lst, count = listed(h, j, 0, 0)
    assert count == 12 and {3, 10} <= set(lst.tolist())
    buf = h.maps.buffer(j.job_id, 0, 0)
    assert buf[3] == 7 and buf[10] == 0 and np.count_nonzero(buf) == 1
    idx, sums = extract_py(np.ascontiguousarray(buf), lst, count, 0)
    assert idx.tolist() == [3] and sums.tolist() == [7]


def test_an_overflowing_list_keeps_counting_and_writes_nothing_past_its_capacity(h):
    rng = np.random.default_rng(12)
    j = h.job(workers=2, numel=2 * 256, partition_size=256, list_cap=8)
    before = h.maps.pool.copy()
    ref = np.zeros(256, np.int64)
    first = None
    for w in range(2):
        idx, val = positive(rng, j, 0, 0.2)
        first = idx[:6] if first is None else first
        np.add.at(ref, idx, val)
        h.run_all(h.data(j, w, 0, 0, idx, val, per_packet=6))
    lst, count = listed(h, j, 0, 0)
    assert count > 8 and len(lst) == 8
    assert lst[:6].tolist() == first.tolist()  # the first packet's reservation fit; the next did not
    b = j.pool_off  # partition 0, round 0: slot 0, parity 0
    changed = np.flatnonzero(h.maps.pool["sums"] != before["sums"])
    assert set(changed.tolist()) <= set(range(b * 65536, b * 65536 + 256))  # its sums only
    changed = np.flatnonzero(h.maps.pool["list"].view(np.uint16) != before["list"].view(np.uint16))
    assert set(changed.tolist()) <= set(range(b * 16384, b * 16384 + 8))  # its 8 list positions only
    # an overflowed list is not read: the extraction scans the buffer and gives the same result
    assert extraction_equals_the_scan(h, j, 0, 0)


def test_advance_resets_the_cleared_parity_s_count(h):
    """One partition (its own slot): occupants are rounds. Completing round 1 releases round 0:
    advance() zeroes round 0's count with the rest of its parity; round 2 then lists afresh."""
    rng = np.random.default_rng(13)
    j = h.job(workers=1, numel=256, partition_size=256)
    sets = {}

    def count_of(parity):
        return int(h.maps.pstate["touched"][j.pstate_off, parity])

    for rnd in range(3):
        idx, val = positive(rng, j, 0, 0.1)
        frames = h.data(j, 0, 0, rnd, idx, val)
        h.run_all(frames)
        assert [(c.partition, c.round) for c in h.maps.poll_completions(0)] == [(0, rnd)]
        sets[rnd] = set((idx - j.bounds(0)[0]).tolist())
        lst, count = listed(h, j, 0, rnd)
        assert count == words(len(idx)) and set(lst.tolist()) >= sets[rnd], rnd
        assert extraction_equals_the_scan(h, j, 0, rnd)
        if rnd == 1:
            assert count_of(0) == words(len(sets[0]))  # round 0 is the shadow copy still
        h.maps.advance(j.job_id, 0, rnd, nonzero=np.array(sorted(sets[rnd - 1])) if rnd else None)
        if rnd >= 1:  # the previous round's parity was cleared, count included
            assert count_of((rnd - 1) & 1) == 0
            assert not h.maps.buffer(j.job_id, 0, rnd - 1).any()
            assert count_of(rnd & 1) == words(len(sets[rnd]))


def test_a_job_without_lists_keeps_none(h):
    j = h.job(workers=1, numel=256, partition_size=256, list_cap=0)
    assert j.list_cap == 0 and j.stride == 256
    h.run(sparse_frame(j, 0, 0, 0, 0, [1, 2], [3, 4]))
    assert h.maps.touched(j.job_id, 0, 0) is None
    assert int(h.maps.pstate[j.pstate_off]["touched"][0]) == 0
    assert h.maps.buffer(j.job_id, 0, 0)[1:3].tolist() == [3, 4]


def test_full_width_partition_at_base_lo_skips_the_index_pass_and_loses_nothing(h):
    """Partition 1 of a 65536-entry partitioning at base == lo: every u16 offset is inside, the
    index pass is skipped, and offsets 0 and 65535 land; a base above lo that pushes an offset past
    the partition, a base below lo with an index under it, and an index past a short last
    partition are still rejected."""
    P = 65536
    j = h.job(workers=1, numel=2 * P + 100, partition_size=P)
    lo = P
    idx = np.array([lo, lo + 1, lo + 4097, lo + P - 1])
    val = np.array([1, -2, 3, 4])
    assert h.run(sparse_frame(j, 0, 1, 0, lo, idx, val)) == XDP_DROP
    c = h.counters()
    assert c[Counter.MERGED] == 1 and c[Counter.INDEX_OUT_OF_PARTITION] == 0
    buf = h.maps.buffer(j.job_id, 1, 0)
    assert buf[idx - lo].tolist() == val.tolist() and np.count_nonzero(buf) == 4
    lst, count = listed(h, j, 1, 0)
    assert count == 4 and lst.tolist() == (idx - lo).tolist()

    bad = [sparse_frame(j, 0, 1, 0, lo + 10, [lo + 10, lo + 10 + P - 1], [1, 1]),  # past hi
           sparse_frame(j, 0, 1, 0, lo - 5, [lo - 5, lo + 3], [1, 1]),  # under lo
           sparse_frame(j, 0, 2, 0, 2 * P, [2 * P, 2 * P + 100], [1, 1])]  # past the short partition
    before = h.counters()
    assert h.run_all(bad) == [XDP_DROP] * 3
    d = h.counters() - before
    assert d[Counter.INDEX_OUT_OF_PARTITION] == 3 and d[Counter.MERGED] == 0
    assert np.count_nonzero(h.maps.buffer(j.job_id, 1, 0)) == 4 and listed(h, j, 1, 0)[1] == 4
    assert not h.maps.buffer(j.job_id, 2, 0).any() and listed(h, j, 2, 0)[1] == 0
    # the short partition still merges what lies inside it
    assert h.run(sparse_frame(j, 0, 2, 0, 2 * P, [2 * P, 2 * P + 99], [5, 6])) == XDP_DROP
    assert h.maps.buffer(j.job_id, 2, 0)[[0, 99]].tolist() == [5, 6]
