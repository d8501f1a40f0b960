"""What a round gets from the client that starts it, and what it reports back.

A round (``host_lib.round.Round`` and the streamed rounds of ``host_lib.stream``) needs the job,
the UDP endpoint, the compiled engine, the RTT estimate and the membership, and it counts what it
did: the round number it completes, retransmissions by cause, CPU time by phase, the workers a
failed round waited for. The client hands it a :class:`RoundContext` holding exactly these, so a
round never reaches into the client (and the modules import one way: client -> round -> context).
The statistics are one :class:`RoundStats` that the client owns and every round adds to, in place,
while it runs: a streamed round still running when the hook reads the counters shows what it has
done so far, as before.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dosa.job import JobConfig
    from dosa.transport import UdpEndpoint

    from .membership import Membership
    from .rto import RttEstimator


@dataclass
class RoundStats:
    """What a client's rounds did, summed over its rounds."""

    rounds: int = 0  #: completed rounds, which is the next round's number
    retransmissions: int = 0  #: packets (or requests) sent again
    #: the retransmissions by cause: asks for a result not started (``ask_result``), for the
    #: missing packets of a partial one (``ask_packets``), this host's data resent after two
    #: unanswered asks (``resend_unanswered``) or because a STATUS named it (``resend_nack``);
    #: partitions (packets for the resends): where a round's recovery time goes
    retransmit_causes: collections.Counter = field(default_factory=collections.Counter)
    #: CPU seconds (the round's thread, user + sys) by phase: packetize, send, receive (the recv
    #: system calls), absorb (header checks, bookkeeping), retransmit, decode
    phase_cpu: dict[str, float] = field(default_factory=dict)
    #: the last round that failed: partition -> the workers its DPU still waited for
    last_missing: dict[int, list[int]] = field(default_factory=dict)

    def phase(self, name: str, t0: float) -> float:
        """Add this thread's CPU time since ``t0`` to ``phase_cpu[name]``; returns the time now."""
        t = time.thread_time()
        self.phase_cpu[name] = self.phase_cpu.get(name, 0.0) + t - t0
        return t


@dataclass
class RoundContext:
    """Everything one round of worker ``worker_id`` in ``job`` uses (see the module doc)."""

    job: JobConfig
    worker_id: int
    pmap: Any  #: the job's partition map (dosa.wire.PartitionMap), made once by the client
    ep: UdpEndpoint
    engine: Any  #: the client's compiled RoundEngine (host_lib/_engine.pyx), reused by every round
    owner: np.ndarray  #: the DPU of each partition
    dpu_table: tuple  #: the DPUs' addresses as the endpoint's send table (dosa.net.addr_arrays)
    rtt: RttEstimator
    timeout: float  #: seconds without progress before the round fails
    membership: Membership | None
    stats: RoundStats
    rng: np.random.Generator | None = None  #: shuffles every send (a test aid); None: in order
