"""Dataflow offload, the host side and what host and DPU share: data augmentation and validation
run on the DPU's cores (the servers are dpu_fw/offload), the host trains on.

``client``: OffloadedLoader, OffloadedValidator (with a local fallback) and LocalLoader; ``launcher``:
OffloadServices, which starts the DPU's two servers as subprocesses; shared with the DPU side:
``augment`` (the one augmentation pipeline), ``protocol`` (framing of the TCP stream), ``datasets``,
``models`` (the model family the validation side rebuilds) and ``evaluate`` (the one evaluation).
A training loop using them is examples/train_offload.py. See docs/offload.md."""
from .client import (LocalLoader, OffloadedLoader, OffloadedValidator, OffloadFallbackWarning, ServiceLost,
                     ServiceRefused, ValidationHandle)
from .launcher import OffloadServices

__all__ = ["LocalLoader", "OffloadedLoader", "OffloadedValidator", "OffloadFallbackWarning", "OffloadServices",
           "ServiceLost", "ServiceRefused", "ValidationHandle"]
