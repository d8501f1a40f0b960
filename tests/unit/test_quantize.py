"""host_lib.quantize: the fixed-point conservation law of docs/protocol.md, and its edges."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from dosa import wire
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
