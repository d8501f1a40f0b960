"""Link shaping: parse the user's rate/delay/loss numbers and turn them into tc commands.

Three mechanisms, because kernels differ (the one this was written on has tbf but no netem):

- rate: a ``tbf`` qdisc on the egress of both ends of the link (the node's eth0, the bridge port);
- loss and duplication: a small tc BPF program (testbed/impair.c) on both hooks of the bridge port,
  which needs only clsact + cls_bpf (present wherever XDP is);
- delay and reordering: ``netem`` (root, with the tbf as its child: the layout the netem
  documentation gives for "delay then rate limit"), only where the kernel has it; otherwise
  ``up`` fails with a clear error instead of silently ignoring the request.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from dosa.errors import DosaError

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|k|m|g|t)(?:bps|bit/s)?$", re.I)
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$", re.I)


def parse_rate(text: str) -> int:
    """``"10gbit"``, ``"100mbit"``, ``"1G"``, ``"2.5g"`` -> bits per second."""
    m = _RATE_RE.match(str(text).strip())
    if not m:
        raise DosaError(f"link rate {text!r} is not a rate like 100mbit, 10gbit or 1G")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    if not 8_000 <= bps <= 400 * 10**9:
        raise DosaError(f"link rate {text!r} is outside 8kbit..400gbit")
    return bps


def parse_delay(text: str) -> float:
    """``"5ms"``, ``"200us"``, ``"0.1s"`` -> seconds."""
    m = _TIME_RE.match(str(text).strip())
    if not m:
        raise DosaError(f"delay {text!r} is not a time like 200us, 5ms or 0.1s")
    sec = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if sec > 10:
        raise DosaError(f"delay {text!r} is longer than 10s")
    return sec


def parse_percent(flag: str, text) -> float:
    """``"1%"``, ``"1"``, ``0.5`` -> percent in [0, 100]."""
    s = str(text).strip().rstrip("%")
    try:
        p = float(s)
    except ValueError:
        raise DosaError(f"{flag} {text!r} is not a percentage like 1% or 0.5") from None
    if not 0 <= p <= 100:
        raise DosaError(f"{flag} must be between 0 and 100 percent, not {text!r}")
    return p


@dataclass(frozen=True)
class Shaping:
    """Per-link impairments. ``rate_bps`` None = unlimited; percentages in [0, 100]."""

    rate_bps: int | None = None
    delay_s: float = 0.0
    loss_pct: float = 0.0
    dup_pct: float = 0.0
    reorder_pct: float = 0.0

    @classmethod
    def parse(cls, rate=None, delay=None, loss=None, dup=None, reorder=None) -> "Shaping":
        s = cls(rate_bps=parse_rate(rate) if rate else None,
                delay_s=parse_delay(delay) if delay else 0.0,
                loss_pct=parse_percent("--loss", loss) if loss is not None else 0.0,
                dup_pct=parse_percent("--dup", dup) if dup is not None else 0.0,
                reorder_pct=parse_percent("--reorder", reorder) if reorder is not None else 0.0)
        if s.reorder_pct and not s.delay_s:
            raise DosaError("--reorder needs --delay: netem reorders by sending some packets "
                            "without the delay")
        return s

    @property
    def active(self) -> bool:
        return bool(self.rate_bps or self.netem_args() or self.needs_impair)

    def netem_args(self) -> list[str]:
        a: list[str] = []
        if self.delay_s:
            a += ["delay", f"{self.delay_s * 1e6:.0f}us"]
        if self.reorder_pct:
            a += ["reorder", f"{self.reorder_pct:g}%"]
        return a

    @property
    def needs_impair(self) -> bool:
        return bool(self.loss_pct or self.dup_pct)

    def impair_defines(self) -> dict[str, str]:
        """Compile-time constants of testbed/impair.c: probabilities scaled to 2^32."""
        return {"LOSS_THRESH": f"{round(self.loss_pct / 100 * 2**32)}ULL",
                "DUP_THRESH": f"{round(self.dup_pct / 100 * 2**32)}ULL"}

    def tbf_args(self) -> list[str]:
        """Token bucket sized to 1 ms of traffic (at least 32 KiB, so a burst of a few jumbo
        GSO segments passes) and a queue of at most 20 ms."""
        assert self.rate_bps
        burst = max(self.rate_bps // 8 // 1000, 32 * 1024)
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst), "latency", "20ms"]

    def qdisc_commands(self, dev: str) -> list[list[str]]:
        """``tc`` argument lists (without the ``tc -n NS`` part) for ``dev``'s egress qdiscs
        (rate, delay, reordering)."""
        netem = self.netem_args()
        if netem and self.rate_bps:
            # netem's queue must hold the packets in flight for the delay at full rate
            limit = max(1000, int(self.rate_bps / 8 / 1000 * max(self.delay_s, 0.001) * 2))
            return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem",
                     "limit", str(limit), *netem],
                    ["qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:",
                     *self.tbf_args()]]
        if netem:
            return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", *netem]]
        if self.rate_bps:
            return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", *self.tbf_args()]]
        return []

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "Shaping":
        return cls(**(d or {}))
