"""What the DDP hook needs from the client and the wire besides the encoder (host_lib.encoder):
the scale exponent's rule between rounds, the first round's exponent, and the client's counters.

Kept apart from ``torch_hook`` so it can be tested without torch.distributed. Fixed point follows
docs/protocol.md: ``value = clip(round(x * 2^s), -C, C)`` with ``C = floor((2^31 - 1) / W)``.
"""
from __future__ import annotations

from dosa import wire
from dosa.job import DEFAULT_SCALE_EXP as DEFAULT_JOB_SCALE_EXP
from host_lib import quantize

SCALE_EXP_MIN = wire.SCALE_EXP_MIN
SCALE_EXP_MAX = wire.SCALE_EXP_MAX
#: First round's exponent when neither the user nor the client says: the job's default
#: (dosa.job.DEFAULT_SCALE_EXP); what quantizes to 0 or is clipped stays in the residual, not lost.
DEFAULT_SCALE_EXP = DEFAULT_JOB_SCALE_EXP

#: Counters read from the client's ``stats`` (attribute or dict) into DosaHookStats.
_COUNTERS = ("bytes_sent", "bytes_received", "retransmissions")


def next_scale_exp(max_abs_sum: float, world_size: int, headroom: float, current: int) -> int:
    """Exponent of the next round, from data every rank holds identically (this round's sums):
    ``host_lib.quantize.choose_scale_exp``, the rule of docs/protocol.md. Kept unchanged when the
    round summed to nothing (no information about the gradients' magnitude)."""
    if max_abs_sum <= 0.0:
        return current
    return quantize.choose_scale_exp(max_abs_sum, world_size, headroom=headroom)


def initial_scale_exp(client) -> int:
    """The job's initial exponent, if the client knows it (from the control plane)."""
    for name in ("initial_scale_exp", "scale_exp"):
        v = getattr(client, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return DEFAULT_SCALE_EXP


def client_counters(client) -> dict[str, int]:
    """The client's cumulative traffic counters we report (missing ones read as 0)."""
    stats = getattr(client, "stats", None)
    if callable(stats):
        stats = stats()
    out = {}
    for name in _COUNTERS:
        if isinstance(stats, dict):
            v = stats.get(name, 0)
        else:
            v = getattr(stats, name, 0)
        out[name] = int(v or 0)
    return out
