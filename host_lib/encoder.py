"""The one encoder of a host's contribution: error feedback + top-k + fixed point, and gtopk fold-back.

Every path that sends a gradient through dosa uses :class:`RoundEncoder`: the DDP hook (one encoder
per gradient bucket), ``AggregationClient.allreduce`` and the benchmarks. ``encode(grad, scale_exp)``
does, in order:

1. momentum correction when ``momentum > 0`` (DGC, Lin et al. 2018): ``u = m*u + g``, and ``g := u``;
2. error feedback: ``a = g + r`` (fused into the selection pass on CPU; ``r`` is updated in place);
3. select ~k entries of largest ``|a|``, k = :func:`host_lib.compress.target_k` (the one k rule:
   ``round(density * numel)``, at least 1);
4. quantize them (``host_lib.quantize.quantize``): ``q = clip(round(a * 2^s))``;
5. ``r[selected] = remainder`` (rounding error and clipped excess); with momentum masking
   ``u[selected] = 0`` (those entries' past must not push them again);
6. entries whose ``q`` is 0 are dropped: they carry nothing, and their value is in ``r`` already.

So ``float64(q * 2^-s) + r_new == a`` entry by entry (host_lib/quantize.py): nothing is lost. The
result ``(indices u32 ascending, q int32, scale_exp)`` goes straight to the packetizer.

**Where it runs.** The residual (float32, whatever the gradient's dtype: bf16/fp16 gradients are
added into a float32 residual) and the velocity live on the gradient's device as torch tensors, and
only the selected entries cross to host memory. Two selectors, chosen by device:

* CPU: the residual's numpy view (zero copy) goes to ``host_lib.compress.select_topk``, whose
  ``fast`` method is the Cython single pass ``host_lib._select`` (adds ``g`` into ``r`` and collects
  every ``|a| >= t`` in one read; measured ~5x ``torch.topk`` at 25M entries, docs/training.md).
* any other device (CUDA): the same algorithm in torch (``_select_torch``): sampled threshold,
  ``nonzero``, trimmed with ``topk`` when over. ``backend="torch"`` forces it on CPU, which is how
  the tests run it here (no GPU on this machine).

gtopk mode: the DPU returns only the k largest *sums* of a partition, so some of what a host sent is
not applied this round. ``fold_back(*unapplied(sent, result_indices), scale_exp)`` puts those entries
back into the residual so they are sent again later (Shi et al., gTop-k S-SGD).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from host_lib.compress import (FAST_MIN_NUMEL, METHODS, FastStats, collect_above, sample_size,
                               sampled_threshold, select_topk, target_k)
from host_lib._select import add_dequantized, missing_from_sorted, quantize_to_residual
from host_lib.device import canonical_device
from host_lib.quantize import _check_scale, clip_bound, dequantize, quantize

BACKENDS = ("auto", "numpy", "torch")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class EncodedRound:
    """What one host sends in one round (host memory)."""

    indices: np.ndarray  # uint32, ascending, unique
    values: np.ndarray  # int32 fixed point, never 0
    scale_exp: int

    def __len__(self) -> int:
        return len(self.indices)


class RoundEncoder:
    """Per-host (or per-bucket) state: the residual, the velocity; the encode / fold-back steps.

    Args:
        numel: gradient size (flattened).
        density: fraction of entries sent per round, in [0, 1].
        workers: number of hosts summed by the DPU (sets the clip bound).
        method: "exact" or "fast" top-k.
        seed: seeds the fast method's sampling.
        device: where the residual lives (default CPU); gradients given must be on it, by torch's
            rule (host_lib.device: "cuda" is the current "cuda:N").
        momentum: DGC momentum correction in [0, 1) (the optimizer must then run without momentum).
        momentum_masking: with momentum, zero the velocity of the entries sent.
        backend: "auto" (numpy + Cython on CPU, torch elsewhere), "numpy" (CPU only) or "torch".
    """

    def __init__(self, numel: int, density: float, workers: int, method: str = "fast", seed: int = 0, *,
                 device=None, momentum: float = 0.0, momentum_masking: bool = True, backend: str = "auto"):
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"density must be in [0, 1], got {density}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.device = canonical_device(device)  # "cuda" is the current cuda:N, as the tensors say
        if backend == "auto":
            backend = "numpy" if self.device.type == "cpu" else "torch"
        if backend == "numpy" and self.device.type != "cpu":
            raise ValueError(f"the numpy backend runs on the CPU only, not on {self.device}")
        self.backend = backend
        self.numel = int(numel)
        self.density = float(density)
        self.workers = int(workers)
        self.method = method
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.rng = np.random.default_rng(seed)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(int(seed))
        self.r = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self.u = torch.zeros_like(self.r) if self.momentum else None
        self.stats = FastStats()

    # ------------------------------------------------------------------ state
    @property
    def residual(self) -> np.ndarray:
        """The residual as a numpy array (a view on CPU, a copy from another device)."""
        return self.r.numpy() if self.device.type == "cpu" else self.r.cpu().numpy()

    def load_state(self, residual: torch.Tensor, velocity: torch.Tensor | None = None) -> None:
        """Take over a residual (and velocity) built elsewhere, e.g. carried over a DDP bucket rebuild."""
        if residual.shape != (self.numel,):
            raise ValueError(f"residual has shape {tuple(residual.shape)}, the encoder has {self.numel} entries")
        self.r = residual.to(self.device, torch.float32).contiguous()
        if self.momentum:
            self.u = (velocity.to(self.device, torch.float32).contiguous() if velocity is not None
                      else torch.zeros_like(self.r))

    def reset(self) -> None:
        """Zero the residual (and velocity)."""
        self.r.zero_()
        if self.u is not None:
            self.u.zero_()

    # ------------------------------------------------------------------ the round
    def encode(self, grad, scale_exp: int) -> EncodedRound:
        """Fold ``grad`` into the residual, select, quantize; see the module docstring.

        ``grad``: a numpy array or a torch tensor of any float dtype, on the encoder's device.
        Raises ValueError on a wrong size or NaN/Inf in the gradient (count and first index named).
        With the fast CPU method the finite entries of that gradient may already be in the residual
        (the check is fused into the single pass); call :meth:`reset` to drop them.
        """
        s = _check_scale(scale_exp)
        g = self._as_tensor(grad)
        if self.u is not None:
            self.u.mul_(self.momentum).add_(g)
            g = self.u
        if self.backend == "numpy":
            gn = g.numpy() if g.dtype == torch.float32 else g.float().numpy()
            rn = self.r.numpy()
            idx, vals = select_topk(gn, self.density, self.method, rng=self.rng,
                                    residual_out=rn, stats=self.stats)
            if self.u is None:
                return EncodedRound(*_quantize_numpy(idx, vals, s, self.workers, rn), s)
            idx_dev = torch.from_numpy(idx.astype(np.int64))
        else:
            idx_dev, vals_dev = _select_torch(self.r, g, target_k(self.numel, self.density),
                                              self.method, self._gen)
            idx = idx_dev.cpu().numpy().astype(np.uint32)
            vals = vals_dev.cpu().numpy()
        q, rem = quantize(vals, s, self.workers)
        self.r[idx_dev] = torch.from_numpy(rem).to(self.device)
        if self.u is not None and self.momentum_masking:
            self.u[idx_dev] = 0.0
        nz = q != 0
        if not nz.all():
            idx, q = idx[nz], q[nz]
        return EncodedRound(idx, q, s)

    def encode_ranges(self, grad, scale_exp: int, bounds):
        """:meth:`encode` cut into index ranges selected one at a time: a generator of
        ``(lo, hi, EncodedRound)`` (indices absolute) for ``bounds`` = ascending, adjacent
        ``(lo, hi)`` covering the gradient. A caller sends range i while range i + 1 is still to be
        selected (host_lib.stream.FedRound), so the network and the DPU work on the first ranges
        while this host encodes the next.

        One threshold for the whole gradient, from one sample as ``encode`` takes it, so the
        selection is the same "every |g + r| at or above t" that one pass makes. What this gives up
        is ``encode``'s guard: a count outside k (1 +- 20%) is not trimmed or re-selected (ranges
        already sent cannot be taken back); the sample keeps it within a few % of k unless the
        gradient's distribution defeats it, and ``stats.candidates`` reports the count. Where the
        fast CPU pass does not apply (exact method, another device, momentum, a small or
        degenerate gradient) the whole gradient is encoded first and sliced."""
        s = _check_scale(scale_exp)
        bounds = [(int(lo), int(hi)) for lo, hi in bounds]
        if bounds and (bounds[0][0] != 0 or bounds[-1][1] != self.numel or
                       any(b[0] != a[1] or b[1] < b[0] for a, b in zip(bounds, bounds[1:]))):
            raise ValueError(f"bounds must be adjacent ranges covering [0, {self.numel})")
        k = target_k(self.numel, self.density)
        g = self._as_tensor(grad)
        if self.backend != "numpy" or self.method != "fast" or self.u is not None or \
                self.numel < FAST_MIN_NUMEL or not 0 < k < self.numel or g.dtype != torch.float32:
            whole = self.encode(g, s)
            for lo, hi in bounds:
                a, b = np.searchsorted(whole.indices, [lo, hi])
                yield lo, hi, EncodedRound(whole.indices[a:b], whole.values[a:b], s)
            return
        gn, rn = g.numpy(), self.r.numpy()
        t = sampled_threshold(gn, k, rng=self.rng, residual=rn)
        self.stats.threshold, self.stats.passes, self.stats.trimmed = t, 1, False
        self.stats.candidates = 0
        for lo, hi in bounds:
            # room for every hit the whole gradient is expected to have: one range may hold most of
            # them (a layer of large gradients); more are collected by a second pass (a NaN raises:
            # ranges before this one may be on their way, the round stops there)
            idx, val, _ = collect_above(gn[lo:hi], t, min(hi - lo, int(k * 1.5) + 4096),
                                        residual_out=rn[lo:hi], offset=lo)
            self.stats.candidates += len(idx)
            idx, q = _quantize_numpy(idx, val, s, self.workers, rn[lo:hi])
            yield lo, hi, EncodedRound(idx + np.uint32(lo), q, s)

    def unapplied(self, sent: EncodedRound, result_indices) -> tuple[np.ndarray, np.ndarray]:
        """The part of ``sent`` whose indices are not in ``result_indices`` (what gtopk dropped):
        (indices, q) to pass to :meth:`fold_back`."""
        a, av = np.asarray(sent.indices), np.asarray(sent.values)
        b = np.asarray(result_indices)
        if a.dtype == np.uint32 and av.dtype == np.int32 and b.dtype == np.uint32:
            out, outv = np.empty(len(a), np.uint32), np.empty(len(a), np.int32)
            try:  # both ascending, as encode() and a round give them: one linear merge
                n = missing_from_sorted(np.ascontiguousarray(a), np.ascontiguousarray(av),
                                        np.ascontiguousarray(b), out, outv)
                return out[:n], outv[:n]
            except ValueError:  # not ascending: the general way below
                pass
        keep = ~np.isin(a, b, assume_unique=True)
        return a[keep], av[keep]

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
        # ascending (as unapplied returns them) proves unique in one pass; other orders pay a sort
        if len(indices) > 1 and not bool((indices[1:] > indices[:-1]).all()) and \
                np.unique(indices).size != len(indices):
            raise ValueError("fold_back: indices must be unique")
        if self.device.type == "cpu":
            # through the residual's zero-copy numpy view, in one compiled pass (torch's indexed
            # add measured 90 ms a round at 100k entries, numpy's fancy += ~5 ms at 150k)
            if indices.dtype == np.uint32 and q.dtype == np.int32:
                add_dequantized(self.r.numpy(), np.ascontiguousarray(indices), np.ascontiguousarray(q), s)
            else:
                self.r.numpy()[indices] += dequantize(q, s)
            return
        at = torch.from_numpy(indices.astype(np.int64)).to(self.device)
        self.r[at] += torch.from_numpy(dequantize(q, s)).to(self.device)

    def _as_tensor(self, grad) -> torch.Tensor:
        """``grad`` as a flat tensor on the encoder's device (zero copy for CPU float32)."""
        if isinstance(grad, torch.Tensor):
            g = grad.detach()
            if g.dtype not in _FLOATS:
                raise ValueError(f"gradient must be a floating-point tensor, got {g.dtype}")
            if canonical_device(g.device) != self.device:
                raise ValueError(f"gradient is on {g.device}, the encoder's residual on {self.device}")
        else:
            a = np.asarray(grad)
            if not np.issubdtype(a.dtype, np.floating) and a.size:
                raise ValueError(f"gradient must be a floating-point array, got {a.dtype}")
            if a.dtype not in (np.float32, np.float64, np.float16):
                a = a.astype(np.float32)
            g = torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        if g.numel() != self.numel:
            raise ValueError(f"gradient has {g.numel()} entries, the encoder was made for {self.numel}")
        g = g.reshape(-1)
        if self.backend == "numpy" and g.dtype != torch.float32:
            g = g.float()
        return g if g.is_contiguous() else g.contiguous()


