"""Per-host gradients for benchmarks: synthetic with a controllable correlation, or saved from a model.

Why synthetic gradients need structure: sparse allreduce cost depends on how much the hosts' top-k
index sets overlap (the result is their union). Independent noise makes the sets nearly disjoint,
which real training never does; identical gradients make them equal. So each host's gradient is

    g_i = layer_scale * (sqrt(c) * shared + sqrt(1 - c) * noise_i)

with ``c`` the correlation between any two hosts (corr(g_i, g_j) = c before layer scaling). Both
components are heavy-tailed (a Gaussian times a log-normal scale per block of 256 entries: a few
rows/filters carry large gradients, as in real networks), and the whole vector is cut into layers of
different sizes with scales spread over two decades. The layer scales are common to all hosts (they
train the same model), so even c = 0 gives more overlap than random sets would: that too is real.

Everything is deterministic from ``seed``: host i's gradient depends only on (seed, i, numel, c), so
a process can regenerate its own gradient without the others (see :func:`host_gradient`).

Real gradients: :func:`load_gradients` reads ``.npz`` (one array per host, keys sorted naturally, or a
single 2-D array) or a ``torch.save`` of a list of 1-D tensors; :func:`real_model_gradients` produces
such a list from a few data-parallel SGD steps of a small MLP on sklearn's bundled digits data set.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 256  # entries sharing one heavy-tail scale (a "row")
TAIL_SIGMA = 1.0  # sigma of the log-normal block scale: larger = heavier tails
DEFAULT_LAYERS = 16


def _check(world: int, numel: int, correlation: float) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be a positive integer, got {numel!r}")
    if not 0.0 <= float(correlation) <= 1.0:
        raise ValueError(f"correlation must lie in [0, 1], got {correlation!r}")


def _heavy(rng: np.random.Generator, numel: int) -> np.ndarray:
    """Gaussian entries times a log-normal scale per block: heavy-tailed, clustered, float32."""
    x = rng.standard_normal(numel, dtype=np.float32)
    nb = -(-numel // BLOCK)
    s = np.exp(TAIL_SIGMA * rng.standard_normal(nb, dtype=np.float32)).astype(np.float32)
    full = (numel // BLOCK) * BLOCK
    x[:full].reshape(-1, BLOCK)[...] *= s[: full // BLOCK, None]
    if full < numel:
        x[full:] *= s[-1]
    return x


def layer_scales(numel: int, seed: int, layers: int = DEFAULT_LAYERS) -> np.ndarray:
    """Per-entry scale (float32): ``layers`` contiguous layers of random sizes, scales 10^U(-2, 0)."""
    rng = np.random.default_rng([seed, 2**31 - 1])
    layers = max(1, min(layers, numel))
    w = rng.uniform(0.2, 1.0, layers)
    cuts = np.round(np.cumsum(w) / w.sum() * numel).astype(np.int64)
    cuts[-1] = numel
    sizes = np.diff(np.concatenate([[0], cuts]))
    scales = (10.0 ** rng.uniform(-2.0, 0.0, layers)).astype(np.float32)
    return np.repeat(scales, sizes)


def host_gradient(rank: int, world: int, numel: int, correlation: float, seed: int = 0,
                  layers: int = DEFAULT_LAYERS, _shared: np.ndarray | None = None,
                  _scales: np.ndarray | None = None) -> np.ndarray:
    """Host ``rank``'s gradient (float32, ``numel`` entries), independent of the other hosts' calls."""
    _check(world, numel, correlation)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    c = float(correlation)
    shared = _shared if _shared is not None else _heavy(np.random.default_rng([seed, 0]), numel)
    g = _heavy(np.random.default_rng([seed, 1 + rank]), numel)
    g *= np.float32(np.sqrt(1.0 - c))
    g += np.float32(np.sqrt(c)) * shared
    g *= _scales if _scales is not None else layer_scales(numel, seed, layers)
    return g


def make_gradients(world: int, numel: int, correlation: float = 0.5, seed: int = 0,
                   layers: int = DEFAULT_LAYERS) -> list[np.ndarray]:
    """All hosts' gradients (see the module docstring for the model). Shared parts are built once."""
    _check(world, numel, correlation)
    shared = _heavy(np.random.default_rng([seed, 0]), numel)
    scales = layer_scales(numel, seed, layers)
    return [host_gradient(r, world, numel, correlation, seed, layers, _shared=shared, _scales=scales)
            for r in range(world)]


