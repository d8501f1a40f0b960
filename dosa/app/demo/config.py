"""What ``dosa demo`` runs (DemoConfig, checked on construction) and where (choose_backend)."""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

from dosa.errors import DosaError
from dosa.job import RESULT_MODES, ResultMode

BACKENDS = ("auto", "testbed", "loopback")
TARGET_POINTS = 1.0  #: dosa's accuracy must be within this many points of dense


@dataclass
class DemoConfig:
    """What ``dosa demo`` runs. Validated on construction (a DosaError names the bad value)."""

    hosts: int = 4
    dpus: int = 1
    density: float = 0.01
    epochs: int = 20
    batch_size: int = 8
    warmup_steps: int = 0
    hidden: int = 128
    seed: int = 0
    out: str = "out/demo"
    backend: str = "auto"
    offload: bool = False
    timeout: float = 900.0
    mode: str = "sum"
    testbed_prefix: str = "dosademo"
    extra_train_args: list[str] = field(default_factory=list)
    #: --offload: the image workload (digits upsampled: at 8x8 augmentation costs nothing worth
    #: offloading), its epochs and per-host batch size
    offload_dataset: str = "digits:size=32,channels=3"
    offload_epochs: int = 5
    offload_batch_size: int = 32
    #: after the comparison (testbed only): time to accuracy of a 1M-parameter CNN on shaped links,
    #: benchmarks/train.py at demo size (these methods, this many epochs); empty: skip
    tta_methods: str = "dosa_sum,gloo_dense"
    tta_epochs: int = 12

    def __post_init__(self):
        if not 2 <= self.hosts <= 64:
            raise DosaError(f"--hosts must be between 2 and 64, got {self.hosts}")
        if not 1 <= self.dpus <= 16:
            raise DosaError(f"--dpus must be between 1 and 16, got {self.dpus}")
        if not (isinstance(self.density, (int, float)) and 0 < self.density <= 1):
            raise DosaError(f"--density must lie in (0, 1], got {self.density}")
        if self.epochs < 1 or self.batch_size < 1 or self.warmup_steps < 0 or self.hidden < 1:
            raise DosaError("--epochs, --batch-size and --hidden must be >= 1, --warmup-steps >= 0")
        if self.backend not in BACKENDS:
            raise DosaError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.mode not in RESULT_MODES:
            raise DosaError(f"--mode must be sum or gtopk, got {self.mode!r}")
        if not self.timeout > 0:
            raise DosaError(f"--timeout must be positive, got {self.timeout}")
        if self.offload_epochs < 1 or self.offload_batch_size < 1:
            raise DosaError("--offload-epochs and --offload-batch-size must be >= 1")

    @property
    def numel(self) -> int:
        """Gradient entries of examples.train_digits.DigitsMLP(hidden): the dosa job's size."""
        h = self.hidden
        return 64 * h + h + h * h + h + h * 10 + 10

    def train_argv(self, json_path: str) -> list[str]:
        return [sys.executable, "-m", "examples.train_digits", "--comm", "dosa,dense",
                "--density", repr(float(self.density)), "--epochs", str(self.epochs),
                "--batch-size", str(self.batch_size), "--warmup-steps", str(self.warmup_steps),
                "--hidden", str(self.hidden), "--seed", str(self.seed), "--json", json_path,
                *(["--partition-size", str(self.partition_size)] if self.dpus > 1 else []),
                *(["--mode", self.mode] if self.mode != ResultMode.SUM else []),
                *self.extra_train_args]

    @property
    def partition_size(self) -> int:
        """One partition per DPU: the model is small, so the default 64k partition would leave
        every DPU but the first idle."""
        return math.ceil(self.numel / self.dpus)



def choose_backend(requested: str) -> tuple[str, str]:
    """(backend, why). ``auto`` takes the testbed when it can run here, loopback otherwise."""
    if requested != "auto":
        return requested, "requested"
    if os.geteuid() != 0:
        return "loopback", "not root: namespaces need root"
    try:
        import testbed.core  # noqa: F401
    except ImportError as e:
        return "loopback", f"the testbed is not installed ({e})"
    return "testbed", "root"
