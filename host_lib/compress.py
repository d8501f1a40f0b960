"""Top-k selection on host (numpy) arrays: the selectors behind host_lib.encoder.RoundEncoder.

``target_k`` is the one rule for how many entries a density means (every path uses it through
the encoder). Selection (``select_topk``):

* ``"exact"``: ``np.argpartition`` of ``|a|``: the reference, O(n) but with several 25M-entry
  temporaries; ~0.3-1 s for 25M float32 on this machine.
* ``"fast"``: estimate the threshold ``t`` as the (1 - density) quantile of ``|a|`` over a random
  sample (``sample_size(k)`` entries in aligned runs of 8 at uniform random places; ~1000 sampled
  entries lie above ``t``, so the selected count has a relative spread of a few %), then ONE pass of the
  Cython kernel ``host_lib._select`` collects every ``|a[i]| >= t``. The result is guarded: above
  ``1 + tolerance`` times k it is trimmed to exactly k by an exact top-k among the candidates (cheap:
  they are few); below ``1 - tolerance`` a second pass runs with a lower threshold and is trimmed.
  So the count is always within ``[k(1-tol), k(1+tol)]`` unless fewer than ``k(1-tol)`` entries are
  non-zero (zeros are never selected by the fast method: sending them would be pure waste).
  The selected set is exactly "every entry above a threshold", i.e. the exact top-c for its count c.

Error feedback: what is not sent stays in a float32 residual ``r`` and is added to the next gradient
(``a = g + r``), so every gradient entry is eventually applied (Deep Gradient Compression, Stich et al.).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_lib._select import add_select_abs_ge, sample_runs, select_abs_ge
from host_lib.quantize import check_finite

METHODS = ("exact", "fast")
#: Below this many entries the fast method just runs the exact one (sampling would not pay off).
FAST_MIN_NUMEL = 1 << 16
#: The fast method samples runs of this many contiguous entries.
SAMPLE_RUN = 8


def target_k(numel: int, density: float) -> int:
    """Entries to select: round(density * numel), at least 1 when density > 0 and numel > 0."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    if numel == 0 or density == 0.0:
        return 0
    return min(numel, max(1, int(round(density * numel))))


