"""Float32 <-> int32 fixed point, as the wire carries it (docs/protocol.md, "Fixed point").

``value = clip(round(x * 2^s), -C, C)`` with ``C = floor((2^31 - 1) / W)`` for ``W`` workers, so the
DPU's sum of ``W`` values always fits an s32. What the integer cannot carry (rounding error and the
clipped excess) is returned as a float32 *remainder* that the caller adds back to its residual, so
nothing is ever lost, only delayed.

Conservation law (tested with hypothesis in tests/unit/test_quantize.py)::

    float64(q * 2^-s) + float64(remainder) == float64(x)        exactly

* Unclipped entries: ``q * 2^-s`` and ``x`` are both multiples of ``min(ulp(x), 2^-s)`` and differ by
  at most ``min(|x|, 2^-s / 2)``, so the difference has fewer than 24 significant bits: an exact
  float32.
* Clipped entries: clipping to exactly ``C`` would NOT be exact (``C`` is odd, ``x`` is coarse at that
  magnitude, the difference can need 30 bits). So a clipped entry is clipped to ``C`` rounded down to
  a multiple of ``G = max(1, ulp(x) * 2^s)`` (a power of two): ``q * 2^-s`` is then a multiple of
  ``ulp(x)`` below ``|x|`` and the remainder is exact again. This costs at most a factor 2 of the clip
  bound and in practice a relative ``2^-22`` (``G <= 2C / 2^23`` whenever ``x`` is clipped by up to 2x).
* Only when ``G > C`` (x clipped by a factor above 2^23, i.e. a scale wildly wrong for the data) is
  ``q = +-C`` and the remainder the float32 nearest to ``x - q * 2^-s``; the law then holds to within
  half an ulp of ``x``.

NaN or Inf input raises ValueError naming how many and where the first is: a non-finite gradient is
a training bug that must not be summed into everybody's model.
"""
from __future__ import annotations

import math

import numpy as np

from host_lib._select import quantize_into
from dosa.wire import INT32_MAX, MAX_WORKERS, SCALE_EXP_MAX, SCALE_EXP_MIN


def clip_bound(workers: int) -> int:
    """Largest |value| a host may send so that the sum over ``workers`` hosts fits an s32."""
    if not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    return INT32_MAX // int(workers)


def _check_scale(scale_exp) -> int:
    s = int(scale_exp)
    if s != scale_exp or not SCALE_EXP_MIN <= s <= SCALE_EXP_MAX:
        raise ValueError(f"scale_exp {scale_exp!r} must be an integer in {SCALE_EXP_MIN}..{SCALE_EXP_MAX}")
    return s


def check_finite(values: np.ndarray, what: str = "values") -> None:
    """Raise ValueError naming the number of NaN/Inf entries and the first one's index."""
    if values.size and not np.isfinite(values).all():
        bad = ~np.isfinite(values)
        first = int(np.argmax(bad.reshape(-1)))
        raise ValueError(f"{what} has {int(bad.sum())} non-finite (NaN/Inf) entries, the first at "
                         f"index {first} ({values.reshape(-1)[first]})")


def quantize(values, scale_exp: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 ``values`` to (q int32, remainder float32); see the module docstring.

    Args:
        values: float32 array (other float dtypes are converted to float32 first).
        scale_exp: s, the same for every worker of the round.
        workers: W, the number of hosts whose values the DPU sums (sets the clip bound).
    Returns:
        ``q``, same shape, |q| <= clip_bound(W); ``remainder``, float32, what the residual must keep.
    """
    s = _check_scale(scale_exp)
    c = clip_bound(workers)
    x = np.asarray(values, dtype=np.float32)
    check_finite(x)
    # the rule itself is C, defined once in host_lib/_select.pyx (dosa_quantize1) for this and the
    # encoder's fused pass; float64 throughout, so the remainder is the float32 of an exact difference
    q = np.empty(x.shape, np.int32)
    rem = np.empty(x.shape, np.float32)
    quantize_into(np.ascontiguousarray(x).reshape(-1), s, float(c), q.reshape(-1), rem.reshape(-1))
    return q, rem


def dequantize(q, scale_exp: int) -> np.ndarray:
    """``q * 2^-s`` as float32 (nearest float32: a 31-bit q may not fit a 24-bit significand)."""
    s = _check_scale(scale_exp)
    return np.ldexp(np.asarray(q).astype(np.float64), -s).astype(np.float32)


def choose_scale_exp(max_abs: float, workers: int, headroom: float = 2.0) -> int:
    """Largest s with ``headroom * max_abs * 2^s <= clip_bound(workers)``, clamped to the wire range.

    Every host evaluates this on the previous round's *result* (which all hosts share), so all pick
    the same s without talking. ``max_abs == 0`` gives SCALE_EXP_MAX.
    """
    c = clip_bound(workers)
    max_abs = float(max_abs)
    if not math.isfinite(max_abs) or max_abs < 0:
        raise ValueError(f"max_abs must be finite and >= 0, got {max_abs}")
    if not math.isfinite(headroom) or headroom <= 0:
        raise ValueError(f"headroom must be positive, got {headroom}")
    if workers > MAX_WORKERS:
        raise ValueError(f"workers {workers} exceeds the protocol maximum {MAX_WORKERS}")
    m = headroom * max_abs
    if m == 0:
        return SCALE_EXP_MAX
    s = math.floor(math.log2(c / m))
    while s > SCALE_EXP_MIN and math.ldexp(m, s) > c:  # fix log2 rounding either way
        s -= 1
    while s < SCALE_EXP_MAX and math.ldexp(m, s + 1) <= c:
        s += 1
    return max(SCALE_EXP_MIN, min(SCALE_EXP_MAX, s))
