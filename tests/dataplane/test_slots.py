"""Aggregation slots through BPF_PROG_TEST_RUN: a job holds ``slots`` slot buffers, not one per
partition; partition j of a DPU aggregates in slot j % slots as the slot's occupant number
g = round * n_s + j // slots. A slot's next occupant merges while the previous one is the shadow
copy; a late packet of an occupant the slot moved past is dropped (round_too_old), one of an
occupant two ahead (its slot still held) too (round_too_new); every round stays exact."""
from __future__ import annotations

import numpy as np
import pytest

from dataplane.maps import JobInfo
from dataplane.reasons import Counter
from dataplane_harness import XDP_DROP, XDP_PASS, random_contribution
from dosa.errors import DosaError

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]


def contribution(h, rng, j, p, rnd, density=0.4):
    """Every worker's frames of (p, rnd) and the exact sums of the partition."""
    lo, hi = j.bounds(p)
    ref = np.zeros(hi - lo, np.int64)
    frames = []
    for w in range(j.workers):
        idx, val = random_contribution(rng, j, p, density)
        np.add.at(ref, idx - lo, val)
        frames += h.data(j, w, p, rnd, idx, val, per_packet=50)
    return frames, ref


def test_slot_numbering_has_no_gaps_and_round_trips():
    j = JobInfo(job_id=1, workers=2, partition_size=10, numel=95, num_partitions=10, dpu_index=1,
                num_dpus=2, num_owned=5, mode=0, pool_off=0, pstate_off=0, wstate_off=0, scale_exp=0,
                port=1, slots=2)
    assert j.pool_len == 2 * 2 and j.pstate_len == 2 and j.wstate_len == 2 * 2 * 2
    for slot in range(2):
        gens = sorted(j.gen(p, r) for r in range(3) for p in j.owned_partitions() if j.slot(p) == slot)
        assert gens == list(range(len(gens)))  # 0, 1, 2, ...: consecutive occupants
        for g in gens:
            p, r = j.occupant(slot, g)
            assert j.slot(p) == slot and j.gen(p, r) == g
    assert [j.slot(p) for p in j.owned_partitions()] == [0, 1, 0, 1, 0]
    assert j.per_round(0) == 3 and j.per_round(1) == 2


@pytest.mark.parametrize("num_dpus,dpu_index", [(1, 0), (2, 1)])
def test_a_job_many_times_its_slots_runs_rounds_exactly(h, num_dpus, dpu_index):
    """20 partitions (10 per DPU with 2) through 3 slots for 3 rounds, a window of 3 partitions in
    flight at a time (packets of the window interleaved, some duplicated): every completion once,
    every sum exact, and the job's pool region is 3 slots whatever numel."""
    rng = np.random.default_rng(7)
    j = h.job(workers=3, numel=5000, partition_size=256, num_dpus=num_dpus, dpu_index=dpu_index, slots=3)
    assert j.list_cap == 64  # a 64-offset touched list for 256 sums
    assert j.pool_len == 3 * 2 < j.num_owned * 2  # 3 slots of 2 buffers, whatever numel
    owned = j.owned_partitions()
    dups = sent = 0
    for rnd in range(3):
        for start in range(0, len(owned), 3):
            window = owned[start:start + 3]
            frames, refs = [], {}
            for p in window:
                f, refs[int(p)] = contribution(h, rng, j, int(p), rnd)
                frames += f
            extra = [frames[i] for i in rng.choice(len(frames), len(frames) // 4)]
            dups += len(extra)
            sent += len(frames)
            both = frames + extra
            actions = h.run_all([both[i] for i in rng.permutation(len(both))])
            assert set(actions) <= {XDP_DROP, XDP_PASS}
            comps = h.maps.poll_completions(0)
            assert sorted((c.partition, c.round) for c in comps) == [(int(p), rnd) for p in window]
            for p in window:  # what the DPU worker does: read, advance, then send the result
                assert np.array_equal(h.maps.buffer(j.job_id, int(p), rnd), refs[int(p)]), (p, rnd)
                h.maps.advance(j.job_id, int(p), rnd)
    c = h.counters()
    assert c[Counter.MERGED] == sent
    assert c[Counter.COMPLETIONS] == 3 * len(owned)
    assert c[Counter.DUPLICATE] + c[Counter.PASS_DUP_OF_COMPLETE] == dups
    assert c[Counter.ROUND_TOO_OLD] == c[Counter.ROUND_TOO_NEW] == c[Counter.INTERNAL] == 0


def test_stale_and_early_occupants_are_dropped_and_the_shadow_survives_until_released(h):
    """4 partitions in 2 slots: slot 0 holds p0, then p2, then p0 of the next round."""
    rng = np.random.default_rng(8)
    j = h.job(workers=2, numel=4 * 256, partition_size=256, slots=2)
    f00, r00 = contribution(h, rng, j, 0, 0)
    f20, r20 = contribution(h, rng, j, 2, 0)
    f01, r01 = contribution(h, rng, j, 0, 1)
    h.run_all(f00)
    assert [(c.partition, c.round) for c in h.maps.poll_completions(0)] == [(0, 0)]
    assert not h.maps.advance(j.job_id, 0, 0)  # the slot's first occupant releases nothing

    # p2 (occupant 1) merges next to p0's shadow; p0 of round 1 (occupant 2) finds its slot held
    h.run_all(f20[:-1])
    before = h.counters()
    assert h.run(f01[0]) == XDP_DROP
    assert (h.counters() - before)[Counter.ROUND_TOO_NEW] == 1
    h.run(f20[-1])
    assert [(c.partition, c.round) for c in h.maps.poll_completions(0)] == [(2, 0)]
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 0), r00)  # shadow copy of p0 kept
    with pytest.raises(DosaError, match="slot 0 holds partition 0 round 0"):
        h.maps.advance(j.job_id, 0, 1)  # occupant 2 cannot complete before occupant 1 is base
    assert h.maps.advance(j.job_id, 2, 0)  # every host has p0's result: clear it
    st = h.maps.round_state(j.job_id, 2)
    assert (st.base_gen, st.base_partition, st.base_round) == (1, 2, 0)

    before = h.counters()
    assert h.run(f00[0]) == XDP_DROP  # a late copy of the old occupant touches nothing
    assert h.run(f20[0]) == XDP_PASS  # a duplicate of the complete p2: the worker answers it
    d = h.counters() - before
    assert d[Counter.ROUND_TOO_OLD] == 1 and d[Counter.PASS_DUP_OF_COMPLETE] == 1

    h.run_all(f01)  # p0 round 1 in the buffer p0 round 0 left (cleared)
    assert [(c.partition, c.round) for c in h.maps.poll_completions(0)] == [(0, 1)]
    assert np.array_equal(h.maps.buffer(j.job_id, 0, 1), r01)
    assert np.array_equal(h.maps.buffer(j.job_id, 2, 0), r20)
    assert h.maps.is_complete(j.job_id, 2, 0) and h.maps.is_complete(j.job_id, 0, 1)
    assert not h.maps.in_window(j.job_id, 0, 0)
    assert h.maps.advance(j.job_id, 0, 1)
    assert not h.maps.buffer(j.job_id, 2, 1).any()  # p2 round 1 starts from a clean buffer
    before = h.counters()
    h.run(f20[0])
    assert (h.counters() - before)[Counter.ROUND_TOO_OLD] == 1
