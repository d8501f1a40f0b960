"""The augmentation pipeline, one implementation shared by the local loader and the DPU service so
both produce bit-identical batches by construction.

Determinism: epoch ``e`` of seed ``s`` visits the samples in ``default_rng([s, e]).permutation(n)``;
batch ``b`` of that epoch draws all its random numbers (crop offsets, flips, noise, in that order) from
``default_rng([s, e, b])``. A batch therefore depends only on (seed, epoch, batch index), never on
which batches were computed before it or where: a consumer can resume at any batch, on any machine,
and get exactly what it would have got. Every step is vectorized over the batch (no per-sample Python).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dosa.errors import DosaError

from .datasets import Split, load_dataset

MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class AugmentConfig:
    """What to do to each training batch. ``crop_padding``: zero-pad by this many pixels, then take a
    random crop of the original size; ``flip``: mirror horizontally with probability 1/2;
    ``noise_std``: add gaussian noise (in [0, 1] pixel units) before normalization; ``normalize``:
    subtract the per-channel mean and divide by the per-channel std of the training split."""

    crop_padding: int = 2
    flip: bool = True
    noise_std: float = 0.05
    normalize: bool = True

    def __post_init__(self):
        if not isinstance(self.crop_padding, int) or not 0 <= self.crop_padding <= 64:
            raise DosaError(f"crop_padding must be an integer in [0, 64], not {self.crop_padding!r}")
        if not (isinstance(self.noise_std, (int, float)) and 0 <= self.noise_std <= 10):
            raise DosaError(f"noise_std must be a number in [0, 10], not {self.noise_std!r}")

    @classmethod
    def evaluation(cls) -> "AugmentConfig":
        """Validation batches: normalization only, nothing random."""
        return cls(crop_padding=0, flip=False, noise_std=0.0, normalize=True)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "AugmentConfig":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise DosaError("an augmentation config must be a mapping of its fields")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise DosaError(f"unknown augmentation option(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(crop_padding=int(d.get("crop_padding", cls.crop_padding)),
                   flip=bool(d.get("flip", cls.flip)),
                   noise_std=float(d.get("noise_std", cls.noise_std)),
                   normalize=bool(d.get("normalize", cls.normalize)))


def channel_stats(split: Split) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of a split in [0, 1] pixel units (float32, std floored at 1e-6)."""
    x = split.x
    scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
    mean = x.mean(axis=(0, 2, 3), dtype=np.float64) * scale
    sq = np.square(x, dtype=np.float64).mean(axis=(0, 2, 3)) * scale * scale
    std = np.sqrt(np.maximum(sq - mean * mean, 1e-12))
    return mean.astype(np.float32), np.maximum(std, 1e-6).astype(np.float32)


def augment_batch(x: np.ndarray, cfg: AugmentConfig, rng: np.random.Generator,
                  mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Augment one batch ``x`` (B, C, H, W) uint8 or float; returns a new float32 array."""
    out = x.astype(np.float32)
    if x.dtype == np.uint8:
        out *= np.float32(1.0 / 255.0)
    b, c, h, w = out.shape
    p = cfg.crop_padding
    if p:
        padded = np.pad(out, ((0, 0), (0, 0), (p, p), (p, p)))
        oy = rng.integers(0, 2 * p + 1, size=b)
        ox = rng.integers(0, 2 * p + 1, size=b)
        windows = sliding_window_view(padded, (h, w), axis=(2, 3))  # (B, C, 2p+1, 2p+1, H, W)
        out = windows[np.arange(b), :, oy, ox]  # one gather: (B, C, H, W)
    if cfg.flip:
        flip = rng.random(b) < 0.5
        out[flip] = out[flip][..., ::-1]
    if cfg.noise_std:
        noise = rng.standard_normal(out.shape, dtype=np.float32)
        noise *= np.float32(cfg.noise_std)
        out += noise
    if cfg.normalize:
        out -= mean.reshape(1, c, 1, 1)
        out *= (np.float32(1.0) / std).reshape(1, c, 1, 1)
    return out


class BatchPipeline:
    """The batches of one split: ``batch(epoch, b)`` -> (x float32, y int64, ids int64), where ids
    are the sample indices in the split (what tests use to check that nothing is lost or repeated).

    ``augment=None`` means evaluation batches (normalization only, fixed order, no shuffling)."""

    def __init__(self, split: Split, batch_size: int, seed: int, augment: AugmentConfig | None,
                 drop_last: bool = False, stats: tuple[np.ndarray, np.ndarray] | None = None):
        if not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH:
            raise DosaError(f"batch_size must be an integer in [1, {MAX_BATCH}], not {batch_size!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise DosaError(f"seed must be a non-negative integer, not {seed!r}")
        if len(split) == 0:
            raise DosaError("the dataset split is empty")
        self.split = split
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = augment is not None
        self.cfg = augment if augment is not None else AugmentConfig.evaluation()
        self.drop_last = drop_last
        self.mean, self.std = stats if stats is not None else channel_stats(split)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order), swapped atomically

    def __len__(self) -> int:
        n = len(self.split)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (cached for the latest epoch; safe from several threads)."""
        cached = self._order
        if cached is None or cached[0] != epoch:
            n = len(self.split)
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n)
                      if self.shuffle else np.arange(n))
            self._order = cached
        return cached[1]

    def batch(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(epoch, int) or epoch < 0:
            raise DosaError(f"epoch must be a non-negative integer, not {epoch!r}")
        if not isinstance(index, int) or not 0 <= index < len(self):
            raise DosaError(f"batch index {index!r} is outside [0, {len(self)})")
        ids = self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        rng = np.random.default_rng([self.seed, epoch, index])
        x = augment_batch(self.split.x[ids], self.cfg, rng, self.mean, self.std)
        return x, self.split.y[ids], ids.astype(np.int64)

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for b in range(start, len(self)):
            yield self.batch(epoch, b)


@lru_cache(maxsize=8)
def _train_stats(dataset: str) -> tuple[np.ndarray, np.ndarray]:
    return channel_stats(load_dataset(dataset).train)


def make_pipeline(dataset: str, split: str, batch_size: int, seed: int,
                  augment: AugmentConfig | dict | None, drop_last: bool = False) -> BatchPipeline:
    """The one way both sides build a pipeline: the same dataset spec, split and parameters give the
    same batches. Normalization always uses the training split's statistics (also for validation)."""
    ds = load_dataset(dataset)
    if isinstance(augment, dict):
        augment = AugmentConfig.from_dict(augment)
    return BatchPipeline(ds.split(split), batch_size, seed, augment, drop_last=drop_last,
                         stats=_train_stats(dataset))