# --------------------------------------------------------------------------------------------------
# Top-k and overlap
# --------------------------------------------------------------------------------------------------
def k_for(numel: int, density: float) -> int:
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must lie in (0, 1], got {density!r}")
    return max(1, int(round(numel * float(density))))


def topk_indices(g: np.ndarray, k: int) -> np.ndarray:
    """Indices (sorted ascending, int64) of the ``k`` largest |g|: exact, via np.argpartition."""
    n = len(g)
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in 1..{n}, got {k}")
    a = np.abs(g)
    idx = np.arange(n) if k == n else np.argpartition(a, n - k)[n - k:]
    idx.sort()
    return idx.astype(np.int64, copy=False)


@dataclass
class Sparse:
    """One host's selected entries: indices sorted ascending (int64), values float32."""

    indices: np.ndarray
    values: np.ndarray


def overlap_stats(index_sets: list[np.ndarray]) -> dict:
    """How much the hosts' index sets overlap.

    ``mean_pairwise_jaccard``: mean over host pairs of |A & B| / |A | B| (1 = identical sets);
    ``union_over_total``: |union| / sum |A_i| (1/W = identical, 1 = disjoint); ``union``: |union|,
    which is the number of entries in a sparse sum result.
    """
    w = len(index_sets)
    if w == 0:
        raise ValueError("no index sets")
    union = np.unique(np.concatenate(index_sets)) if w > 1 else np.unique(index_sets[0])
    total = sum(len(s) for s in index_sets)
    jac = []
    for i in range(w):
        for j in range(i + 1, w):
            inter = len(np.intersect1d(index_sets[i], index_sets[j], assume_unique=True))
            u = len(index_sets[i]) + len(index_sets[j]) - inter
            jac.append(inter / u if u else 1.0)
    return {
        "mean_pairwise_jaccard": float(np.mean(jac)) if jac else 1.0,
        "union": int(len(union)),
        "union_over_total": float(len(union) / total) if total else 0.0,
        "per_host_k": [int(len(s)) for s in index_sets],
    }


def dense_reference(grads: list[np.ndarray]) -> np.ndarray:
    """Sum of the dense gradients in float64 (the reference every dense method is checked against)."""
    ref = np.zeros(len(grads[0]), np.float64)
    for g in grads:
        ref += g
    return ref


def sparse_reference(sparse: list[Sparse], numel: int) -> np.ndarray:
    """Dense float64 sum of every host's selected entries."""
    ref = np.zeros(numel, np.float64)
    for s in sparse:
        ref[s.indices] += s.values
    return ref


# --------------------------------------------------------------------------------------------------
# Saved gradients
# --------------------------------------------------------------------------------------------------
def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _validate(grads: list[np.ndarray], path) -> list[np.ndarray]:
    if len(grads) < 1:
        raise ValueError(f"{path}: holds no gradients")
    out = []
    for i, g in enumerate(grads):
        g = np.asarray(g)
        if g.ndim != 1:
            g = g.reshape(-1)
        if not np.issubdtype(g.dtype, np.floating):
            raise ValueError(f"{path}: gradient {i} has dtype {g.dtype}, expected floating point")
        if not np.isfinite(g).all():
            raise ValueError(f"{path}: gradient {i} holds NaN or infinite values")
        out.append(np.ascontiguousarray(g, np.float32))
    if len({len(g) for g in out}) != 1:
        raise ValueError(f"{path}: hosts' gradients have different lengths {[len(g) for g in out]}")
    return out


def save_gradients(path, grads: list[np.ndarray]) -> Path:
    """Save per-host flat gradients: ``.npz`` (keys host0, host1, ...) or, for other suffixes,
    ``torch.save`` of a list of 1-D float32 tensors."""
    path = Path(path)
    grads = _validate(list(grads), path)
    if path.suffix == ".npz":
        np.savez(path, **{f"host{i}": g for i, g in enumerate(grads)})
    else:
        import torch

        torch.save([torch.from_numpy(g) for g in grads], path)
    return path


