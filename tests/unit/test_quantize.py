"""host_lib.quantize: the fixed-point conservation law of docs/protocol.md, and its edges."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from dosa import wire
from host_lib._select import quantize_to_residual
from host_lib.quantize import check_finite, choose_scale_exp, clip_bound, dequantize, quantize

pytestmark = pytest.mark.timeout(120)

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
scales = st.integers(wire.SCALE_EXP_MIN, wire.SCALE_EXP_MAX)
workers = st.integers(1, wire.MAX_WORKERS)


def test_clip_bound_sum_of_workers_fits_s32():
    for w in (1, 2, 3, 7, 64):
        c = clip_bound(w)
        assert c * w <= 2**31 - 1 < (c + 1) * w
    with pytest.raises(ValueError):
        clip_bound(0)


@settings(max_examples=150, deadline=None)
@given(x=arrays(np.float32, st.integers(1, 50), elements=finite_f32), s=scales, w=workers)
def test_conservation_law_exact_unless_clipped_beyond_2_23(x, s, w):
    q, rem = quantize(x, s, w)
    c = clip_bound(w)
    assert q.dtype == np.int32 and rem.dtype == np.float32 and q.shape == x.shape
    assert np.all(np.abs(q.astype(np.int64)) <= c)
    lhs = np.ldexp(q.astype(np.float64), -s) + rem.astype(np.float64)
    x64 = x.astype(np.float64)
    # the exactness regime: G = max(1, ulp(x) * 2^s) <= C (always true unless clipped by > 2^23)
    ulp = np.spacing(np.abs(x).astype(np.float64)) * 2.0**29  # float32 ulp, no overflow at FLT_MAX
    ulp = np.maximum(ulp, 2.0**-149)
    g = np.maximum(1.0, np.ldexp(ulp, s))
    exact = g <= c
    np.testing.assert_array_equal(lhs[exact], x64[exact])
    # beyond it: within one ulp of x, and q is saturated at +-C with x's sign
    hard = ~exact
    assert np.all(np.abs(lhs[hard] - x64[hard]) <= ulp[hard])
    assert np.all(q[hard].astype(np.int64) == np.sign(x[hard]).astype(np.int64) * c)


@settings(max_examples=200, deadline=None)
@given(x=finite_f32, s=scales, w=workers)
def test_unclipped_is_round_to_nearest(x, s, w):
    y = math.ldexp(float(x), s)
    assume(abs(y) <= clip_bound(w) - 1)
    q, rem = quantize(np.array([x], np.float32), s, w)
    assert abs(int(q[0]) - y) <= 0.5
    assert abs(float(rem[0])) <= math.ldexp(0.5, -s)


@settings(max_examples=200, deadline=None)
@given(factor=st.floats(1.0, 2.0, exclude_min=True), s=st.integers(-10, 30), w=workers,
       neg=st.booleans())
def test_clipped_by_up_to_2x_keeps_nearly_whole_clip_bound(factor, s, w, neg):
    c = clip_bound(w)
    x = np.float32(math.ldexp(c * factor, -s) * (-1 if neg else 1))
    assume(abs(math.ldexp(float(x), s)) > c + 0.5)
    q, rem = quantize(np.array([x]), s, w)
    assert abs(int(q[0])) >= c * (1 - 2**-21) and abs(int(q[0])) <= c
    assert np.sign(q[0]) == np.sign(x) and (rem[0] == 0 or np.sign(rem[0]) == np.sign(x))
    assert math.ldexp(float(q[0]), -s) + float(rem[0]) == float(x)


def _quantize_numpy(values, scale_exp, w):
    """quantize() as numpy computed it before the rule moved into C (host_lib/_select.pyx,
    dosa_quantize1): the reference the C rule must match bit for bit."""
    s, c = int(scale_exp), clip_bound(w)
    x = np.asarray(values, dtype=np.float32)
    check_finite(x)
    x64 = x.astype(np.float64)
    r = np.rint(np.ldexp(x64, s))
    clipped = np.abs(r) > c
    if clipped.any():
        xc = x[clipped]
        g = np.maximum(1.0, np.ldexp(1.0, np.frexp(x64[clipped])[1] - 24 + s))
        mag = np.where(g <= c, np.floor(c / g) * g, float(c))
        r[clipped] = np.copysign(mag, xc)
    return r.astype(np.int32), (x64 - np.ldexp(r, -s)).astype(np.float32)


def _edge_values(s: int, c: int) -> np.ndarray:
    f = np.finfo(np.float32)
    step = 2.0 ** -s
    e = [0.0, -0.0, float(f.smallest_subnormal), float(f.tiny), float(f.max), 1.0, 0.1,
         0.5 * step, 1.5 * step, 2.5 * step, 0.49 * step, 0.51 * step,  # ties and near-ties
         c * step, (c - 0.5) * step, (c + 0.5) * step, (c + 1) * step, 2 * c * step, 2.0 ** 23 * c * step,
         2.0 ** 24 * c * step, 2.0 ** 30 * c * step]
    e = np.array([v for v in e if abs(v) <= f.max], np.float64)
    return np.concatenate([e, -e]).astype(np.float32)


@pytest.mark.parametrize("w", [1, 2, 3, 7, 64])
def test_c_rule_is_bit_identical_to_the_numpy_formula(w):
    """Every scale of the wire, random float32 bit patterns (huge, tiny, subnormal, negative),
    values around the step and the clip bound, ties: q and the remainder's bits identical."""
    rng = np.random.default_rng(w)
    bits = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = bits[np.isfinite(bits)]
    c = clip_bound(w)
    for s in range(wire.SCALE_EXP_MIN, wire.SCALE_EXP_MAX + 1):
        near = (rng.standard_normal(2000) * 2.0 ** rng.uniform(-2, 34, 2000) * 2.0 ** -s)
        ties = (rng.integers(-2**20, 2**20, 200) + 0.5) * 2.0 ** -s
        x = np.concatenate([bits, _edge_values(s, c), near.astype(np.float32), ties.astype(np.float32)])
        x = x[np.isfinite(x)]
        q, rem = quantize(x, s, w)
        rq, rrem = _quantize_numpy(x, s, w)
        assert q.dtype == rq.dtype == np.int32 and rem.dtype == rrem.dtype == np.float32
        np.testing.assert_array_equal(q, rq, err_msg=f"s={s}")
        np.testing.assert_array_equal(rem.view(np.uint32), rrem.view(np.uint32), err_msg=f"s={s}")
        # the encoder's fused pass runs the same rule on what does not clip
        keep = np.abs(np.rint(np.ldexp(x.astype(np.float64), s))) <= c
        xs = x[keep]
        idx = np.arange(len(xs), dtype=np.uint32)
        r = np.full(len(xs), np.nan, np.float32)
        idx_out, q_out = np.empty(len(xs), np.uint32), np.empty(len(xs), np.int32)
        n = quantize_to_residual(idx, xs, s, float(c), r, idx_out, q_out)
        nz = rq[keep] != 0
        assert n == nz.sum()
        np.testing.assert_array_equal(idx_out[:n], idx[nz])
        np.testing.assert_array_equal(q_out[:n], rq[keep][nz])
        np.testing.assert_array_equal(r.view(np.uint32), rrem[keep].view(np.uint32))


