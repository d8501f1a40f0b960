"""host_lib.compress and host_lib.encoder: top-k selection, its accuracy, error feedback."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from dosa import wire
from host_lib._select import add_select_abs_ge, select_abs_ge
from host_lib.compress import (
    FastStats, select_topk, target_k, topk_exact, topk_fast,
)
from host_lib.encoder import RoundEncoder
from dosa.packetizer import packetize, parse_batch
from host_lib.quantize import clip_bound

pytestmark = pytest.mark.timeout(120)


def realistic_gradient(rng, n):
    """Layers of very different scales, heavy tails (Student-t), a dead layer of zeros."""
    sizes = rng.multinomial(n, rng.dirichlet(np.ones(12)))
    parts = []
    for i, m in enumerate(sizes):
        scale = 10.0 ** rng.uniform(-5, -1)
        if i == 3:
            parts.append(np.zeros(m, np.float32))
        elif i % 2:
            parts.append((rng.standard_t(2.5, m) * scale).astype(np.float32))
        else:
            mix = rng.standard_normal(m) * np.where(rng.random(m) < 0.05, 20, 1)
            parts.append((mix * scale).astype(np.float32))
    return np.concatenate(parts)


@settings(max_examples=60, deadline=None)
@given(a=arrays(np.float32, st.integers(0, 300),
                elements=st.floats(-2.0**100, 2.0**100, width=32, allow_subnormal=True)),
       t=st.floats(0, 2.0**100, width=32), cap=st.integers(0, 400))
def test_kernel_matches_numpy(a, t, cap):
    ref = np.flatnonzero(np.abs(a) >= t)
    idx, val = np.empty(cap, np.uint32), np.empty(cap, np.float32)
    c, bad, first = select_abs_ge(a, t, idx, val)
    assert (c, bad, first) == (len(ref), 0, -1)
    w = min(c, cap)
    np.testing.assert_array_equal(idx[:w], ref[:w])
    np.testing.assert_array_equal(val[:w], a[ref[:w]])
    g = a[::-1].copy()
    r = a.copy()
    c2, _, _ = add_select_abs_ge(r, g, t, idx, val)
    s = (a + g).astype(np.float32)
    np.testing.assert_array_equal(r, s)
    assert c2 == np.count_nonzero(np.abs(s) >= t)


@pytest.mark.parametrize("path", ["best", "generic"])  # AVX-512 where the CPU has it; DOSA_NO_AVX512
def test_both_kernel_paths_select_exactly_what_numpy_does(path, monkeypatch):
    if path == "generic":
        monkeypatch.setenv("DOSA_NO_AVX512", "1")
    else:
        monkeypatch.delenv("DOSA_NO_AVX512", raising=False)
    rng = np.random.default_rng(11)
    for n in (0, 15, 16, 17, 1000, 4099, 100_003):
        a = realistic_gradient(rng, n) if n else np.zeros(0, np.float32)
        bad_at = rng.choice(n, min(n, 3), replace=False) if n > 50 else np.zeros(0, np.int64)
        a[bad_at] = np.array([np.nan, np.inf, -np.inf], np.float32)[:len(bad_at)]
        finite = np.isfinite(a)
        for q in (0.0, 0.5, 0.99, 1.0):
            t = np.float32(np.quantile(np.abs(a[finite]), q)) if finite.any() else np.float32(1)
            ref = np.flatnonzero(finite & (np.abs(a) >= t))
            for cap in (0, 7, len(ref) // 2, len(ref) + 16, n + 32):
                idx, val = np.empty(cap, np.uint32), np.empty(cap, np.float32)
                c, bad, first = select_abs_ge(a, float(t), idx, val)
                assert c == len(ref) and bad == len(bad_at)
                assert first == (int(np.flatnonzero(~finite)[0]) if len(bad_at) else -1)
                w = min(c, cap)
                assert np.array_equal(idx[:w], ref[:w]) and np.array_equal(val[:w], a[ref[:w]])
                g = rng.standard_normal(n).astype(np.float32)
                r = np.where(finite, a, 0).astype(np.float32)
                r0 = r.copy()
                c2, bad2, _ = add_select_abs_ge(r, g, float(t), idx, val)
                s = (r0 + g).astype(np.float32)
                assert np.array_equal(r, s) and c2 == np.count_nonzero(np.abs(s) >= t) and bad2 == 0
                w = min(c2, cap)
                assert np.array_equal(idx[:w], np.flatnonzero(np.abs(s) >= t)[:w])


def test_kernel_reports_nonfinite_and_keeps_residual_finite():
    a = np.ones(100, np.float32)
    a[[17, 40, 41]] = [np.nan, np.inf, -np.inf]
    idx, val = np.empty(100, np.uint32), np.empty(100, np.float32)
    c, bad, first = select_abs_ge(a, 0.5, idx, val)
    assert (c, bad, first) == (97, 3, 17) and 17 not in idx[:c]
    r = np.zeros(100, np.float32)
    c, bad, first = add_select_abs_ge(r, a, 0.5, idx, val)
    assert (bad, first) == (3, 17) and np.isfinite(r).all() and r[16] == 1 and r[17] == 0


def test_target_k():
    assert target_k(0, 0.5) == 0 and target_k(10, 0) == 0 and target_k(10, 1) == 10
    assert target_k(1000, 0.0001) == 1 and target_k(25_000_000, 0.01) == 250_000
    with pytest.raises(ValueError):
        target_k(10, 1.5)


def test_exact_is_the_top_k():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(10_000).astype(np.float32)
    idx = topk_exact(a, 100)
    assert idx.dtype == np.uint32 and len(idx) == 100 and np.all(np.diff(idx.astype(np.int64)) > 0)
    assert np.abs(a[idx]).min() >= np.sort(np.abs(a))[-100]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_fast_count_within_20_percent_on_realistic_gradients(seed, density):
    rng = np.random.default_rng(seed)
    a = realistic_gradient(rng, 1_000_000)
    k = target_k(len(a), density)
    stats = FastStats()
    idx, val = topk_fast(a, k, rng=rng, stats=stats)
    assert 0.8 * k <= len(idx) <= 1.2 * k
    assert np.all(np.diff(idx.astype(np.int64)) > 0)
    np.testing.assert_array_equal(val, a[idx])
    # what it selects is the exact top-c for its count c: nothing left out is larger
    rest = np.ones(len(a), bool)
    rest[idx] = False
    assert np.abs(a[rest]).max() <= np.abs(val).min()


def test_fast_guard_trims_or_repasses_when_the_sample_misleads():
    rng = np.random.default_rng(5)
    # tolerance 0: the guard (trim, or second pass then trim) must bring the count to exactly k
    a = realistic_gradient(rng, 300_000)
    k = 3000
    stats = FastStats()
    idx, _ = topk_fast(a, k, rng=rng, tolerance=0.0, stats=stats)
    assert len(idx) == k and (stats.trimmed or stats.candidates == k)
    # the trimmed set is the exact top-k (compare magnitudes: ties may pick different indices)
    np.testing.assert_array_equal(np.sort(np.abs(a[idx])), np.sort(np.abs(a[topk_exact(a, k)])))


def test_fast_never_selects_zeros():
    a = np.zeros(200_000, np.float32)
    a[::1000] = np.arange(1, 201)
    idx, val = topk_fast(a, 2000, rng=np.random.default_rng(0))
    assert len(idx) == 200 and np.all(val != 0)


@pytest.mark.parametrize("method", ["exact", "fast"])
def test_density_edges_and_empty(method):
    rng = np.random.default_rng(1)
    g = rng.standard_normal(100_000).astype(np.float32)
    enc = RoundEncoder(len(g), 0.0, 1, method=method)
    assert len(enc.encode(g, 20)) == 0
    np.testing.assert_array_equal(enc.residual, g)  # everything stays in the residual
    enc = RoundEncoder(len(g), 1.0, 1, method=method)
    er = enc.encode(g, 20)
    np.testing.assert_array_equal(er.indices, np.flatnonzero(np.rint(g * 2.0**20)))
    back = enc.residual.astype(np.float64)
    back[er.indices] += np.ldexp(er.values.astype(np.float64), -20)
    np.testing.assert_array_equal(back, g.astype(np.float64))


@pytest.mark.parametrize("method", ["exact", "fast"])
def test_error_feedback_conserves_the_gradient_sum(method):
    rng = np.random.default_rng(2)
    n = 150_000
    enc = RoundEncoder(n, 0.01, 4, method=method, seed=3)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for _ in range(5):
        g = realistic_gradient(rng, n)
        total += g
        er = enc.encode(g, 24)
        sent[er.indices] += np.ldexp(er.values.astype(np.float64), -24)
    # float32 residual: each round rounds r + g once; the error stays at float32 epsilon scale
    np.testing.assert_allclose(sent + enc.residual, total, rtol=1e-5, atol=1e-6 * np.abs(total).max())


def test_one_k_rule():
    assert [target_k(n, d) for n, d in [(0, 0.5), (10, 0.0), (10, 0.01), (1000, 0.0125), (7, 1.0)]] \
        == [0, 0, 1, 12, 7]


def test_select_topk_rejects_bad_method():
    with pytest.raises(ValueError, match="method"):
        select_topk(np.ones(3), 0.5, "sorted")


@pytest.mark.parametrize("method", ["exact", "fast"])
def test_encoder_conserves_exactly_and_packetizes(method):
    rng = np.random.default_rng(4)
    n, w = 200_000, 4
    enc = RoundEncoder(n, 0.02, w, method=method, seed=1)
    r0 = enc.residual.copy()
    g = realistic_gradient(rng, n)
    a = (r0 + g).astype(np.float32)
    er = enc.encode(g, scale_exp=20)
    assert er.indices.dtype == np.uint32 and er.values.dtype == np.int32 and len(er) > 0
    assert np.all(np.abs(er.values.astype(np.int64)) <= clip_bound(w))
    back = enc.residual.astype(np.float64)
    back[er.indices] += np.ldexp(er.values.astype(np.float64), -20)
    np.testing.assert_array_equal(back, a.astype(np.float64))  # exact conservation
    pmap = wire.PartitionMap(n, partition_size=10_000, num_dpus=2)
    p = parse_batch(packetize(er.indices, er.values, pmap, job_id=1, worker_id=0, round=0,
                              scale_exp=er.scale_exp))
    np.testing.assert_array_equal(p.indices, er.indices)


def test_encoder_fold_back_restores_unapplied_entries():
    rng = np.random.default_rng(6)
    n = 100_000
    enc = RoundEncoder(n, 0.05, 2, method="exact")
    g = rng.standard_normal(n).astype(np.float32)
    er = enc.encode(g, scale_exp=16)
    before = enc.residual.copy()
    applied = er.indices[::2]  # pretend the DPU returned only every other index (gtopk)
    idx, q = enc.unapplied(er, applied)
    assert len(idx) == len(er) - len(applied)
    enc.fold_back(idx, q, 16)
    np.testing.assert_array_equal(enc.residual[applied], before[applied])
    expect = (before[idx] + (q.astype(np.float64) / 2**16).astype(np.float32))
    np.testing.assert_array_equal(enc.residual[idx], expect)
    np.testing.assert_allclose(enc.residual[idx], g[idx], rtol=1e-6)
    with pytest.raises(ValueError, match="unique"):
        enc.fold_back(np.array([1, 1]), np.array([1, 2], np.int32), 16)
    with pytest.raises(ValueError, match=r"\[0, 100000\)"):
        enc.fold_back(np.array([n]), np.array([1], np.int32), 16)
