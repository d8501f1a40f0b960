"""The DPU merge kernels and the userspace merge state machine (dpu_fw._merge, dpu_fw.userspace):
the dataplane's rules (docs/protocol.md) applied to real packets built by dosa.packetizer."""
from __future__ import annotations

import numpy as np
import pytest

from dosa.wire import PartitionMap
from dpu_fw import _merge
from dpu_fw.userspace import VERDICTS, MergeState, top_k_abs
from dosa.packetizer import packetize, parse_batch


def test_scatter_add_matches_numpy_and_reports_out_of_range():
    rng = np.random.default_rng(0)
    buf = np.zeros(1000, np.int64)
    idx = rng.integers(0, 2000, 5000).astype(np.uint32)
    val = rng.integers(-2**31 + 1, 2**31 - 1, 5000).astype(np.int32)
    nbad = _merge.scatter_add(buf, idx, val, 500)
    exp = np.zeros(2000, np.int64)
    inside = (idx >= 500) & (idx < 1500)
    np.add.at(exp, idx[inside].astype(np.int64), val[inside].astype(np.int64))
    assert nbad == int((~inside).sum()) > 0
    assert np.array_equal(buf, exp[500:1500])


def test_scatter_add_rejects_length_mismatch():
    with pytest.raises(ValueError):
        _merge.scatter_add(np.zeros(4, np.int64), np.zeros(2, np.uint32), np.zeros(3, np.int32), 0)


def test_extract_nonzero_and_saturation():
    buf = np.zeros(100, np.int64)
    buf[[3, 50, 99]] = [5, -(2**40), 2**31 - 1]
    idx, sums, nsat = _merge.extract_nonzero(buf, 1000)
    assert idx.tolist() == [1003, 1050, 1099]
    assert sums.tolist() == [5, -(2**31 - 1), 2**31 - 1]
    assert nsat == 1
    _merge.clear_indices(buf, idx, 1000)
    assert not buf.any()


def test_top_k_abs_is_deterministic_on_ties():
    idx = np.arange(10, dtype=np.uint32)
    sums = np.array([1, -5, 5, 3, -5, 0, 2, 5, 1, 4], np.int32)
    i, s = top_k_abs(idx, sums, 4)
    assert i.tolist() == [1, 2, 4, 7] and s.tolist() == [-5, 5, -5, 5]
    i, s = top_k_abs(idx, sums, 5)
    assert i.tolist() == [1, 2, 4, 7, 9]
    assert top_k_abs(idx, sums, 20)[0].tolist() == idx.tolist()


class Dpu:
    """One DPU's MergeState for a job, fed with packetized contributions."""

    def __init__(self, numel=3000, psize=1000, workers=3, ndpus=1, dpu=0, state_dir=None):
        self.pmap = PartitionMap(numel, psize, ndpus)
        owned = self.pmap.owned_by(dpu)
        self.local = {int(p): i for i, p in enumerate(owned)}
        lo = owned * psize
        self.st = MergeState(owned, lo, np.minimum(lo + psize, numel), workers, psize, state_dir)
        self.workers = workers

    def feed(self, batch):
        ps = parse_batch(batch)
        h = ps.headers
        lp = np.array([self.local[int(p)] for p in h["partition"]], np.int64)
        v, comps = self.st.merge(lp, h["round"], h["worker_id"], h["seq"], h["total"], h["count"],
                                 h["scale_exp"], ps.indices, ps.values, ps.offsets[:-1])
        return [VERDICTS[x] for x in v], comps


def contribution(pmap, w, rnd, nnz=400, scale=8, seed=0):
    rng = np.random.default_rng([seed, w, rnd])
    idx = np.sort(rng.choice(pmap.numel, nnz, replace=False)).astype(np.uint32)
    q = rng.integers(-10**6, 10**6, nnz).astype(np.int32)
    return idx, q, packetize(idx, q, pmap, job_id=1, worker_id=w, round=rnd, scale_exp=scale)


def test_round_completes_once_with_the_exact_sum_and_ignores_duplicates():
    d = Dpu()
    exp = np.zeros(d.pmap.numel, np.int64)
    comps_all = []
    for w in range(3):
        idx, q, b = contribution(d.pmap, w, 0)
        np.add.at(exp, idx.astype(np.int64), q)
        v, comps = d.feed(b)
        assert set(v) == {"merged"}
        comps_all += comps
        v, comps = d.feed(b)  # the same packets again
        comps_all += comps
        assert set(v) == ({"pass_dup_of_complete"} if w == 2 else {"duplicate"})
    assert sorted(comps_all) == [(0, 0), (1, 0), (2, 0)]
    for p in range(3):
        assert np.array_equal(d.st.buffer(p, 0), exp[p * 1000:(p + 1) * 1000])
        assert d.st.is_complete(p, 0) and d.st.missing_workers(p, 0) == []


def test_completion_needs_every_worker_and_missing_ones_are_named():
    d = Dpu()
    for w in (0, 2):
        d.feed(contribution(d.pmap, w, 0)[2])
    assert not d.st.is_complete(0, 0)
    assert d.st.missing_workers(0, 0) == [1]


def test_round_window_and_advance_clear_the_old_parity():
    d = Dpu(numel=1000, psize=1000)
    for w in range(3):
        d.feed(contribution(d.pmap, w, 0)[2])
    v, _ = d.feed(contribution(d.pmap, 0, 2)[2])
    assert set(v) == {"round_too_new"}
    comps = []
    for w in range(3):
        comps += d.feed(contribution(d.pmap, w, 1)[2])[1]
    assert comps == [(0, 1)]
    d.st.advance(0, 1)
    assert d.st.base_round[0] == 1
    assert not d.st.buffer(0, 0).any() and not d.st.seen[0, 0].any()
    v, _ = d.feed(contribution(d.pmap, 1, 0)[2])
    assert set(v) == {"round_too_old"}
    v, _ = d.feed(contribution(d.pmap, 1, 2)[2])  # parity 0 again, now cleared and accepted
    assert set(v) == {"merged"}


def test_scale_total_and_index_violations_are_rejected():
    d = Dpu(numel=1000, psize=1000)
    d.feed(contribution(d.pmap, 0, 0, scale=8)[2])
    v, _ = d.feed(contribution(d.pmap, 1, 0, scale=9)[2])
    assert set(v) == {"scale_mismatch"}
    # total mismatch: worker 2 announces 3 packets, then sends a seq 1 claiming total 2
    idx, q, b = contribution(d.pmap, 2, 0, nnz=500)
    d.feed(b.select(np.array([True, False, False])))
    _, _, b1 = contribution(d.pmap, 2, 0, nnz=300)
    v, _ = d.feed(b1.select(np.array([False, True])))
    assert v == ["total_mismatch"]
    # an index outside the partition (a hand-edited packet) drops the whole packet
    d2 = Dpu(numel=2000, psize=1000)
    _, _, b = contribution(d2.pmap, 0, 0, nnz=20)
    first = b.select(np.array([0]))
    first.data[0, 32:36] = np.frombuffer(np.array([1500], ">u4").tobytes(), np.uint8)
    v, _ = d2.feed(first)
    assert v == ["index_out_of_partition"]
    assert not d2.st.buffer(0, 0).any()


def test_state_in_files_survives_a_restart(tmp_path):
    d = Dpu(state_dir=str(tmp_path))
    for w in range(2):
        d.feed(contribution(d.pmap, w, 0)[2])
    del d
    d = Dpu(state_dir=str(tmp_path))
    assert d.st.resumed
    v, comps = d.feed(contribution(d.pmap, 2, 0)[2])
    assert set(v) == {"merged"} and len(comps) == 3
