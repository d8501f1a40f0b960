"""Each DDP gradient bucket's encoder (``host_lib.encoder.RoundEncoder``: residual, velocity),
kept across steps and across DDP's bucket rebuild.

DDP rebuilds its buckets after the first step (in gradient-ready order), so a bucket index can hold
other parameters from one step to the next. Error feedback must follow the parameters, not the
index: a new encoder takes each of its parameters' residual (and velocity) from the encoder that
held it the step before (:func:`carry_over`), so nothing sent to the residual is lost. The dosa hook
and the DGC-style baseline of ``dosa bench train`` both take their encoders from here, so the two
make the same updates.
"""
from __future__ import annotations

import math

import torch

from host_lib.device import same_device
from host_lib.encoder import RoundEncoder


class BucketEncoders:
    """The encoders of one model's buckets, by bucket index, and the step before's (to carry
    residuals over). ``new_step()`` at a step's first bucket; ``for_bucket`` for each bucket."""

    def __init__(self, density: float, method: str = "fast", momentum: float = 0.0,
                 momentum_masking: bool = True):
        self.density, self.method = density, method
        self.momentum, self.momentum_masking = momentum, momentum_masking
        self.encoders: dict[int, RoundEncoder] = {}  #: bucket index -> residual (+ velocity)
        self.layouts: dict[int, tuple] = {}  #: bucket index -> parameter layout signature
        self._prev: tuple[dict, dict] = ({}, {})

    def new_step(self) -> None:
        """Remember this step's encoders: the next step's rebuilt buckets carry over from them."""
        self._prev = (dict(self.layouts), dict(self.encoders))

    def for_bucket(self, bucket, buf: torch.Tensor, world: int, rank: int) -> tuple[RoundEncoder, bool]:
        """The encoder of ``bucket`` (its buffer ``buf``) and whether a residual was carried over."""
        return bucket_encoder(self.encoders, self.layouts, self._prev, bucket, buf, self.density,
                              world, rank, self.method, self.momentum, self.momentum_masking)

    def __getitem__(self, index: int) -> RoundEncoder:
        return self.encoders[index]

    @property
    def residuals(self) -> dict:
        """Each bucket's residual (numpy; for tests and reports)."""
        return {i: e.residual for i, e in self.encoders.items()}


def bucket_encoder(encoders: dict, layouts: dict, prev: tuple[dict, dict], bucket, buf: torch.Tensor,
                   density: float, world: int, rank: int, method: str, momentum: float,
                   masking: bool) -> tuple[RoundEncoder, bool]:
    """The encoder of DDP bucket ``bucket`` (its buffer ``buf``), from ``encoders``/``layouts``
    (bucket index -> encoder / parameter layout), made anew when the bucket's parameters changed,
    with its parameters' residual (and velocity) carried over from the encoders of ``prev`` (the
    step before's ``(layouts, encoders)``). Seeded by rank and bucket. Returns (encoder, whether a
    residual was carried over)."""
    idx, n = bucket.index(), buf.numel()
    layout = tuple((p.data_ptr(), tuple(p.shape)) for p in bucket.parameters())
    enc = encoders.get(idx)
    if (enc is not None and layouts.get(idx) == layout and enc.numel == n
            and same_device(enc.device, buf.device)):
        return enc, False
    old_layouts, old_encs = prev
    enc = RoundEncoder(n, density, world, method, seed=1000 * rank + idx, device=buf.device,
                       momentum=momentum, momentum_masking=masking)
    enc.load_state(carry_over(old_layouts, {b: e.r for b, e in old_encs.items()}, layout, n),
                   carry_over(old_layouts, {b: e.u for b, e in old_encs.items() if e.u is not None},
                              layout, n) if momentum else None)
    layouts[idx] = layout
    encoders[idx] = enc
    return enc, bool(old_layouts)


def carry_over(old_layouts: dict, old_arrays: dict, layout: tuple, numel: int) -> torch.Tensor:
    """A per-bucket float32 tensor (residual or velocity) for a bucket of ``layout`` (a tuple of
    (data_ptr, shape) per parameter, in bucket order, which is the buffer order), filled from the
    arrays (tensors or numpy) of the old buckets that held the same parameters; zeros where a
    parameter is new. On the old arrays' device (CPU when there are none)."""
    where, device = {}, "cpu"
    for b, lay in old_layouts.items():
        arr = old_arrays.get(b)
        if arr is None:
            continue
        arr = torch.as_tensor(arr)
        device = arr.device
        off = 0
        for key in lay:
            n = math.prod(key[1])
            where[key] = (arr, off, n)
            off += n
    out = torch.zeros(numel, dtype=torch.float32, device=device)
    off = 0
    for key in layout:
        n = math.prod(key[1])
        if key in where:
            arr, o, m = where[key]
            out[off:off + n] = arr[o:o + m]
        off += n
    return out
