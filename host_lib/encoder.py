"""One host's per-round encoding: residual + gradient -> top-k -> fixed point, ready to packetize.

``RoundEncoder.encode(grad, scale_exp)`` does, in order:

1. ``a = g + r`` (fused into the selection pass for the fast method; ``r`` is updated in place),
2. select ~k entries of largest ``|a|`` (host_lib.compress.select_topk),
3. quantize them (host_lib.quantize.quantize): ``q = clip(round(a * 2^s))``,
4. ``r[selected] = remainder`` (rounding error and clipped excess), ``r`` elsewhere keeps ``a``.

So ``float64(q * 2^-s) + r_new == a`` entry by entry (exactly, see host_lib/quantize.py): nothing is
lost. The result ``(indices u32 ascending, q int32, scale_exp)`` goes straight to
``host_lib.packetizer.packetize``.

gtopk mode: the DPU returns only the k largest *sums* of a partition, so some of what a host sent is
not applied this round. ``fold_back(indices, q, scale_exp)`` puts those entries (the host's own
contribution, i.e. what it sent minus what came back) back into the residual so they are sent again
later: error feedback on the aggregate (Shi et al., gTop-k S-SGD).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host_lib.compress import FastStats, METHODS, select_topk
from host_lib.quantize import _check_scale, dequantize, quantize


@dataclass
class EncodedRound:
    """What one host sends in one round."""

    indices: np.ndarray  # uint32, ascending, unique
    values: np.ndarray  # int32 fixed point
    scale_exp: int

    def __len__(self) -> int:
        return len(self.indices)


class RoundEncoder:
    """Per-host state (the residual) and the encode / fold-back steps of each round.

    Args:
        numel: gradient size (flattened).
        density: fraction of entries sent per round, in [0, 1].
        workers: number of hosts summed by the DPU (sets the clip bound).
        method: "exact" or "fast" top-k.
        seed: seeds the fast method's sampling.
    """

    def __init__(self, numel: int, density: float, workers: int, method: str = "fast", seed: int = 0):
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"density must be in [0, 1], got {density}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.numel = int(numel)
        self.density = float(density)
        self.workers = int(workers)
        self.method = method
        self.rng = np.random.default_rng(seed)
        self.residual = np.zeros(self.numel, np.float32)
        self.stats = FastStats()

    def encode(self, grad, scale_exp: int) -> EncodedRound:
        """Fold ``grad`` into the residual, select, quantize; see the module docstring.

        Raises ValueError on a wrong size or NaN/Inf in the gradient (count and first index named).
        With the fast method the finite entries of that gradient may already be in the residual
        (the check is fused into the single pass); call :meth:`reset` to drop them.
        """
        s = _check_scale(scale_exp)
        g = np.asarray(grad)
        if g.size != self.numel:
            raise ValueError(f"gradient has {g.size} entries, the encoder was made for {self.numel}")
        idx, vals = select_topk(g.reshape(-1), self.density, self.method, rng=self.rng,
                                residual_out=self.residual, stats=self.stats)
        q, rem = quantize(vals, s, self.workers)
        self.residual[idx] = rem
        return EncodedRound(idx, q, s)

    def fold_back(self, indices, q, scale_exp: int) -> None:
        """Add ``q * 2^-s`` back into the residual at ``indices`` (unique): entries this host sent
        that the aggregate did not apply (gtopk mode), to be sent again in a later round."""
        s = _check_scale(scale_exp)
        indices = np.asarray(indices)
        q = np.asarray(q)
        if indices.shape != q.shape or indices.ndim != 1:
            raise ValueError(f"indices and q must be 1-D of one length, got {indices.shape} and {q.shape}")
        if len(indices) == 0:
            return
        if int(indices.min()) < 0 or int(indices.max()) >= self.numel:
            raise ValueError(f"fold_back: indices must lie in [0, {self.numel})")
        if len(indices) > 1 and np.unique(indices).size != len(indices):
            raise ValueError("fold_back: indices must be unique")
        self.residual[indices] += dequantize(q, s)

    def unapplied(self, sent: EncodedRound, result_indices) -> tuple[np.ndarray, np.ndarray]:
        """The part of ``sent`` whose indices are not in ``result_indices`` (what gtopk dropped):
        (indices, q) to pass to :meth:`fold_back`."""
        keep = ~np.isin(sent.indices, np.asarray(result_indices), assume_unique=True)
        return sent.indices[keep], sent.values[keep]

    def reset(self) -> None:
        """Zero the residual."""
        self.residual[:] = 0.0
