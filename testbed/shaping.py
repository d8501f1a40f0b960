"""Link shaping: parse the user's rate/delay/loss/reorder numbers and turn them into tc commands.

Several mechanisms, because kernels differ (the one this was written on has HTB, tbf, fifo and
cls_bpf but no netem, fq or etf):

- rate: a ``tbf`` qdisc on the egress of both ends of the link (the node's eth0, the bridge port);
- loss and duplication: a small tc BPF program (testbed/impair.c) on both hooks of the bridge port,
  which needs only clsact + cls_bpf (present wherever XDP is);
- reordering (without --delay): an ``htb`` qdisc instead of the tbf on the same two egresses, with a
  fast default class (the link rate, or unlimited) and a slow class whose hard rate is the reordered
  share of the link; impair.c's ``reorder`` classifier sends a random share of the UDP packets into
  the slow class, where they wait while later packets pass (see ``htb_commands``);
- delay: ``netem`` (root, with the tbf as its child: the layout the netem documentation gives for
  "delay then rate limit"; with --reorder, netem's own reordering), only where the kernel has it.
  Nothing else here can hold a packet for a given time (token buckets let a packet through at once
  after an idle period, and fq/etf, which honour a BPF-set departure time, are missing too), so
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


#: HTB reordering layout (htb_commands): class minors, slow-lane sizing.
FAST_CLASS_MINOR = 0x10
SLOW_CLASS_MINOR = 0x20
UNSHAPED_BPS = 100 * 10**9  # "no limit" for HTB's classes on an unshaped link
# the link rate the slow lane is sized for when unshaped: about what a test's Python sender or a
# few ranks push through a veth, so that the reordered share is close to P there (measured: 20%
# per direction -> 35% of h0->h1 datagrams late over two links, 5% -> 10%, 1% -> 1.8%)
UNSHAPED_REF_BPS = 10**8
SLOW_MIN_BPS = 10**6
SLOW_BURST = 1600  # about one full-size frame: a second packet in the slow lane must wait
SLOW_QUEUE_PACKETS = 1000  # as a veth's txqueuelen: the slow lane drops only beyond that
HTB_QUANTUM = 60000  # bytes per round when classes borrow; explicit to avoid r2q warnings


def _thresh(pct: float) -> int:
    """Probability in percent -> threshold on a 32-bit random number (impair.c)."""
    return round(pct / 100 * 2**32)


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
        return cls(rate_bps=parse_rate(rate) if rate else None,
                   delay_s=parse_delay(delay) if delay else 0.0,
                   loss_pct=parse_percent("--loss", loss) if loss is not None else 0.0,
                   dup_pct=parse_percent("--dup", dup) if dup is not None else 0.0,
                   reorder_pct=parse_percent("--reorder", reorder) if reorder is not None else 0.0)

    @property
    def active(self) -> bool:
        return bool(self.rate_bps or self.netem_args() or self.needs_impair or self.reorder_pct)

    @property
    def uses_htb_reorder(self) -> bool:
        """Reordering by the HTB slow lane (every case but --delay, which goes to netem)."""
        return bool(self.reorder_pct and not self.delay_s)

    def slow_lane_bps(self) -> int:
        """Hard rate of the HTB slow class: the reordered share P of the link rate (of
        ``UNSHAPED_REF_BPS`` when the link is unshaped), at least ``SLOW_MIN_BPS``, at most the
        link rate. At that rate the slow lane is exactly loaded when the link is full, so
        reordering costs no throughput at the link rate; a packet in the lane takes 1/P times as
        long as on the link, so one that finds another in the lane is overtaken by ~1/P packets
        (the rarer the pick, the deeper the reordering). A token bucket sends a packet that finds
        the lane idle at once: at a small fraction of the link rate fewer than P arrive late."""
        ref = self.rate_bps or UNSHAPED_REF_BPS
        return min(ref, max(SLOW_MIN_BPS, round(ref * self.reorder_pct / 100)))

    def netem_args(self) -> list[str]:
        a: list[str] = []
        if self.delay_s:
            a += ["delay", f"{self.delay_s * 1e6:.0f}us"]
        if self.reorder_pct and self.delay_s:
            a += ["reorder", f"{self.reorder_pct:g}%"]
        return a

    @property
    def needs_impair(self) -> bool:
        """Loss or duplication: the clsact programs of impair.c on the bridge port."""
        return bool(self.loss_pct or self.dup_pct)

    @property
    def needs_bpf_object(self) -> bool:
        """impair.c must be compiled: for loss/duplication or for the reorder classifier."""
        return self.needs_impair or self.uses_htb_reorder

    def impair_defines(self) -> dict[str, str]:
        """Compile-time constants of testbed/impair.c: probabilities scaled to 2^32 (the reorder
        ones only when the HTB classifier is used; impair.c defaults them to "off")."""
        d = {"LOSS_THRESH": f"{_thresh(self.loss_pct)}ULL",
             "DUP_THRESH": f"{_thresh(self.dup_pct)}ULL"}
        if self.uses_htb_reorder:
            d.update(REORDER_THRESH=f"{_thresh(self.reorder_pct)}ULL",
                     REORDER_MINOR=f"{SLOW_CLASS_MINOR:#x}U")
        return d

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
        if self.uses_htb_reorder:
            return self.htb_commands(dev)
        if self.rate_bps:
            return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", *self.tbf_args()]]
        return []

    def htb_commands(self, dev: str) -> list[list[str]]:
        """The reordering layout: HTB ``1:`` (default class 1:10), parent class 1:1 at the link
        rate, fast class 1:10 (guaranteed the link rate minus the slow lane, may borrow up to the
        link rate, prio 0), slow class 1:20 (hard rate ``slow_lane_bps``, tiny burst so that a
        packet queued behind another waits for it, prio 1), fifos under both. Unshaped links get
        ``UNSHAPED_BPS`` for the parent, i.e. no limit. The classifier is added by
        ``reorder_filter_command`` (it needs the compiled object)."""
        assert self.uses_htb_reorder
        link = self.rate_bps or UNSHAPED_BPS
        slow = self.slow_lane_bps()
        if self.rate_bps:
            burst = max(self.rate_bps // 8 // 1000, 32 * 1024)  # as tbf_args: 1 ms, >= 32 KiB
            # the tbf's 20 ms queue, in bytes (at least 64 KiB)
            fast_q = ["bfifo", "limit", str(max(self.rate_bps // 8 // 50, 64 * 1024))]
        else:
            burst = 256 * 1024
            fast_q = ["pfifo", "limit", "1000"]
        q = ["quantum", str(HTB_QUANTUM)]
        b = ["burst", str(burst), "cburst", str(burst)]
        base = ["dev", dev]
        return [
            ["qdisc", "replace", *base, "root", "handle", "1:", "htb", "default",
             f"{FAST_CLASS_MINOR:x}"],
            ["class", "add", *base, "parent", "1:", "classid", "1:1", "htb",
             "rate", f"{link}bit", "ceil", f"{link}bit", *b, *q],
            ["class", "add", *base, "parent", "1:1", "classid", f"1:{FAST_CLASS_MINOR:x}", "htb",
             "rate", f"{max(link - slow, 8000)}bit", "ceil", f"{link}bit", *b, *q,
             "prio", "0"],
            ["class", "add", *base, "parent", "1:1", "classid", f"1:{SLOW_CLASS_MINOR:x}", "htb",
             "rate", f"{slow}bit", "ceil", f"{slow}bit", "burst", str(SLOW_BURST), "cburst",
             str(SLOW_BURST), *q, "prio", "1"],
            ["qdisc", "add", *base, "parent", f"1:{FAST_CLASS_MINOR:x}",
             "handle", f"{FAST_CLASS_MINOR:x}:", *fast_q],
            ["qdisc", "add", *base, "parent", f"1:{SLOW_CLASS_MINOR:x}",
             "handle", f"{SLOW_CLASS_MINOR:x}:", "pfifo", "limit", str(SLOW_QUEUE_PACKETS)],
        ]

    def reorder_filter_command(self, dev: str, obj: str) -> list[str]:
        """cls_bpf classifier of the HTB: impair.c's ``reorder`` section, direct action. The kernel
        keeps only 16 bits of the tc_classid the program sets, so the filter's own classid
        (1:20) supplies the major number."""
        return ["filter", "add", "dev", dev, "parent", "1:", "bpf", "da", "obj", str(obj),
                "sec", "reorder", "classid", f"1:{SLOW_CLASS_MINOR:x}"]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "Shaping":
        return cls(**(d or {}))
