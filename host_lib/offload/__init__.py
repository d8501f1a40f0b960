"""Dataflow offload, the host side: data augmentation and validation run on the DPU's cores (the
servers are dpu_fw/offload), the host trains on.

``client``: OffloadedLoader, OffloadedValidator (with a local fallback) and LocalLoader; ``launcher``:
OffloadServices, which starts the DPU's two servers as subprocesses. What host and DPU share (the
augmentation pipeline, the TCP framing, datasets, models, the one evaluation) is dosa.offload, in
the bottom layer. A training loop using them is examples/train_offload.py. See docs/offload.md."""
from .client import (LocalLoader, OffloadedLoader, OffloadedValidator, OffloadFallbackWarning, ServiceLost,
                     ServiceRefused, ValidationHandle)
from .launcher import OffloadServices

__all__ = ["LocalLoader", "OffloadedLoader", "OffloadedValidator", "OffloadFallbackWarning", "OffloadServices",
           "ServiceLost", "ServiceRefused", "ValidationHandle"]
