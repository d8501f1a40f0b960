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
from dosa.wire import HEADER_DTYPE, MAX_PACKETS_PER_CONTRIBUTION, PacketBatch

from .round import STALL_CHECK_S, Round


class SparseStream(Round):
    """A round fed in ascending partition ranges (see the module docstring)."""

    def __init__(self, client, scale_exp: int):
        super().__init__(client, PacketBatch.empty(0), int(scale_exp))
        self.released = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[int, int, concurrent.futures.Future]] = []
        self._progress = time.monotonic()
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
        if not self.released <= upto <= self.P:
            raise DosaError(f"stream: partitions must be handed over in order; {self.released} "
                            f"are out, asked up to {upto} of {self.P}")
        if upto == self.released:
            if len(indices):
                raise DosaError("stream: entries given for partitions already sent")
            return
        try:
            b = packetize(indices, values, self.c.pmap, job_id=self.c.job.job_id,
                          worker_id=self.c.worker_id, round=self.c.round, scale_exp=self.scale_exp,
                          partitions=np.arange(self.released, upto), mtu=self.c.job.mtu)
        except ValueError as e:
            raise DosaError(f"cannot packetize round {self.c.round}: {e}") from None
        with self._lock:
            if self._error is not None:
                raise DosaError(f"stream: the round already failed: {self._error}")
            self.batch = b if not len(self.batch) else PacketBatch(
                np.concatenate([self.batch.data, b.data]), np.concatenate([self.batch.lengths, b.lengths]),
                np.concatenate([self.batch.dest, b.dest]))
            part = self.batch.data.view(HEADER_DTYPE)[:, 0]["partition"].astype(np.int64)
            self.pk_start = np.searchsorted(part, np.arange(self.P + 1))
            self.released = upto
            self._progress = time.monotonic()
            self._fill_window()

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
        c = self.c
        try:
            while True:
                with self._lock:
                    if self.released == self.P and self.done.all():
                        break
                    self._fill_window()
                b, sip, _ = c.ep.recv(min(c.rtt.rto / 2, 0.005))
                with self._lock:
                    if len(b) and self._absorb(b, sip):
                        self._progress = time.monotonic()
                        self._complete_waiters()
                    now = time.monotonic()
                    if now - self._progress > STALL_CHECK_S and c.membership is not None:
                        self._check_members(now - self._progress)  # a dead member: say so now
                    if now - self._progress > c.timeout:
                        self._fail()
                    self._retransmit(now, self._progress)
            c.last_missing = {}
            c.round += 1
        except BaseException as e:  # noqa: BLE001 - handed to every waiter, re-raised by finish()
            with self._lock:
                self._error = e
                for _, _, fut in self._waiters:
                    if not fut.done():
                        fut.set_exception(e)

    def _complete_waiters(self) -> None:
        for lo, hi, fut in self._waiters:
            if not fut.done() and hi <= self.released and self.done[lo:hi].all():
                fut.set_result(self._decode_range(lo, hi))

    def _decode_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Round._decode restricted to the result packets of partitions [lo, hi)."""
        kept = (self.raw, self.raw_key)
        klo, khi = lo * MAX_PACKETS_PER_CONTRIBUTION, hi * MAX_PACKETS_PER_CONTRIBUTION
        sel = [(r[m], k[m]) for r, k in zip(*kept) for m in [(k >= klo) & (k < khi)] if m.any()]
        try:
            self.raw = [s[0] for s in sel]
            self.raw_key = [s[1] for s in sel]
            return self._decode()
        finally:
            self.raw, self.raw_key = kept
