"""Merging through BPF_PROG_TEST_RUN: sums equal np.add.at exactly, duplicates are never added twice,
a completion is emitted once and only when every worker's contribution is in, rounds alternate
buffers and advance, and two jobs never see each other's data."""
from __future__ import annotations

import numpy as np
import pytest

from dataplane.maps import Completion
from dataplane.reasons import Counter
from dataplane_harness import XDP_DROP, XDP_PASS, random_contribution
from dosa import wire

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]


def contributions(h, rng, j, round_, scale=0, per_packet=wire.MAX_SPARSE_ENTRIES, density=0.5):
    """{partition: [frames]} for every worker, and the dense reference sums per partition."""
    frames, ref = {}, {}
    for p in j.owned_partitions():
        lo, hi = j.bounds(p)
        ref[p] = np.zeros(hi - lo, np.int64)
        frames[p] = []
        for w in range(j.workers):
            idx, val = random_contribution(rng, j, p, density)
            np.add.at(ref[p], idx - lo, val)
            frames[p] += h.data(j, w, p, round_, idx, val, scale, per_packet)
    return frames, ref


def test_shuffled_duplicated_packets_merge_exactly_and_complete_once(h):
    rng = np.random.default_rng(1)
    j = h.job(workers=3, numel=2000, partition_size=512)
    frames, ref = contributions(h, rng, j, 0, scale=5, per_packet=40)
    allf = [f for p in frames for f in frames[p]]
    dups = [allf[i] for i in rng.choice(len(allf), size=len(allf) // 3)]
    both = allf + dups
    actions = h.run_all([both[i] for i in rng.permutation(len(both))])  # (not np: 'S' strips NULs)
    assert set(actions) <= {XDP_DROP, XDP_PASS}
    for p in frames:
        assert np.array_equal(h.maps.buffer(j.job_id, p, 0), ref[p]), f"partition {p}"
        assert not h.maps.buffer(j.job_id, p, 1).any()
    comps = h.maps.poll_completions(0)
    assert sorted(comps, key=lambda c: c.partition) == [Completion(j.job_id, int(p), 0, 5) for p in frames]
    c = h.counters()
    assert c[Counter.MERGED] == len(allf)
    assert c[Counter.DUPLICATE] + c[Counter.PASS_DUP_OF_COMPLETE] == len(dups)
    assert c[Counter.COMPLETIONS] == len(frames)


def test_completion_only_after_the_last_packet_of_the_last_worker(h):
    rng = np.random.default_rng(2)
    j = h.job(workers=2, numel=600, partition_size=600)
    frames, _ = contributions(h, rng, j, 0, per_packet=30)
    f = frames[0]
    for frame in f[:-1]:
        h.run(frame)
        assert h.maps.poll_completions(0) == []
    assert not h.maps.is_complete(j.job_id, 0, 0)
    h.run(f[-1])
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 0, 0)]
    assert h.maps.is_complete(j.job_id, 0, 0)
    h.run_all(f)  # every copy again: passed to user space, never a second completion
    assert h.maps.poll_completions(0) == []
    assert h.counters()[Counter.PASS_DUP_OF_COMPLETE] == len(f)


def test_empty_contributions_complete_a_partition(h):
    j = h.job(workers=2, numel=100, partition_size=100)
    h.run_all(h.data(j, 0, 0, 0, [], []) + h.data(j, 1, 0, 0, [], []))
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 0, 0)]
    assert not h.maps.buffer(j.job_id, 0, 0).any()


def test_rounds_alternate_buffers_and_advance_clears_the_old_parity(h):
    rng = np.random.default_rng(3)
    j = h.job(workers=2, numel=300, partition_size=300)
    f0, ref0 = contributions(h, rng, j, 0)
    h.run_all(f0[0])
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 0, 0)]
    assert not h.maps.advance(j.job_id, 0, 0)  # round 0 completing moves nothing
    f1, ref1 = contributions(h, rng, j, 1)
    h.run_all(f1[0])
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 1, 0)]
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 0), ref0[0])  # shadow copy still there
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 1), ref1[0])
    assert h.maps.advance(j.job_id, 0, 1)
    assert not h.maps.advance(j.job_id, 0, 1)  # idempotent
    assert not h.maps.buffer(j.job_id, 0, 0).any()
    st = h.maps.round_state(j.job_id, 0)
    assert st.base_round == 1 and st.workers_done == (0, 2) and st.scale_exp == (None, 0)
    before = h.counters()
    h.run(f0[0][0])
    assert (h.counters() - before)[Counter.ROUND_TOO_OLD] == 1
    f2, ref2 = contributions(h, rng, j, 2)  # same parity as round 0: a clean buffer
    h.run_all(f2[0])
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 2, 0)]
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 2), ref2[0])


