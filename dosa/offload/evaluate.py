"""The one evaluation path of a model snapshot on the validation split: the DPU's validation service
(dpu_fw/offload/validation.py) runs it, and so does a host evaluating locally (fallback, or to check
the service), hence equal snapshots give equal metrics."""
from __future__ import annotations

import threading

import numpy as np

from .augment import make_pipeline
from .models import build_model, evaluate, load_arrays

DEFAULT_BATCH = 256

_cache_lock = threading.Lock()
_val_batches: dict[tuple[str, int], list] = {}


def validation_batches(dataset: str, batch_size: int = DEFAULT_BATCH) -> list:
    """The normalized validation batches (computed once per dataset and batch size)."""
    key = (dataset, batch_size)
    with _cache_lock:
        if key not in _val_batches:
            pipe = make_pipeline(dataset, "val", batch_size, 0, None)
            _val_batches[key] = [pipe.batch(0, b)[:2] for b in range(len(pipe))]
        return _val_batches[key]


def evaluate_snapshot(spec: dict, arrays: dict[str, np.ndarray], dataset: str,
                      batch_size: int = DEFAULT_BATCH) -> dict:
    """Rebuild the model from ``spec`` + ``arrays`` and evaluate it on the validation split."""
    model = build_model(spec)
    load_arrays(model, arrays)
    return evaluate(model, validation_batches(dataset, batch_size))
