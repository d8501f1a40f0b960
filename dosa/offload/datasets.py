"""Datasets the offload services serve, named by a short *spec* string so host and DPU can agree on
the data without shipping it: each side loads the same spec itself (the DPU reads its own disk or
package), and only the augmented batches travel.

Specs:
  ``digits``                      scikit-learn's 8x8 digits (bundled with the package, no download)
  ``digits:size=32,channels=3``   the same digits upsampled (bilinear) to size x size with a few
                                  deterministic channels: an image workload where augmentation costs
                                  something real (the 8x8 originals are too small for that)
  ``npz:/path/file.npz``          arrays on disk: ``x`` (N, C, H, W) or (N, H, W), ``y`` (N,) ints;
                                  optional ``x_val``/``y_val``, else a deterministic split is made

Images are kept as uint8 (like decoded image files); augmentation converts them to float32. The
train/validation split is a fixed permutation (seed 0), identical on every machine.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dosa.errors import DosaError

VAL_FRACTION = 0.2
SPLIT_SEED = 0
MAX_UPSCALE = 256
MAX_CHANNELS = 8


@dataclass(frozen=True)
class Split:
    """One split of a dataset. ``x`` (N, C, H, W) uint8 or float32; ``y`` (N,) int64."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.x.shape[1:])  # type: ignore[return-value]


@dataclass(frozen=True)
class Dataset:
    spec: str
    train: Split
    val: Split
    classes: int

    def split(self, name: str) -> Split:
        if name not in ("train", "val"):
            raise DosaError(f"unknown split {name!r}: use 'train' or 'val'")
        return self.train if name == "train" else self.val


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:k=v,k=v"`` -> (name, {k: v}); ``npz:PATH`` keeps the path whole."""
    if not isinstance(spec, str) or not spec:
        raise DosaError("a dataset spec must be a non-empty string such as 'digits'")
    name, _, rest = spec.partition(":")
    if name == "npz":
        if not rest:
            raise DosaError("the npz dataset needs a path: 'npz:/path/file.npz'")
        return name, {"path": rest}
    opts: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise DosaError(f"dataset option {item!r} in {spec!r} is not key=value")
        opts[key.strip()] = value.strip()
    return name, opts


@lru_cache(maxsize=4)
def load_dataset(spec: str) -> Dataset:
    """Load (and cache) the dataset named by ``spec``; raises DosaError for a bad spec or file."""
    name, opts = parse_spec(spec)
    if name == "digits":
        unknown = set(opts) - {"size", "channels"}
        if unknown:
            raise DosaError(f"unknown digits option(s) {sorted(unknown)}: use size=, channels=")
        size = _int_opt(opts, "size", 8, 8, MAX_UPSCALE)
        channels = _int_opt(opts, "channels", 1, 1, MAX_CHANNELS)
        x, y = _digits(size, channels)
        train, val = _split(x, y)
        return Dataset(spec, train, val, 10)
    if name == "npz":
        return _load_npz(spec, opts["path"])
    raise DosaError(f"unknown dataset {name!r}: use 'digits', 'digits:size=32,channels=3' or 'npz:PATH'")


def _int_opt(opts: dict[str, str], key: str, default: int, lo: int, hi: int) -> int:
    raw = opts.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DosaError(f"dataset option {key}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise DosaError(f"dataset option {key}={value} is outside [{lo}, {hi}]")
    return value


def _interp_matrix(src: int, dst: int) -> np.ndarray:
    """(dst, src) bilinear interpolation weights, pixel centres aligned (like align_corners=False)."""
    pos = (np.arange(dst) + 0.5) * (src / dst) - 0.5
    pos = np.clip(pos, 0, src - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, src - 1)
    frac = pos - lo
    m = np.zeros((dst, src))
    m[np.arange(dst), lo] += 1 - frac
    m[np.arange(dst), hi] += frac
    return m


def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 8, 8) in 0..16, labels). Reads the CSV scikit-learn bundles directly when it can:
    importing sklearn costs seconds, which every service start would pay; load_digits otherwise."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DosaError("the digits dataset needs scikit-learn: pip install 'dosa[train]'")
    for root in spec.submodule_search_locations or []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            data = np.loadtxt(path, delimiter=",", dtype=np.float64)
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.images, d.target.astype(np.int64)


def _digits(size: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    images, target = _digits_raw()
    img = images.astype(np.float64) / 16.0  # (N, 8, 8) in [0, 1]
    if size != 8:
        m = _interp_matrix(8, size)
        img = np.einsum("ij,njk,lk->nil", m, img, m, optimize=True)
    chans = [img]
    if channels > 1:
        # Extra channels are fixed functions of the digit (inverted, shifted, textured) so the
        # data stays learnable and fully deterministic.
        texture = np.random.default_rng(1234).random((size, size))
        for c in range(1, channels):
            kind = c % 3
            if kind == 1:
                chans.append(1.0 - img)
            elif kind == 2:
                chans.append(np.roll(img, shift=c, axis=2))
            else:
                chans.append(0.5 * img + 0.5 * np.roll(texture, shift=c, axis=0))
    x = np.clip(np.stack(chans, axis=1) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return x, target


def _split(x: np.ndarray, y: np.ndarray) -> tuple[Split, Split]:
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_val = max(1, int(round(len(y) * VAL_FRACTION)))
    val, train = perm[:n_val], perm[n_val:]
    return (Split(np.ascontiguousarray(x[train]), y[train]),
            Split(np.ascontiguousarray(x[val]), y[val]))


def _as_images(x: np.ndarray, what: str) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DosaError(f"{what} must have shape (N, C, H, W) or (N, H, W), not {x.shape}")
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
    return np.ascontiguousarray(x)


def _labels(y: np.ndarray, n: int, what: str) -> np.ndarray:
    if y.ndim != 1 or y.shape[0] != n or not np.issubdtype(y.dtype, np.integer):
        raise DosaError(f"{what} must be a 1-D integer array of {n} labels")
    if n and y.min() < 0:
        raise DosaError(f"{what} has negative labels")
    return y.astype(np.int64)


def _load_npz(spec: str, path: str) -> Dataset:
    if not os.path.isfile(path):
        raise DosaError(f"dataset file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise DosaError(f"cannot read {path} as an .npz of arrays: {e}") from None
    if "x" not in arrays or "y" not in arrays:
        raise DosaError(f"{path} must contain arrays 'x' and 'y'")
    x = _as_images(arrays["x"], f"{path}:x")
    y = _labels(arrays["y"], len(x), f"{path}:y")
    if "x_val" in arrays and "y_val" in arrays:
        xv = _as_images(arrays["x_val"], f"{path}:x_val")
        yv = _labels(arrays["y_val"], len(xv), f"{path}:y_val")
        if xv.shape[1:] != x.shape[1:] or xv.dtype != x.dtype:
            raise DosaError(f"{path}: x_val must match x in shape and dtype")
        train, val = Split(x, y), Split(xv, yv)
    else:
        if len(y) < 2:
            raise DosaError(f"{path} needs at least 2 samples to split into train and validation")
        train, val = _split(x, y)
    classes = int(max(train.y.max(initial=0), val.y.max(initial=0))) + 1
    return Dataset(spec, train, val, classes)