@pytest.mark.parametrize("make", [
    lambda: np.float32(3.25),                                                 # 0-d
    lambda: np.arange(-12, 12, dtype=np.float32).reshape(2, 3, 4) * 0.37,     # n-d
    lambda: np.asfortranarray(np.linspace(-5, 5, 30).reshape(5, 6)),          # float64, F order
    lambda: np.linspace(-1e30, 1e30, 41, dtype=np.float32)[::3],              # strided
    lambda: [0.5, -1.5, 2.5, 1e-40, -3e38],                                   # a list
])
def test_shapes_and_dtypes_as_before(make):
    q, rem = quantize(make(), 3, 4)
    rq, rrem = _quantize_numpy(make(), 3, 4)
    assert q.shape == rq.shape and rem.shape == rrem.shape
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(rem.view(np.uint32), rrem.view(np.uint32))


@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_non_finite_raises_as_before(bad):
    x = np.linspace(-1, 1, 9).astype(np.float32)
    x[[2, 5]] = bad
    with pytest.raises(ValueError) as new:
        quantize(x, 10, 2)
    with pytest.raises(ValueError) as old:
        _quantize_numpy(x, 10, 2)
    assert str(new.value) == str(old.value)


def test_sum_of_clipped_values_of_all_workers_fits_s32():
    w = 5
    x = np.full(3, 1e30, np.float32)
    total = sum(quantize(x, 0, w)[0].astype(np.int64) for _ in range(w))
    assert np.all(total <= 2**31 - 1)


def test_dequantize_is_nearest_float32():
    q = np.array([0, 1, -3, 2**31 - 1, -(2**31 - 1)], np.int32)
    d = dequantize(q, 4)
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d, (q.astype(np.float64) / 16).astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_with_count_and_first_index(bad):
    x = np.zeros(10, np.float32)
    x[[3, 7]] = bad
    with pytest.raises(ValueError, match=r"2 non-finite .* first at index 3"):
        quantize(x, 0, 2)
    with pytest.raises(ValueError, match="index 3"):
        check_finite(x)


def test_bad_scale_raises():
    with pytest.raises(ValueError, match="scale_exp"):
        quantize(np.ones(2, np.float32), wire.SCALE_EXP_MAX + 1, 2)
    with pytest.raises(ValueError, match="scale_exp"):
        dequantize(np.ones(2, np.int32), 1.5)


def test_empty_is_empty():
    q, rem = quantize(np.zeros(0, np.float32), 3, 4)
    assert q.shape == rem.shape == (0,)


@settings(max_examples=300, deadline=None)
@given(m=st.floats(1e-30, 1e30), w=workers, headroom=st.floats(1.0, 16.0))
def test_choose_scale_exp_is_largest_with_headroom(m, w, headroom):
    s = choose_scale_exp(m, w, headroom)
    c = clip_bound(w)
    assert wire.SCALE_EXP_MIN <= s <= wire.SCALE_EXP_MAX
    if wire.SCALE_EXP_MIN < s:
        assert math.ldexp(headroom * m, s) <= c
    if s < wire.SCALE_EXP_MAX:
        assert math.ldexp(headroom * m, s + 1) > c


def test_choose_scale_exp_edges():
    assert choose_scale_exp(0.0, 4) == wire.SCALE_EXP_MAX
    assert choose_scale_exp(1e38, 4) == wire.SCALE_EXP_MIN
    with pytest.raises(ValueError):
        choose_scale_exp(float("nan"), 4)
    with pytest.raises(ValueError):
        choose_scale_exp(1.0, wire.MAX_WORKERS + 1)
    # the chosen scale leaves room for the headroom: quantizing max_abs does not clip
    s = choose_scale_exp(3.7, 8)
    q, rem = quantize(np.array([3.7, -3.7], np.float32), s, 8)
    assert np.all(np.abs(q) <= clip_bound(8) // 2) and np.all(np.abs(rem) <= 2.0**-s)
