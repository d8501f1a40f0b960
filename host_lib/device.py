"""One device rule for the host side: torch's.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` compare unequal, yet a tensor made on
"cuda" lives on the current CUDA device and reports ``cuda:N``; a tensor made on "cpu:0" reports
"cpu". Everywhere host_lib compares a gradient's device with where its state lives, both go through
:func:`canonical_device` first, so "cuda" and the current "cuda:N" are one device, as they are to
torch."""
from __future__ import annotations

import torch


def canonical_device(device=None) -> torch.device:
    """The device a tensor made on ``device`` reports: an accelerator without an index is the
    current one of its kind (``cuda`` -> ``cuda:{torch.cuda.current_device()}``), the CPU and the
    meta device have no index. ``None`` is the CPU."""
    d = torch.device("cpu" if device is None else device)
    if d.type in ("cpu", "meta"):
        return torch.device(d.type)
    if d.index is None:
        backend = getattr(torch, d.type, None)  # torch.cuda, torch.xpu: is_available, current_device
        if backend is not None and hasattr(backend, "current_device") and backend.is_available():
            return torch.device(d.type, backend.current_device())
    return d


def same_device(a, b) -> bool:
    """Whether ``a`` and ``b`` (devices or names) are one device by torch's rule."""
    return canonical_device(a) == canonical_device(b)
