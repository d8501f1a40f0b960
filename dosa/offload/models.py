"""The model family the validation service can rebuild: a model is described by a small JSON
*spec* and its weights travel as a state dict of named arrays, so the DPU never unpickles code.

Specs:
  {"family": "mlp", "in_shape": [C, H, W], "classes": K, "hidden": [256, 128]}
  {"family": "cnn", "in_shape": [C, H, W], "classes": K, "channels": [16, 32], "hidden": 64}

``evaluate`` is THE evaluation: the service and a local check call the same function on the same
normalized validation batches, so equal snapshots give equal metrics.
"""
from __future__ import annotations

import numpy as np

from dosa.errors import DosaError

MAX_WIDTH = 8192
MAX_LAYERS = 8


def _torch():
    try:
        import torch
    except ImportError:
        raise DosaError("model evaluation needs torch: pip install 'dosa[train]'") from None
    return torch


def _ints(spec: dict, key: str, default, lo: int = 1, hi: int = MAX_WIDTH) -> list[int]:
    v = spec.get(key, default)
    v = [v] if isinstance(v, int) else v
    if not isinstance(v, list) or len(v) > MAX_LAYERS or not all(
            isinstance(i, int) and not isinstance(i, bool) and lo <= i <= hi for i in v):
        raise DosaError(f"model spec {key}={v!r} must be up to {MAX_LAYERS} integers in [{lo}, {hi}]")
    return v


def check_spec(spec: dict) -> dict:
    """Validate a spec (it may come from the network) and return it normalized."""
    if not isinstance(spec, dict):
        raise DosaError("a model spec must be a mapping")
    family = spec.get("family")
    if family not in ("mlp", "cnn"):
        raise DosaError(f"unknown model family {family!r}: use 'mlp' or 'cnn'")
    in_shape = _ints(spec, "in_shape", None, 1, 4096)
    if len(in_shape) != 3:
        raise DosaError(f"model spec in_shape must be [C, H, W], not {in_shape!r}")
    classes = _ints(spec, "classes", 10, 2, 100000)[0]
    out = {"family": family, "in_shape": in_shape, "classes": classes}
    if family == "mlp":
        out["hidden"] = _ints(spec, "hidden", [128], 1)
    else:
        out["channels"] = _ints(spec, "channels", [16, 32], 1, 1024)
        out["hidden"] = _ints(spec, "hidden", 64, 1)[0]
    return out


def build_model(spec: dict):
    """Build an untrained model from a spec; it carries ``model.spec`` for the validator."""
    torch = _torch()
    nn = torch.nn
    spec = check_spec(spec)
    c, h, w = spec["in_shape"]
    layers: list = []
    if spec["family"] == "mlp":
        layers.append(nn.Flatten())
        width = c * h * w
        for hidden in spec["hidden"]:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
    else:
        for ch in spec["channels"]:
            layers += [nn.Conv2d(c, ch, 3, padding=1), nn.ReLU()]
            c = ch
            if h >= 2 and w >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
        layers += [nn.Flatten(), nn.Linear(c * h * w, spec["hidden"]), nn.ReLU()]
        width = spec["hidden"]
    layers.append(nn.Linear(width, spec["classes"]))
    model = nn.Sequential(*layers)
    model.spec = spec
    return model


def state_arrays(model_or_state) -> dict[str, np.ndarray]:
    """A snapshot (copies) of a module's or a state dict's tensors as named numpy arrays."""
    state = model_or_state.state_dict() if hasattr(model_or_state, "state_dict") else model_or_state
    if not isinstance(state, dict):
        raise DosaError("a snapshot must be a torch module or a state dict")
    out = {}
    for name, t in state.items():
        a = t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)
        out[name] = np.array(a, copy=True)
    return out


def load_arrays(model, arrays: dict[str, np.ndarray]) -> None:
    """Load named arrays into ``model``; DosaError unless names and shapes match exactly."""
    torch = _torch()
    own = model.state_dict()
    if set(own) != set(arrays):
        missing, extra = sorted(set(own) - set(arrays)), sorted(set(arrays) - set(own))
        raise DosaError(f"snapshot does not fit the model spec (missing {missing}, unexpected {extra})")
    for name, t in own.items():
        if tuple(arrays[name].shape) != tuple(t.shape):
            raise DosaError(f"snapshot tensor {name} has shape {arrays[name].shape}, "
                            f"the model expects {tuple(t.shape)}")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).to(own[k].dtype)
                           for k, v in arrays.items()})


def evaluate(model, batches) -> dict:
    """Mean cross-entropy loss and accuracy of ``model`` over ``batches`` of (x, y) numpy arrays.

    Losses are summed per batch in float64, in batch order, so the result depends only on the
    snapshot and the data."""
    torch = _torch()
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y, *_ in batches:
            logits = model(torch.from_numpy(x))
            target = torch.from_numpy(y)
            loss_sum += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(dim=1) == target).sum())
            n += len(y)
    if n == 0:
        raise DosaError("nothing to evaluate: the validation split is empty")
    return {"loss": loss_sum / n, "accuracy": correct / n, "samples": n}