def test_two_jobs_are_isolated(h):
    rng = np.random.default_rng(4)
    a = h.job(workers=2, numel=1000, partition_size=250)
    b = h.job(workers=2, numel=1000, partition_size=250)
    fa, ra = contributions(h, rng, a, 0)
    fb, rb = contributions(h, rng, b, 0)
    mixed = [f for p in fa for f in fa[p]] + [f for p in fb for f in fb[p]]
    h.run_all([mixed[i] for i in rng.permutation(len(mixed))])
    for p in fa:
        assert np.array_equal(h.maps.buffer(a.job_id, p, 0), ra[p])
        assert np.array_equal(h.maps.buffer(b.job_id, p, 0), rb[p])
    comps = h.maps.poll_completions(0)
    assert sorted((c.job_id, c.partition) for c in comps) == sorted(
        [(a.job_id, int(p)) for p in fa] + [(b.job_id, int(p)) for p in fb])


def test_only_owned_partitions_are_merged_on_a_two_dpu_job(h):
    rng = np.random.default_rng(5)
    j = h.job(workers=2, numel=1000, partition_size=200, num_dpus=2, dpu_index=1)
    assert list(j.owned_partitions()) == [1, 3]
    frames, ref = contributions(h, rng, j, 0)
    h.run_all([f for p in frames for f in frames[p]])
    for p in (1, 3):
        assert np.array_equal(h.maps.buffer(j.job_id, p, 0), ref[p])


def test_sums_past_the_s32_range_saturate_and_are_counted(h):
    """Hosts keep values within the clip bound, so no sum leaves s32; a host that does not gets its
    sums held at +-(2^31 - 1) (the slow path, xdp_dosa_saturate), never wrapped, and counted."""
    j = h.job(workers=2, numel=10, partition_size=10)
    big = 2**31 - 1
    h.run_all(h.data(j, 0, 0, 0, [0, 1, 2], [big, -2**31, 5]) + h.data(j, 1, 0, 0, [0, 1, 2], [big, -2**31, 6]))
    assert list(h.maps.buffer(j.job_id, 0, 0)[:3]) == [big, -big, 11]
    assert h.counters()[Counter.SATURATED_SUMS] == 3  # -2^31 alone is past the bound, then twice
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 0, 0)]


def test_dense_blocks_and_sparse_entries_mix_in_one_contribution(h):
    """A worker may send a partition as dense blocks, sparse chunks or both: the sums are exact and
    the partition completes when every worker's total is in."""
    rng = np.random.default_rng(6)
    j = h.job(workers=2, numel=1000, partition_size=1000)
    ref = np.zeros(1000, np.int64)
    frames = []
    for w in range(2):
        dense_vals = rng.integers(-2**30, 2**30, 700)  # [0, 700) in two dense blocks
        np.add.at(ref, np.arange(700), dense_vals)
        idx = np.sort(rng.choice(np.arange(700, 1000), 150, replace=False))
        val = rng.integers(-1000, 1000, 150)
        np.add.at(ref, idx, val)
        for seq, (b, e) in enumerate([(0, 360), (360, 700)]):
            hd = wire.Header(type=wire.PacketType.DENSE_DATA, job_id=j.job_id, worker_id=w, seq=seq,
                             total=3, base=b)
            frames.append(h.frame(wire.build_packet(hd, dense_vals[b:e]), w))
        hs = wire.Header(job_id=j.job_id, worker_id=w, seq=2, total=3, flags=int(wire.Flags.LAST))
        frames.append(h.frame(wire.build_packet(hs, np.stack([idx, val], 1)), w))
    order = rng.permutation(len(frames))
    h.run_all([frames[i] for i in order[:-1]])
    assert h.maps.poll_completions(0) == []
    h.run(frames[order[-1]])
    assert h.maps.poll_completions(0) == [Completion(j.job_id, 0, 0, 0)]
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 0), ref)
    assert h.counters()[Counter.MERGED_ENTRIES] == 2 * (700 + 150)


