"""The numeric half of the DDP hook: one step's flat gradient (+ residual) -> the sparse int32
contribution the DPU sums, and the DPU's result -> the averaged dense gradient + the new residual.

Kept apart from ``torch_hook`` so it can be tested without torch.distributed, and so the
compressor/quantizer of host_lib can be swapped in without touching the hook's DDP logic.
Fixed point follows docs/protocol.md: ``value = clip(round(x * 2^s), -C, C)`` with
``C = floor((2^31 - 1) / W)``; everything not transmitted (unselected entries, rounding error,
clipped part, entries a ``gtopk`` DPU did not return) goes back into the residual.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dosa import wire
from host_lib import quantize

SCALE_EXP_MIN = wire.SCALE_EXP_MIN
SCALE_EXP_MAX = wire.SCALE_EXP_MAX
#: First round's exponent when neither the user nor the client says: 2^-20 resolution, values up
#: to ~2^9 / W (gradients are far smaller; larger parts are clipped into the residual, not lost).
DEFAULT_SCALE_EXP = 20

#: Counters read from the client's ``stats`` (attribute or dict) into DosaHookStats.
_COUNTERS = ("bytes_sent", "bytes_received", "retransmissions")


@dataclass
class Encoded:
    """One host's contribution to a round."""

    indices: np.ndarray  #: u32, strictly ascending, absolute positions in the flat gradient
    values: np.ndarray  #: i32 fixed point
    scale_exp: int
    residual: np.ndarray  #: float32, acc minus what ``values`` represent


def select_topk(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the ``k`` largest ``|acc|``; exact (argpartition).

    Exact selection costs O(n) and is what the hook uses for the model sizes it is meant for
    (up to a few million entries per step); host_lib's approximate selector is the choice beyond."""
    n = acc.size
    if k >= n:
        return np.arange(n, dtype=np.uint32)
    part = np.argpartition(np.abs(acc), n - k)[n - k:]
    part.sort()
    return part.astype(np.uint32)


def encode(acc: np.ndarray, density: float, scale_exp: int, world_size: int) -> Encoded:
    """Sparsify (exact top-k of ``|acc|``) and quantize ``acc`` (= gradient + residual, float32, 1-D)
    with ``host_lib.quantize`` (its clip rule keeps the remainder exact).

    Raises:
        ValueError: when ``acc`` has NaN or Inf entries (a diverged model: better stop loudly than
            send garbage into every replica).
    """
    quantize.check_finite(acc, "gradient")
    n = acc.size
    k = max(1, int(round(density * n))) if n else 0
    idx = select_topk(acc, k) if n else np.zeros(0, np.uint32)
    q, rem = quantize.quantize(acc[idx], scale_exp, world_size)
    residual = acc.copy()
    residual[idx] = rem
    nz = q != 0  # a zero carries nothing; its remainder (the whole value) stays in the residual
    return Encoded(indices=idx[nz], values=q[nz], scale_exp=int(scale_exp), residual=residual)


def decode(numel: int, enc: Encoded, res_indices, res_sums, world_size: int
           ) -> tuple[np.ndarray, np.ndarray, float]:
    """Turn the round's result into (averaged dense float32 gradient, new residual, max |sum|).

    Entries this host sent whose index is missing from the result (a ``gtopk`` DPU returns only the
    largest sums) are folded back into the residual, so they are sent again later."""
    res_indices = np.asarray(res_indices, dtype=np.int64)
    sums = np.asarray(res_sums, dtype=np.float64) * math.ldexp(1.0, -enc.scale_exp)
    if res_indices.size and (res_indices.min() < 0 or res_indices.max() >= numel):
        raise ValueError(f"dosa result has indices outside [0, {numel})")
    avg = np.zeros(numel, dtype=np.float32)
    avg[res_indices] = (sums / world_size).astype(np.float32)
    residual = enc.residual
    if enc.indices.size:
        returned = np.isin(enc.indices, res_indices, assume_unique=True)
        if not returned.all():
            lost = enc.indices[~returned]
            residual[lost] += (enc.values[~returned].astype(np.float64)
                               * math.ldexp(1.0, -enc.scale_exp)).astype(np.float32)
    max_abs = float(np.abs(sums).max()) if sums.size else 0.0
    return avg, residual, max_abs


def next_scale_exp(max_abs_sum: float, world_size: int, headroom: float, current: int) -> int:
    """Exponent of the next round, from data every rank holds identically (this round's sums):
    ``host_lib.quantize.choose_scale_exp``, the rule of docs/protocol.md. Kept unchanged when the
    round summed to nothing (no information about the gradients' magnitude)."""
    if max_abs_sum <= 0.0:
        return current
    return quantize.choose_scale_exp(max_abs_sum, world_size, headroom=headroom)


def initial_scale_exp(client) -> int:
    """The job's initial exponent, if the client knows it (from the control plane)."""
    for name in ("initial_scale_exp", "scale_exp"):
        v = getattr(client, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return DEFAULT_SCALE_EXP


def client_counters(client) -> dict[str, int]:
    """The client's cumulative traffic counters we report (missing ones read as 0)."""
    stats = getattr(client, "stats", None)
    if callable(stats):
        stats = stats()
    out = {}
    for name in _COUNTERS:
        if isinstance(stats, dict):
            v = stats.get(name, 0)
        else:
            v = getattr(stats, name, 0)
        out[name] = int(v or 0)
    return out
