"""The DDP hook's two records a user reads: what it was told (:class:`HookConfig`, frozen, checked
once) and what it did (:class:`DosaHookStats`).

The configuration is frozen so that the step runner, the bucket encoders and the state all read one
set of hyperparameters that cannot drift during a run (every rank must encode alike); its checks
are the hook's argument checks, each a ``ValueError`` that names the argument. No torch here: the
checks and the statistics are tested without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from host_lib import hook_codec
from host_lib.compress import METHODS


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


@dataclass(frozen=True)
class HookConfig:
    """The hook's hyperparameters (see ``DosaHookState`` for each one's meaning)."""

    density: float = 0.01
    dense_warmup_steps: int = 0
    scale_exp: int | None = None  #: the first dosa round's exponent; None: the client's
    headroom: float = 2.0
    fallback: bool = True
    momentum: float = 0.0
    momentum_masking: bool = True
    job_options: Mapping[str, Any] | None = None
    overlap: bool = True
    method: str = "fast"

    def __post_init__(self):
        d, w, s = self.density, self.dense_warmup_steps, self.scale_exp
        if not _number(d) or not math.isfinite(d) or not 0.0 < d <= 1.0:
            raise ValueError(f"density must be a number in (0, 1], got {d!r}")
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"dense_warmup_steps must be an integer >= 0, got {w!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)
                              or not hook_codec.SCALE_EXP_MIN <= s <= hook_codec.SCALE_EXP_MAX):
            raise ValueError(f"scale_exp must be an integer in [{hook_codec.SCALE_EXP_MIN}, "
                             f"{hook_codec.SCALE_EXP_MAX}], got {s!r}")
        if not _number(self.headroom) or not math.isfinite(self.headroom) or self.headroom < 1.0:
            raise ValueError(f"headroom must be a finite number >= 1, got {self.headroom!r}")
        if not _number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {self.momentum!r}")
        if self.job_options is not None and not isinstance(self.job_options, dict):
            raise ValueError(f"job_options must be a dict, got {type(self.job_options).__name__}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name, kind in (("density", float), ("headroom", float), ("momentum", float),
                           ("fallback", bool), ("momentum_masking", bool), ("overlap", bool)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "job_options", MappingProxyType(dict(self.job_options or {})))


@dataclass
class DosaHookStats:
    """What the hook did so far. Byte counts are UDP payload bytes this host sent/received in dosa
    rounds, as reported by the client (``bytes_sent``/``bytes_received`` counters)."""

    steps: int = 0  #: optimizer steps seen (hook invocations for the last bucket)
    dosa_rounds: int = 0  #: steps whose gradients went through dosa
    overlapped_rounds: int = 0  #: of which streamed bucket by bucket (overlap with backward)
    dense_steps: int = 0  #: steps that used the process group (warm-up or fallback)
    fallbacks: int = 0  #: 1 once the hook fell back to the process group for good
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmissions: int = 0
    #: the client's retransmissions by cause (AggregationClient.retransmit_causes), this hook's run
    retransmit_causes: dict[str, int] = field(default_factory=dict)
    entries_sent: int = 0  #: nonzero (index, value) pairs this host sent
    numel: int = 0  #: size of the whole gradient (all buckets)
    buckets_per_step: int = 0  #: DDP buckets of the last dosa step
    densities: list[float] = field(default_factory=list)  #: sent entries / numel, per dosa round
    residual_remaps: int = 0  #: buckets whose layout changed (DDP rebuilds buckets after step 1)
    hook_seconds: float = 0.0  #: wall time inside the hook in dosa steps: what blocks backward
    hook_seconds_per_step: list[float] = field(default_factory=list)  #: the same, per dosa step
    allreduce_seconds: float = 0.0  #: parked steps: time in the blocking round (client.allreduce_sparse)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["densities"] = list(self.densities)
        d["retransmit_causes"] = dict(self.retransmit_causes)
        d["hook_seconds_per_step"] = list(self.hook_seconds_per_step)
        d["mean_density"] = float(np.mean(self.densities)) if self.densities else 0.0
        d["bytes_per_round"] = ((self.bytes_sent + self.bytes_received) / self.dosa_rounds
                                if self.dosa_rounds else 0.0)
        return d