def test_rounds_stay_exact_while_late_duplicates_race_advance(h):
    """A background thread replays the previous round's packets (late duplicates) through the
    program, on the other CPU, while rounds complete and advance() clears parities: every round's
    sums stay exact and each completes exactly once (the re-check of base_round after the claim
    drops a stale packet that slipped past the window check)."""
    import threading

    rng = np.random.default_rng(8)
    j = h.job(workers=2, numel=256, partition_size=256)
    stop = threading.Event()
    stale: list[bytes] = []

    def replay():
        while not stop.is_set():
            for f in list(stale):
                h.run(f)

    t = threading.Thread(target=replay)
    t.start()
    try:
        for r in range(40):
            frames, ref = contributions(h, rng, j, r, per_packet=20)
            h.run_all(frames[0])
            comps = h.maps.poll_completions(0)
            assert comps == [Completion(j.job_id, 0, r, 0)], (r, comps)
            assert np.array_equal(h.maps.buffer(j.job_id, 0, r), ref[0]), r
            h.maps.advance(j.job_id, 0, r)
            stale[:] = frames[0]  # from now on round r's packets are late copies
    finally:
        stop.set()
        t.join()
    c = h.counters()
    assert c[Counter.COMPLETIONS] == 40 and c[Counter.INTERNAL] == 0


def test_largest_mtu_packets_merge_every_entry(h):
    """Full packets of the largest MTU (573 sparse entries, 860 dense values, 3514-byte frames) run
    the XDP loops to their bounds: every entry lands, nothing past count is read."""
    mtu = wire.MAX_MTU
    j = h.job(workers=1, numel=200000, partition_size=65536)
    rng = np.random.default_rng(7)
    idx = np.sort(rng.choice(np.arange(65536, 131072), wire.RX_MAX_SPARSE_ENTRIES, replace=False))
    val = rng.integers(-2**31, 2**31 - 1, len(idx))
    dense_vals = rng.integers(-1000, 1000, wire.RX_MAX_DENSE_ENTRIES)
    frames = h.data(j, 0, 1, 0, idx, val, per_packet=wire.RX_MAX_SPARSE_ENTRIES)
    hd = wire.Header(type=wire.PacketType.DENSE_DATA, job_id=j.job_id, partition=0, total=1,
                     flags=int(wire.Flags.LAST), base=1000)
    frames.append(h.frame(wire.build_packet(hd, dense_vals)))
    assert [len(f) for f in frames] == [mtu + 14, mtu + 14]  # Ethernet + a full IPv4 packet
    assert h.run_all(frames) == [XDP_DROP, XDP_DROP]
    ref = np.zeros(65536, np.int64)
    ref[idx - 65536] = val
    assert np.array_equal(h.maps.buffer(j.job_id, 1, 0), ref)
    ref0 = np.zeros(65536, np.int64)
    ref0[1000:1000 + len(dense_vals)] = dense_vals
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 0), ref0)
    assert h.counters()[Counter.MERGED] == 2


@pytest.mark.parametrize("mtu", [wire.MIN_MTU, wire.DEFAULT_MTU, wire.MAX_MTU])
def test_packetizer_rounds_merge_exactly_at_every_mtu(h, mtu):
    """dosa.packetizer's packets (sparse partitions and a dense run) through the program."""
    from dosa.packetizer import packetize

    j = h.job(workers=2, numel=150000, partition_size=65536)
    pm = wire.PartitionMap(j.numel, j.partition_size)
    rng = np.random.default_rng(mtu)
    ref = np.zeros(j.numel, np.int64)
    frames = []
    for w in range(2):
        idx = np.unique(np.r_[rng.choice(131072, 3000, replace=False), np.arange(131072 + 10, 131072 + 9000)])
        val = rng.integers(-10**6, 10**6, len(idx)).astype(np.int32)
        np.add.at(ref, idx, val)
        b = packetize(idx.astype(np.uint32), val, pm, job_id=j.job_id, worker_id=w, round=0,
                      scale_exp=0, mtu=mtu)
        types = set(b.headers()["type"].tolist())
        assert types == {wire.PacketType.SPARSE_DATA, wire.PacketType.DENSE_DATA}  # the run went dense
        frames += [h.frame(b.packet(i), w) for i in range(len(b))]
    assert max(len(f) for f in frames) <= mtu + 14
    assert set(h.run_all(frames)) == {XDP_DROP}
    assert h.counters()[Counter.MERGED] == len(frames)
    for p in range(pm.num_partitions):
        lo, hi = pm.bounds(p)
        assert np.array_equal(h.maps.buffer(j.job_id, p, 0)[:hi - lo], ref[lo:hi]), p
    assert len(h.maps.poll_completions(0)) == pm.num_partitions
