"""SparseStream: one allreduce round whose partitions are handed over while it runs.

A DDP step produces its gradient bucket by bucket during backward. The buckets tile the job's index
space in bucket order, and a partition of that space is independent of the others on the DPU, so a
partition can go out as soon as every bucket overlapping it has been encoded, and its result can be
used as soon as it is back. ``SparseStream`` is that round:

* ``send(indices, values, upto)`` (the training thread) packetizes partitions ``[released, upto)``
  and sends them at once (window permitting);
* a background thread receives, retransmits and times out exactly like a blocking round (it *is* a
  ``host_lib.round.Round``, with ``released`` limiting what may be sent);
* ``wait_for(lo, hi)`` returns a ``concurrent.futures.Future`` of ``(indices, sums)`` of partitions
  ``[lo, hi)``, completed by the background thread as soon as those partitions are in;
* ``finish()`` joins the thread; the client's round number advances when the last partition is in.

The thread is not a daemon (see ``__init__``): a process that returns from ``main`` mid-round
exits once the round completes or times out, instead of aborting inside libtorch.

Thread safety: the round's state is touched only under one lock; the thread holds it for the
bookkeeping of one received batch, never while it waits in ``recv`` (which releases the GIL).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np

from dosa.errors import DosaError
from dosa.packetizer import packetize
from dosa.wire import PacketBatch

from . import _engine
from .round import MAX_SLEEP_S, MIN_SLEEP_S, STALL_CHECK_S, Round
from .round_context import RoundContext


def _range_packets(rnd: Round, indices, values, upto: int, what: str) -> PacketBatch | None:
    """This host's data packets of the next partitions, ``[released, upto)`` of round ``rnd``
    (None: the range is empty). ``what`` names the round in errors ("round", "stream")."""
    c, lo = rnd.ctx, rnd.eng.released
    if not lo <= upto <= rnd.P:
        raise DosaError(f"{what}: partitions must be handed over in order; {lo} are in, asked up "
                        f"to {upto} of {rnd.P}")
    if upto == lo:
        if len(indices):
            raise DosaError(f"{what}: entries given for partitions already handed over")
        return None
    t0 = time.thread_time()
    try:
        b = packetize(indices, values, c.pmap, job_id=c.job.job_id, worker_id=c.worker_id,
                      round=rnd.number, scale_exp=rnd.scale_exp, partitions=np.arange(lo, upto),
                      mtu=c.job.mtu)
    except ValueError as e:
        raise DosaError(f"cannot packetize round {rnd.number}: {e}") from None
    c.stats.phase("packetize", t0)
    return b


class FedRound(Round):
    """One round fed in ascending partition ranges by the caller's own thread, with no thread of
    its own: ``feed`` sends a range at once and takes in whatever results have come back, and
    ``finish`` waits for the rest like a blocking round. A caller that encodes its gradient range by
    range overlaps the encoding of range i + 1 with the network and the DPU working on range i
    (host_lib.client.AggregationClient.open_fed_round). SparseStream is the same with a background
    thread, for DDP's hook, whose caller is backward."""

    def __init__(self, ctx: RoundContext, scale_exp: int, dense_out=None, dense_clear=None):
        super().__init__(ctx, None, int(scale_exp), dense_out, dense_clear)

    def feed(self, indices, values, upto: int) -> None:
        """Add partitions ``[released, upto)`` with this host's entries in them (sorted unique u32
        indices inside those partitions; int32 values), send them, take what has arrived."""
        b = _range_packets(self, indices, values, upto, "round")
        if b is not None:
            self._append(b, upto)
            self._pump(0.0)

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """Wait for every partition's result: (indices u32, sums int32), like allreduce_sparse."""
        if self.eng.released != self.P:
            raise DosaError(f"round: only {self.eng.released} of {self.P} partitions were fed")
        out = self.run()
        self.ctx.stats.rounds += 1
        return out


class SparseStream(Round):
    """A round fed in ascending partition ranges (see the module docstring)."""

    def __init__(self, ctx: RoundContext, scale_exp: int):
        super().__init__(ctx, None, int(scale_exp))
        self._lock = threading.Lock()
        self._waiters: list[tuple[int, int, concurrent.futures.Future]] = []
        self._error: BaseException | None = None
        # Not a daemon: DDP's callbacks run in this thread (it completes the buckets' futures), and
        # a daemon thread still inside libtorch when the interpreter exits aborts the process
        # (CPython 3.11 pthread_exit()s it through C++ frames: "terminate called without an
        # active exception"). The loop ends by itself: round complete, failed, or no progress
        # for the client's timeout, so at worst exit waits that long.
        self._thread = threading.Thread(target=self._loop, name="dosa-stream", daemon=False)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    def send(self, indices, values, upto: int) -> None:
        """Hand over partitions ``[released, upto)`` with this host's entries in them (sorted
        unique u32 indices inside those partitions; int32 values)."""
        b = _range_packets(self, indices, values, upto, "stream")
        if b is None:
            return
        with self._lock:
            if self._error is not None:
                raise DosaError(f"stream: the round already failed: {self._error}")
            self._append(b, upto)
            self._note_gso(self.eng.fill(self.ctx.ep.fd))

    def wait_for(self, lo: int, hi: int) -> concurrent.futures.Future:
        """Future of ``(indices u32, sums int32)`` of partitions ``[lo, hi)``, ascending."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                self._waiters.append((int(lo), int(hi), fut))
                self._complete_waiters()
        return fut

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the background thread (all partitions in, or the round failed)."""
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ background thread
    def _loop(self) -> None:
        c, eng = self.ctx, self.eng
        try:
            while True:
                with self._lock:
                    if eng.released == self.P and eng.complete:
                        break
                    # one non-blocking pass (send, take what arrived) under the lock, so send()
                    # never meets the engine mid-call; the waiting happens outside it
                    flags = self._pump(0.0)
                    if flags & _engine.COMPLETED:
                        self._complete_waiters()
                    now = time.monotonic()
                    stalled = now - eng.last_progress
                    if stalled > STALL_CHECK_S and c.membership is not None:
                        self._check_members(stalled)  # a dead member: say so now
                    if stalled > c.timeout:
                        self._fail()
                    wake = self._retransmit(now, eng.last_progress)
                    if eng.released == self.P and eng.complete:
                        break
                # until the next timer, or a packet (the training thread's sends go out from its
                # own call: nothing here needs to wake for them)
                eng.wait(c.ep.fd, c.ep.mfd, min(max(wake - time.monotonic(), MIN_SLEEP_S), MAX_SLEEP_S))
            c.stats.last_missing = {}
            c.stats.rounds += 1
        except BaseException as e:  # noqa: BLE001 - handed to every waiter, re-raised by finish()
            with self._lock:
                self._error = e
                for _, _, fut in self._waiters:
                    if not fut.done():
                        fut.set_exception(e)

    def _complete_waiters(self) -> None:
        for lo, hi, fut in self._waiters:
            if not fut.done() and hi <= self.eng.released and self.done[lo:hi].all():
                fut.set_result(self.eng.result(lo, hi))
