"""host_lib.encoder.RoundEncoder on torch tensors: the torch selector (what runs on CUDA; run here on
CPU, no GPU on this machine) against the numpy/Cython one, fp16/bf16 gradients with a float32
residual, DGC momentum correction, gtopk fold-back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from host_lib.compress import target_k
from host_lib.encoder import EncodedRound, RoundEncoder

pytestmark = pytest.mark.timeout(60)


def _conserved(enc, before: np.ndarray, er, scale: int) -> np.ndarray:
    """residual + what was sent, float64."""
    back = enc.residual.astype(np.float64)
    back[er.indices] += np.ldexp(er.values.astype(np.float64), -scale)
    return back


@pytest.mark.parametrize("method", ["exact", "fast"])
def test_torch_backend_selects_what_the_numpy_backend_selects(method):
    rng = np.random.default_rng(0)
    n = 200_000
    g = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    a = RoundEncoder(n, 0.01, 4, method, backend="numpy")
    b = RoundEncoder(n, 0.01, 4, method, backend="torch")
    ea, eb = a.encode(g, 24), b.encode(torch.from_numpy(g.copy()), 24)
    k = target_k(n, 0.01)
    if method == "exact":
        np.testing.assert_array_equal(ea.indices, eb.indices)
        np.testing.assert_array_equal(ea.values, eb.values)
    else:  # both are "every entry above a sampled threshold", within 20% of k
        for e in (ea, eb):
            assert 0.8 * k <= len(e) <= 1.2 * k
        common = np.intersect1d(ea.indices, eb.indices).size
        assert common >= 0.75 * min(len(ea), len(eb))
    for enc, e in ((a, ea), (b, eb)):
        np.testing.assert_array_equal(_conserved(enc, g, e, 24), g.astype(np.float64))
        assert np.all(np.diff(e.indices.astype(np.int64)) > 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_half_precision_gradients_keep_a_float32_residual(dtype, backend):
    torch.manual_seed(1)
    g = (torch.randn(70_000) * 1e-2).to(dtype)
    enc = RoundEncoder(g.numel(), 0.02, 2, "fast", backend=backend)
    er = enc.encode(g, 20)
    assert enc.r.dtype == torch.float32 and len(er) > 0
    # nothing lost: residual + sent == the gradient's exact float32 value
    np.testing.assert_array_equal(_conserved(enc, None, er, 20), g.float().numpy().astype(np.float64))
    er2 = enc.encode(g, 20)  # the residual carries fp32 precision a half gradient cannot hold
    assert len(er2) > 0 and np.isfinite(enc.residual).all()


def test_momentum_correction_sparsifies_the_velocity_and_masks_what_was_sent():
    g = np.zeros(10, np.float32)
    g[[2, 7]] = [1.0, 0.5]
    enc = RoundEncoder(10, 0.1, 1, "exact", momentum=0.9)  # k = 1
    er = enc.encode(g, 10)
    assert er.indices.tolist() == [2]
    assert enc.u[2] == 0 and enc.u[7] == pytest.approx(0.5)  # masking: the sent entry's past is gone
    er = enc.encode(g, 10)  # u = 0.9*u + g: index 7 has 0.95 velocity + 0.5 residual
    assert er.indices.tolist() == [7]
    assert enc.residual[2] == pytest.approx(1.0)  # what index 2 got this time waits in the residual


def test_gtopk_fold_back_restores_exactly_what_the_dpu_dropped():
    rng = np.random.default_rng(3)
    g = rng.standard_normal(1000).astype(np.float32)
    for backend in ("numpy", "torch"):
        enc = RoundEncoder(1000, 0.05, 2, "exact", backend=backend)
        er = enc.encode(g, 16)
        before = enc.residual.copy()
        applied = er.indices[::2]
        idx, q = enc.unapplied(er, applied)
        enc.fold_back(idx, q, 16)
        np.testing.assert_array_equal(enc.residual[applied], before[applied])
        np.testing.assert_allclose(enc.residual[idx], before[idx] + q * 2.0**-16)


def test_bad_gradients_are_refused_in_one_sentence():
    enc = RoundEncoder(4, 0.5, 2, backend="torch")
    with pytest.raises(ValueError, match="non-finite .* first at index 1"):
        enc.encode(torch.tensor([0.0, float("nan"), 1.0, 2.0]), 0)
    assert torch.isfinite(enc.r).all()
    with pytest.raises(ValueError, match="floating-point"):
        enc.encode(torch.arange(4), 0)
    with pytest.raises(ValueError, match="5 entries, the encoder was made for 4"):
        enc.encode(torch.zeros(5), 0)
    with pytest.raises(ValueError, match="numpy backend runs on the CPU only"):
        RoundEncoder(4, 0.5, 2, device="meta", backend="numpy")


@pytest.mark.parametrize("clip", [False, True])
def test_fused_quantize_pass_gives_quantizes_numbers(clip):
    """The numpy backend's one Cython pass (quantize + residual + drop zeros) against
    host_lib.quantize.quantize on the same selection: identical q, indices and residual, with
    ties at exactly half a step (round half to even) and, with ``clip``, sums past the clip bound
    (which take the general path)."""
    from host_lib.quantize import quantize

    rng = np.random.default_rng(3)
    n, s = 100_000, 4  # a coarse step: many selected entries round to 0 (selected, not sent)
    g = (rng.standard_normal(n) * 0.1 * 2.0 ** -s).astype(np.float32)
    g[::97] = (rng.integers(-40, 40, len(g[::97])) + 0.5) * 2.0 ** -s  # exact ties
    if clip:
        g[7] = 2.0 ** 31 / 4 * 2.0 ** -s * 3  # |q| > INT32_MAX // 4
    enc = RoundEncoder(n, 0.05, 4, "exact", backend="numpy")
    ref = RoundEncoder(n, 0.05, 4, "exact", backend="numpy")
    e = enc.encode(g, s)
    # the reference: the same selection, quantized by quantize()
    from host_lib.compress import select_topk
    r = ref.residual
    idx, vals = select_topk(g, 0.05, "exact", residual_out=r)
    q, rem = quantize(vals, s, 4)
    r[idx] = rem
    nz = q != 0
    assert (~nz).sum() > 1000  # the zeros are dropped
    np.testing.assert_array_equal(e.indices, idx[nz])
    np.testing.assert_array_equal(e.values, q[nz])
    np.testing.assert_array_equal(enc.residual, r)
    assert e.values.dtype == np.int32 and e.indices.dtype == np.uint32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unapplied_merge_equals_isin_whatever_the_order(seed):
    """unapplied's linear merge (both sides ascending) and its np.isin fallback (any order) give
    the entries of ``sent`` missing from the result, nothing else."""
    rng = np.random.default_rng(seed)
    enc = RoundEncoder(1_000_000, 0.01, 4)
    idx = np.unique(rng.integers(0, 1_000_000, 20_000)).astype(np.uint32)
    q = rng.integers(-50, 50, len(idx)).astype(np.int32)
    res = np.unique(np.concatenate([idx[rng.random(len(idx)) < 0.5],
                                    rng.integers(0, 1_000_000, 5_000)]).astype(np.uint32))
    want = ~np.isin(idx, res)
    got_i, got_q = enc.unapplied(EncodedRound(idx, q, 8), res)
    assert np.array_equal(got_i, idx[want]) and np.array_equal(got_q, q[want])
    rev = np.arange(len(idx))[::-1]  # not ascending: the fallback, same entries
    ri, rq = enc.unapplied(EncodedRound(idx[rev], q[rev], 8), res[::-1].copy())
    assert np.array_equal(np.sort(ri), idx[want]) and sorted(rq.tolist()) == sorted(q[want].tolist())
    ei, eq = enc.unapplied(EncodedRound(idx, q, 8), np.zeros(0, np.uint32))  # nothing applied
    assert np.array_equal(ei, idx) and np.array_equal(eq, q)


@pytest.mark.parametrize("n_ranges", [1, 3, 7])
def test_encoding_range_by_range_selects_and_quantizes_as_one_pass_does(n_ranges):
    """RoundEncoder.encode_ranges: one threshold for the whole gradient (the same sample encode
    draws), so over rounds of error feedback the entries, values and residual are bit for bit those
    of encode(); bounds must tile the gradient."""
    rng = np.random.default_rng(4)
    n = 300_000
    g = (rng.standard_t(3, n) * np.repeat(10.0 ** rng.uniform(-4, -1, 30), n // 30)).astype(np.float32)
    a, b = RoundEncoder(n, 0.01, 4, seed=7), RoundEncoder(n, 0.01, 4, seed=7)
    cuts = np.unique(np.linspace(0, n, n_ranges + 1).astype(int))
    bounds = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    for _ in range(4):
        whole = a.encode(g, 20)
        parts = list(b.encode_ranges(g, 20, bounds))
        assert [(lo, hi) for lo, hi, _ in parts] == bounds
        for lo, hi, e in parts:
            assert e.scale_exp == 20 and (len(e.indices) == 0 or (e.indices.min() >= lo and e.indices.max() < hi))
        assert np.array_equal(np.concatenate([e.indices for _, _, e in parts]), whole.indices)
        assert np.array_equal(np.concatenate([e.values for _, _, e in parts]), whole.values)
        assert np.array_equal(a.residual, b.residual)
    with pytest.raises(ValueError, match="covering"):
        list(b.encode_ranges(g, 20, [(0, 10), (11, n)]))


def test_encoding_ranges_falls_back_to_one_encode_where_the_fast_pass_does_not_apply():
    rng = np.random.default_rng(5)
    n = 100_000
    g = rng.standard_normal(n).astype(np.float32)
    for kw in ({"method": "exact"}, {"momentum": 0.9}):
        a, b = RoundEncoder(n, 0.02, 2, seed=1, **kw), RoundEncoder(n, 0.02, 2, seed=1, **kw)
        whole = a.encode(g, 12)
        parts = list(b.encode_ranges(g, 12, [(0, 40_000), (40_000, n)]))
        assert np.array_equal(np.concatenate([e.indices for _, _, e in parts]), whole.indices)
        assert np.array_equal(a.residual, b.residual)


@pytest.mark.parametrize("scale", [-32, 0, 17, 62])
def test_the_compiled_fold_back_adds_exactly_what_numpy_adds(scale):
    """host_lib._select.add_dequantized (RoundEncoder.fold_back's CPU pass): r[idx] += the float32
    of q * 2^-s, bit for bit numpy's ``r[idx] += dequantize(q, s)``."""
    from host_lib._select import add_dequantized
    from host_lib.quantize import dequantize

    rng = np.random.default_rng(scale + 40)
    n = 50_000
    r0 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 8, n)).astype(np.float32)
    idx = np.sort(rng.choice(n, 7000, replace=False)).astype(np.uint32)
    q = rng.integers(-2**31 + 1, 2**31 - 1, len(idx)).astype(np.int32)
    want = r0.copy()
    want[idx] += dequantize(q, scale)
    got = r0.copy()
    add_dequantized(got, idx, q, scale)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="past"):
        add_dequantized(got, np.array([n], np.uint32), np.array([1], np.int32), 0)