def _quantize_numpy(idx: np.ndarray, vals: np.ndarray, s: int, workers: int,
                    r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps 4-6 of the module docstring on a CPU residual ``r`` (numpy, indexed by ``idx``):
    (indices, q) of the non-zero q, remainders stored in ``r``. One Cython pass with quantize's
    numbers; a clip or a NaN (-1 from it) takes ``quantize``'s general rule, which reports a NaN."""
    io, qo = np.empty(len(idx), np.uint32), np.empty(len(idx), np.int32)
    c = quantize_to_residual(idx, vals, s, float(clip_bound(workers)), r, io, qo)
    if c >= 0:
        return io[:c], qo[:c]
    q, rem = quantize(vals, s, workers)
    r[idx] = rem
    nz = q != 0
    return idx[nz], q[nz]


def _raise_nonfinite(a: torch.Tensor, what: str) -> None:
    bad = ~torch.isfinite(a)
    n = int(bad.sum())
    if n:
        first = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{what} has {n} non-finite (NaN/Inf) entries, the first at index {first}")


def _select_torch(r: torch.Tensor, g: torch.Tensor, k: int, method: str, gen: torch.Generator,
                  tolerance: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """``r += g`` then ~k entries of largest ``|r|`` on r's device: (indices int64 ascending, values).

    The same contract as host_lib.compress.select_topk: ``exact`` selects exactly k, ``fast``
    estimates the threshold from a random sample, collects ``|r| >= t`` (zeros never) and keeps the
    count within ``k (1 +- tolerance)`` (trimmed by ``topk`` when over, exact when far under)."""
    _raise_nonfinite(g, "gradient")
    total = r + g
    _raise_nonfinite(total, "gradient + residual")
    r.copy_(total)
    n = r.numel()
    if k <= 0 or n == 0:
        return torch.zeros(0, dtype=torch.int64, device=r.device), r[:0]
    mag = r.abs()
    if k >= n:
        idx = torch.arange(n, device=r.device)
    elif method == "exact" or n < FAST_MIN_NUMEL:
        idx = torch.sort(torch.topk(mag, k, sorted=False).indices).values
    else:
        m = sample_size(n, k)
        sample = mag[torch.randint(0, n, (m,), generator=gen, device=r.device)]
        above = max(1, min(m, int(np.ceil(k / n * m))))
        t = torch.kthvalue(sample, m - above + 1).values.clamp_min(torch.finfo(torch.float32).tiny)
        idx = torch.nonzero(mag >= t).reshape(-1)
        c = idx.numel()
        if c > k * (1 + tolerance):
            keep = torch.topk(mag[idx], k, sorted=False).indices
            idx = torch.sort(idx[keep]).values
        elif c < k * (1 - tolerance):
            idx = torch.sort(torch.topk(mag, k, sorted=False).indices).values
    return idx, r[idx]
