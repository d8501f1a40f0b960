"""The retransmission timer of a host's rounds, as TCP computes it (RFC 6298).

Why: a fixed timer is either too slow (a 200 ms timer made every lost packet of a 6 ms round cost
200 ms) or too eager on a slow path. Each partition whose result completes without any resend is a
round-trip sample (send of its data to the last result packet in, Karn's rule: never a sample
from a partition that was resent); ``rto = srtt + max(G, 4 * rttvar)``, clamped to
[``lo``, ``hi``]. Before the first sample the client's ``retx_interval`` is the timer.
"""
from __future__ import annotations

ALPHA = 1 / 8
BETA = 1 / 4
GRANULARITY_S = 0.001
MIN_RTO_S = 0.004
MAX_RTO_S = 1.0


class RttEstimator:
    def __init__(self, initial: float, lo: float = MIN_RTO_S, hi: float = MAX_RTO_S):
        if not 0 < lo <= hi or initial <= 0:
            raise ValueError("RTO bounds and the initial timer must be positive, lo <= hi")
        self.initial = float(initial)
        self.lo, self.hi = float(lo), float(hi)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = 0

    def sample(self, r: float) -> None:
        r = max(0.0, float(r))
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = (1 - BETA) * self.rttvar + BETA * abs(self.srtt - r)
            self.srtt = (1 - ALPHA) * self.srtt + ALPHA * r
        self.samples += 1

    @property
    def rto(self) -> float:
        if self.srtt is None:
            return self.initial
        return min(self.hi, max(self.lo, self.srtt + max(GRANULARITY_S, 4 * self.rttvar)))