def load_gradients(path) -> list[np.ndarray]:
    """Load per-host gradients saved by :func:`save_gradients`, ``np.savez`` or ``torch.save``.

    ``.npz``: one 1-D array per host (taken in natural key order: host2 before host10), or a single
    2-D array (one row per host). Anything else is read with ``torch.load(weights_only=True)`` (numpy
    float arrays allowed) and must be a list/tuple of tensors or arrays, or one 2-D tensor. Raises ValueError with the reason otherwise.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"gradient file {path} does not exist")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                keys = sorted(z.files, key=_natural_key)
                arrs = [z[k] for k in keys]
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable .npz file ({e})") from None
        if len(arrs) == 1 and arrs[0].ndim == 2:
            arrs = list(arrs[0])
        return _validate(arrs, path)
    try:
        import torch

        # numpy arrays are allowed too (a list of arrays is what people torch.save), but nothing
        # else: weights_only refuses arbitrary pickled code
        try:
            from numpy._core.multiarray import _reconstruct  # numpy >= 2
        except ImportError:
            from numpy.core.multiarray import _reconstruct

        floats = [type(np.dtype(t)) for t in (np.float16, np.float32, np.float64)]
        with torch.serialization.safe_globals([_reconstruct, np.ndarray, np.dtype, *floats]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise ValueError(f"{path}: not a .npz and not loadable with torch.load(weights_only=True): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if (hasattr(obj, "dim") or isinstance(obj, np.ndarray)) and obj.ndim == 2:
        obj = list(obj)
    if not isinstance(obj, (list, tuple)) or not all(isinstance(t, np.ndarray) or hasattr(t, "detach")
                                                     for t in obj):
        raise ValueError(f"{path}: expected a list of per-host 1-D tensors or arrays, got {type(obj).__name__}")
    return _validate([t if isinstance(t, np.ndarray) else t.detach().float().numpy() for t in obj], path)


def hidden_for_numel(numel: int) -> tuple[int, int]:
    """Width h of a 64-h-h-10 MLP whose parameter count (h^2 + 76h + 10) is closest to ``numel``."""
    if numel < 1000:
        raise ValueError(f"a real model needs at least 1000 parameters, not {numel}")
    h = int(round((-76 + np.sqrt(76 * 76 - 4 * (10 - numel))) / 2))
    return (max(1, h), max(1, h))


def mlp_numel(hidden: tuple[int, ...]) -> int:
    dims = [64, *hidden, 10]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def real_model_gradients(world: int = 4, steps: int = 5, seed: int = 0, hidden: tuple[int, ...] = (256, 128),
                         batch: int = 64, lr: float = 0.1) -> list[np.ndarray]:
    """Per-host flat gradients of a small MLP on sklearn's digits after ``steps`` data-parallel SGD steps.

    Each host draws its own mini-batches from its own shard of the data; the model is updated with the
    hosts' mean gradient, as DDP would. The gradients returned are each host's at the last step, so
    their correlation and top-k overlap are those of real training. Needs torch and scikit-learn
    (the ``train`` extra); the data ships inside scikit-learn (nothing is downloaded).
    """
    import torch
    from sklearn.datasets import load_digits

    if world < 1 or steps < 1:
        raise ValueError("world and steps must be at least 1")
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    shards = [perm[r::world] for r in range(world)]
    torch.manual_seed(seed)
    dims = [64, *hidden, 10]
    mods = []
    for a, b in zip(dims[:-1], dims[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    params = [p for p in model.parameters()]
    per_host = []
    for _ in range(steps):
        per_host = []
        for r in range(world):
            sel = shards[r][torch.randint(len(shards[r]), (batch,), generator=g)]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[sel]), y[sel]).backward()
            per_host.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        mean = torch.stack(per_host).mean(0)
        with torch.no_grad():
            off = 0
            for p in params:
                p -= lr * mean[off:off + p.numel()].view_as(p)
                off += p.numel()
    return [t.numpy().astype(np.float32) for t in per_host]