def sample_size(numel: int, k: int) -> int:
    """Sample enough entries that ~1000 of them lie above the threshold (clamped to 64K..2M)."""
    if k == 0:
        return 0
    return int(min(numel, max(1 << 16, min(2_000_000, 1000 * numel // k))))


def _exact_topk_positions(absvals: np.ndarray, k: int) -> np.ndarray:
    n = len(absvals)
    if k >= n:
        return np.arange(n)
    return np.sort(np.argpartition(absvals, n - k)[n - k:])


def topk_exact(a: np.ndarray, k: int) -> np.ndarray:
    """Indices (uint32, ascending) of the k largest |a| (ties broken arbitrarily)."""
    a = _as_flat_f32(a)
    check_finite(a)
    if k <= 0:
        return np.zeros(0, np.uint32)
    return _exact_topk_positions(np.abs(a), k).astype(np.uint32)


@dataclass
class FastStats:
    """What the last fast selection did (for logs, benchmarks and tests)."""

    threshold: float = 0.0
    passes: int = 0
    trimmed: bool = False
    candidates: int = 0


def _quantile_threshold(sample_abs: np.ndarray, frac: float) -> float:
    """|a| value above which a fraction ``frac`` of the sample lies (0 -> tiny positive: no zeros)."""
    m = len(sample_abs)
    above = int(np.clip(np.ceil(frac * m), 1, m))
    t = float(np.partition(sample_abs, m - above)[m - above])
    return max(t, float(np.finfo(np.float32).smallest_subnormal))


def _sample(a: np.ndarray, k: int, rng: np.random.Generator, residual=None) -> np.ndarray:
    """|a (+ residual)| at ``sample_size(n, k)`` entries: aligned runs of SAMPLE_RUN (8) contiguous
    entries at random places, one cache line per run instead of one per entry; runs this short
    keep the count's spread close to an i.i.d. sample (measured +-6% at k/n=0.001). Non-finite
    values come out as 0 (the selection pass reports them)."""
    n = len(a)
    usable = n - n % SAMPLE_RUN
    rows = rng.integers(0, usable // SAMPLE_RUN, max(1, sample_size(n, k) // SAMPLE_RUN))
    sample = np.empty(len(rows) * SAMPLE_RUN, np.float32)
    sample_runs(a, residual, rows, SAMPLE_RUN, sample)  # |a (+ r)| of each run
    if not np.isfinite(sample).all():
        sample = np.where(np.isfinite(sample), sample, 0)
    return sample


def sampled_threshold(a: np.ndarray, k: int, *, rng: np.random.Generator,
                      residual: np.ndarray | None = None) -> float:
    """The fast selector's threshold for ``k`` of ``a`` (+ ``residual``, as the fused pass will
    add it): the (1 - k/n) quantile of a random sample of |a (+ r)| (module docstring). What
    ``topk_fast`` runs before its pass, for callers that run the pass range by range."""
    a = _as_flat_f32(a)
    if k <= 0 or not len(a):
        return float("inf")
    return _quantile_threshold(_sample(a, k, rng, residual), k / len(a))


def collect_above(a: np.ndarray, t: float, cap: int, *, residual_out: np.ndarray | None = None,
                  offset: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Every entry with ``|a| >= t`` (``|a + r|`` with ``residual_out`` r, which the same pass sets
    to ``r + a``): (indices u32 ascending, values f32, passes). One pass of host_lib._select into
    room for ``cap`` hits; more hits than that are all collected by a second pass over what the
    first left (pages not written are never touched, so a generous ``cap`` costs little).
    Non-finite entries raise ValueError naming the first (its index + ``offset``: ``a`` may be a
    slice of the gradient)."""
    idx, val = np.empty(cap, np.uint32), np.empty(cap, np.float32)
    if residual_out is not None:
        c, bad, first = add_select_abs_ge(residual_out, a, t, idx, val)
        src = residual_out
    else:
        c, bad, first = select_abs_ge(a, t, idx, val)
        src = a
    _raise_nonfinite(bad, first + offset)
    if c <= cap:
        return idx[:c], val[:c], 1
    idx, val = np.empty(c, np.uint32), np.empty(c, np.float32)
    c, _, _ = select_abs_ge(src, t, idx, val)
    return idx[:c], val[:c], 2


def topk_fast(a: np.ndarray, k: int, *, rng: np.random.Generator | None = None, tolerance: float = 0.2,
              residual_out: np.ndarray | None = None, stats: FastStats | None = None,
              ) -> tuple[np.ndarray, np.ndarray]:
    """Approximate top-k: (indices uint32 ascending, values float32) of ~k entries with the largest |a|.

    With ``residual_out`` (float32, same length, the error-feedback residual r), ``a`` is the
    gradient g and the kernel first does ``r += g`` in the same pass; the selection is on the sum.
    See the module docstring for the algorithm and its accuracy guarantee.
    """
    rng = rng if rng is not None else np.random.default_rng()
    stats = stats if stats is not None else FastStats()
    a = _as_flat_f32(a)
    n = len(a)
    if residual_out is not None and (residual_out.dtype != np.float32 or residual_out.shape != (n,)
                                     or not residual_out.flags.c_contiguous):
        raise ValueError("residual_out must be a C-contiguous float32 array of the gradient's length")
    if k <= 0 or n == 0:
        if residual_out is not None:  # r += a all the same (and its check)
            collect_above(a, np.inf, 0, residual_out=residual_out)
        else:
            check_finite(a)
        return np.zeros(0, np.uint32), np.zeros(0, np.float32)

    if k >= n:  # density 1: everything, zeros included (t = -1 selects every finite entry)
        idx, val, _ = collect_above(a, -1.0, n, residual_out=residual_out)
        stats.passes, stats.trimmed, stats.candidates, stats.threshold = 1, False, len(idx), 0.0
        return idx, val

    frac = k / n
    sample = _sample(a, k, rng, residual_out)
    t = _quantile_threshold(sample, frac)
    cap = int(k * (1 + tolerance)) + 1024
    idx, val, passes = collect_above(a, t, cap, residual_out=residual_out)
    src = residual_out if residual_out is not None else a  # a + r lives in r from here on
    lo_ok = int(np.floor(k * (1 - tolerance)))
    if len(idx) < lo_ok:
        # Too few: lower the threshold (aim at 2k, enough margin for a 4-sigma sampling miss) and
        # collect again; the trim below brings it back to k.
        t = _quantile_threshold(sample, min(1.0, 2 * frac * max(1.0, k / max(len(idx), 1))))
        idx, val, more = collect_above(src, t, max(cap, 4 * k + 1024))
        passes += more
    c = len(idx)
    stats.passes = passes
    stats.candidates = c
    stats.trimmed = False
    if c > k * (1 + tolerance) or (stats.passes > 1 and c > k):
        keep = _exact_topk_positions(np.abs(val), k)
        idx, val = idx[keep], val[keep]
        stats.trimmed = True
    stats.threshold = t
    return idx, val


def _raise_nonfinite(bad: int, first: int) -> None:
    if bad:
        raise ValueError(f"gradient has {bad} non-finite (NaN/Inf) entries, the first at index {first}")


def _as_flat_f32(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        if not np.issubdtype(a.dtype, np.floating) and a.size:
            raise ValueError(f"gradient must be a floating-point array, got {a.dtype}")
        a = a.astype(np.float32)
    a = np.ascontiguousarray(a).reshape(-1)
    if len(a) > 2**32:
        raise ValueError("gradient has more entries than a u32 index can address")
    return a


def select_topk(a, density: float, method: str = "fast", *, rng=None, residual_out=None,
                stats: FastStats | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Select ~density * len(a) entries of largest magnitude: (indices u32 ascending, values f32).

    ``method="exact"`` selects exactly k; ``"fast"`` within +-20% of k (module docstring). With
    ``residual_out``, ``a`` is added into it first (fused for the fast method) and the selection is
    made on the sum; the caller then zeroes (or sets to the quantization remainder) the selected
    entries of the residual.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    a = _as_flat_f32(a)
    k = target_k(len(a), density)
    if method == "fast" and len(a) >= FAST_MIN_NUMEL:
        return topk_fast(a, k, rng=rng, residual_out=residual_out, stats=stats)
    if residual_out is not None:
        with np.errstate(over="ignore"):  # checked before it is stored: r + g may overflow to Inf
            total = residual_out + a
        check_finite(total, "gradient + residual")
        residual_out[...] = total
        a = residual_out
    idx = topk_exact(a, k)
    return idx, a[idx]
