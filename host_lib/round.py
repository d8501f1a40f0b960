"""One allreduce round on one host: what AggregationClient.allreduce_sparse runs and SparseStream
(host_lib/stream.py) extends. ``Round`` holds a round's state, vectorized over partitions and
packets: the bounded window of partitions in flight (gated by the DPUs' aggregation slots), absorbing
result packets, RTT samples, retransmission and NACK/STATUS handling, and the round's failure
(``MissingWorkersError``, or ``StaleJobError`` from the membership).

Loss recovery (docs/dpu_worker.md):
* A partition whose result has not started after ``retx_interval`` s: resend this host's data packets
  (RETRANSMIT flag; the DPU's dedup never adds them twice; a DPU whose round is already complete
  answers from its shadow copy). From the second try on also a RETX_REQUEST(count=0), which a DPU
  answers with the result, or, if the round is incomplete, with a STATUS naming missing workers.
* A partition with some result packets: RETX_REQUEST for the missing result seqs.
* No progress for ``timeout`` s: DosaError naming the incomplete partitions and, from the STATUS
  answers, the workers the DPU is still waiting for. Never a hang.
"""
from __future__ import annotations

import time
import numpy as np

from dosa import wire
from dosa.errors import DosaError
from dosa.packetizer import packetize_control, parse_batch
from dosa.wire import Flags, HEADER_DTYPE, PacketBatch, PacketType

from . import _engine
from .membership import StaleJobError
from .round_context import RoundContext


#: seconds without progress after which a round asks its membership whether a member is gone
STALL_CHECK_S = 0.5
#: least wait before asking for the missing packets of a partial result (reordering grace)
GAP_GRACE_S = 0.002
#: a round's loop sleeps in the engine until its next timer, within these bounds (seconds)
MIN_SLEEP_S = 0.0002
MAX_SLEEP_S = 0.05


class MissingWorkersError(DosaError):
    """A round timed out; ``missing`` lists the worker ids the DPU(s) reported as not delivered."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class Round:
    """The state of one allreduce round on one host: the compiled engine (host_lib/_engine.pyx)
    runs its send / receive / intake loop; this class runs what is rare (STATUS answers,
    retransmission timers, failures) on the engine's state arrays."""

    def __init__(self, ctx: RoundContext, batch: PacketBatch | None, scale_exp: int,
                 dense_out=None, dense_clear=None):
        """``ctx``: what the client hands its rounds (host_lib.round_context); the round adds to
        ``ctx.stats``. ``batch``: every partition's data packets, or None for a round fed in
        ascending partition ranges (``_append``: host_lib.stream). ``dense_out``: also write the
        result into this float32 array, partition by partition as they come in, after zeroing
        there the indices ``dense_clear`` (ascending; what the previous round wrote)."""
        self.ctx = ctx
        self.number = ctx.stats.rounds  #: this round's number (the rounds the client completed)
        self.scale_exp = scale_exp
        P = ctx.pmap.num_partitions
        self.P = P
        self.owner = ctx.owner
        eng = self.eng = ctx.engine
        eng.begin(self.number, int(scale_exp), 0)
        if dense_out is not None:
            eng.dense_output(dense_out, np.zeros(0, np.uint32) if dense_clear is None else dense_clear)
        # the round's data packets, in partition order, in buffers grown as ranges come in
        self._n = 0
        self._rows = PacketBatch.empty(0)
        self.batch = PacketBatch.empty(0)
        self.pk_start = np.zeros(P + 1, np.int64)
        if batch is not None:
            self._append(batch, P)
        # the engine's state (shared arrays: it writes them inside its calls, this class reads them
        # and sets last_tx when it retransmits)
        self.sent = eng.sent.view(bool)
        self.done = eng.done.view(bool)
        self.got = eng.got.view(bool)
        self.res_total = eng.res_total
        self.res_got = eng.res_got
        self.last_tx = eng.last_tx
        self.tries = np.zeros(P, np.int64)
        self.unanswered = np.zeros(P, np.int64)  # RETX_REQUESTs without any answer since last data
        self.missing: dict[int, list[int]] = {}
        self.status_at = np.full(P, -np.inf)  # when the last STATUS of each partition arrived
        self.resent = np.zeros(P, bool)  # data resent or re-requested: no RTT sample (Karn)
        self.last_resend = np.full(P, -np.inf)
        self._cpu = eng.cpu.copy()

    @property
    def released(self) -> int:
        return self.eng.released

    def _append(self, b: PacketBatch, upto: int) -> None:
        """Add the data packets of partitions [released, upto) (``b``, in partition order) and let
        the engine send them. The packets are copied once into buffers that grow by doubling, so a
        round fed range by range costs no more copying than one built at once."""
        lo = self.eng.released
        if not lo <= upto <= self.P:
            raise ValueError(f"partitions must be added in order: {lo} are in, asked up to {upto}")
        n0, n1 = self._n, self._n + len(b)
        rows = self._rows
        if n0 == 0 and upto == self.P:  # the whole round at once (a blocking round): adopt it
            rows = self._rows = b
        elif len(b) and (n1 > len(rows) or b.stride != rows.stride):
            if n0 and b.stride != rows.stride:
                raise ValueError("every packet of a round has the job's MTU: one slot size")
            grown = PacketBatch.empty(max(n1, 2 * len(rows), 64), b.stride)
            if n0:
                grown.data[:n0], grown.lengths[:n0], grown.dest[:n0] = \
                    rows.data[:n0], rows.lengths[:n0], rows.dest[:n0]
            rows = self._rows = grown
        if len(b) and rows is not b:
            rows.data[n0:n1], rows.lengths[n0:n1], rows.dest[n0:n1] = b.data, b.lengths, b.dest
        part = b.data.view(HEADER_DTYPE)[:, 0]["partition"].astype(np.int64) if len(b) \
            else np.zeros(0, np.int64)
        self.pk_start[lo:upto + 1] = n0 + np.searchsorted(part, np.arange(lo, upto + 1))
        self.pk_start[upto + 1:] = n1
        self._n = n1
        self.batch = PacketBatch(rows.data[:n1], rows.lengths[:n1], rows.dest[:n1])
        self.eng.load(self.batch.data, self.batch.lengths, self.batch.dest, self.pk_start)
        self.eng.release(upto)

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        c = self.ctx
        t = time.thread_time()
        wake = time.monotonic() + GAP_GRACE_S
        while True:
            # until the next timer can fire (the engine sends and takes results meanwhile), at most
            # MAX_SLEEP_S: the stall and failure checks below run at least that often; and once
            # results that were coming pause for the gap grace (a gap may show now, whose timer
            # counts from that progress)
            flags = self._pump(min(max(wake - time.monotonic(), MIN_SLEEP_S), MAX_SLEEP_S),
                               quiet=min(GAP_GRACE_S, c.rtt.rto))
            t = time.thread_time()
            if flags & _engine.DONE:
                break
            now = time.monotonic()
            stalled = now - self.eng.last_progress
            if stalled > STALL_CHECK_S and c.membership is not None:
                self._check_members(stalled)
            if stalled > c.timeout:
                self._fail()
            wake = self._retransmit(now, self.eng.last_progress)
            t = c.stats.phase("retransmit", t)
        c.stats.last_missing = {}
        out = self.eng.result()
        c.stats.phase("decode", t)
        return out

    def _pump(self, timeout: float, **kw) -> int:
        """One engine call (send what the window allows, take what arrives, wait up to
        ``timeout``), then what it leaves to Python: STATUS answers, RTT samples, the phases' CPU."""
        c, eng = self.ctx, self.eng
        flags = eng.pump(c.ep.fd, c.ep.mfd, timeout, **kw)
        cpu = eng.cpu.copy()
        d = cpu - self._cpu
        self._cpu = cpu
        for name, dt in zip(("send", "receive", "absorb"), d.tolist()):
            c.stats.phase_cpu[name] = c.stats.phase_cpu.get(name, 0.0) + dt
        self._note_gso(flags)
        if flags & _engine.SIDE:
            n = eng.n_side
            self._statuses(parse_batch(PacketBatch(eng.side_data[:n], eng.side_len[:n],
                                                   np.zeros(n, np.int64)), on_error="drop"))
        if flags & _engine.COMPLETED:
            # RTT samples (Karn): partitions done without any ask, resend or STATUS of ours: their
            # time includes no recovery, ours or (as far as we saw) another host's; one per call,
            # the quickest, so other hosts' lateness inflates the timer as little as it can
            p = eng.completed[:eng.n_completed]
            fresh = p[(self.tries[p] == 0) & ~self.resent[p] & ~np.isfinite(self.status_at[p])]
            if len(fresh):
                c.rtt.sample(float((eng.done_at[fresh] - self.last_tx[fresh]).min()))
        return flags

    def _note_gso(self, flags: int) -> None:
        if flags & _engine.GSO_OFF:  # (the engine's send loop has already gone on without it)
            self.ctx.ep.gso_refused()

    def _send(self, rows: np.ndarray) -> None:
        if self.ctx.rng is not None:
            rows = self.ctx.rng.permutation(rows)
        self.ctx.ep.send_to_table(self.batch, self.ctx.dpu_table, rows)

    def _statuses(self, parsed) -> None:
        """STATUS answers: remember who the DPU waits for; resend our data where it names us."""
        h = parsed.headers
        need = []
        for i in range(len(parsed)):
            p = int(h["partition"][i])
            ws = sorted(int(w) for w in parsed.indices[parsed.offsets[i]:parsed.offsets[i + 1]])
            self.missing[p] = ws
            self.status_at[p] = time.monotonic()
            self.unanswered[p] = 0
            if self.ctx.worker_id in ws and not self.done[p] and self.sent[p] and \
                    time.monotonic() - self.last_resend[p] > GAP_GRACE_S:  # the DPU paces NACKs
                need.append(p)
        if need:  # the DPU lacks (part of) our contribution: it was lost, resend it
            parts = np.unique(need)
            self._resend_data(parts)
            self.ctx.stats.retransmit_causes["resend_nack"] += len(parts)

    def _retransmit(self, now: float, last_progress: float) -> float:
        """Re-request what is overdue. A partition's timer runs from its last send or from the
        round's last progress, whichever is later: while results keep arriving the DPU is busy, not
        lossy, and resending would only add load (a 25M-entry round takes seconds).

        No result yet: ask first, with a tiny RETX_REQUEST(count=0). The DPU answers with the result
        (complete round) or a STATUS naming the workers it waits for; our data packets are resent
        only when that STATUS names us (see _absorb), or when two asks got no answer at all (the
        DPU worker may be restarting; the dataplane still merges). Some result packets: ask for
        the missing seqs.

        Returns the earliest time a timer can fire next, so the caller sleeps until then (in the
        engine, which takes results meanwhile) instead of waking every few ms: progress and sends
        only move timers later."""
        c = self.ctx
        rto = c.rtt.rto
        if now - last_progress <= min(GAP_GRACE_S, rto):
            # nothing can be due: a partition's timer runs from max(its last send, the round's
            # last progress) and waits at least the gap grace or the RTO
            return last_progress + min(GAP_GRACE_S, rto)
        backoff = 2.0 ** np.minimum(self.tries, 1)
        since = now - np.maximum(self.last_tx, last_progress)
        # a visible gap (some of the partition's result packets are in, not all; they come back
        # to back, so the rest is lost or reordered): ask after a reordering grace, not the RTO
        # (the grace doubles per try, up to 16x: a lost request or answer is asked again soon)
        # a partition with no result while a later one of its DPU is done has a visible gap too:
        # every host sends in partition order, so its (one-packet) result was most likely lost
        later_done = np.zeros(self.P, bool)
        if getattr(self, "_by_owner", None) is None:
            self._by_owner = [np.flatnonzero(self.owner == d) for d in np.unique(self.owner).tolist()]
        for own in self._by_owner:
            done_rev = np.logical_or.accumulate(self.done[own][::-1])[::-1]
            later_done[own[:-1]] = done_rev[1:]
            # the DPU's last partition has no later one: the gap shows when all before it are done
            later_done[own[-1]] = len(own) > 1 and self.done[own[:-1]].all()
        gap = (self.res_got > 0) | later_done
        wait = np.where(gap, GAP_GRACE_S * 2.0 ** np.minimum(self.tries, 4), rto * backoff)
        pending = self.sent & ~self.done
        late = since > wait
        due = np.flatnonzero(pending & late)
        waiting = pending & ~late
        # the next timer: a pending partition not due now fires at its own time; one asked for
        # now waits at least the gap grace again
        nxt = float((now - since[waiting] + wait[waiting]).min()) if waiting.any() else np.inf
        if not len(due):
            return nxt
        nxt = min(nxt, now + GAP_GRACE_S)
        nores = due[self.res_got[due] == 0]
        partial = due[self.res_got[due] > 0]
        resend = nores[self.unanswered[nores] >= 2]
        self.unanswered[nores] += 1
        if len(resend):
            self._resend_data(resend)
            c.stats.retransmit_causes["resend_unanswered"] += len(resend)
        if len(nores):
            self._send_retx_all(nores)
            c.stats.retransmit_causes["ask_result"] += len(nores)
        reqs = []
        for p in partial.tolist():
            have = self.got[p, :self.res_total[p]]
            seqs = np.flatnonzero(~have).astype(np.uint32)[:wire.MAX_RETX_ENTRIES]
            reqs.append(self._retx_request(p, seqs))
        if reqs:
            rb = PacketBatch.from_packets([q for q, _ in reqs], dest=[d for _, d in reqs])
            c.ep.send_to_table(rb, c.dpu_table)
            c.stats.retransmissions += len(reqs)
            c.stats.retransmit_causes["ask_packets"] += len(reqs)
        self.last_tx[due] = now
        self.tries[due] += 1
        return nxt

    def _resend_data(self, parts: np.ndarray) -> None:
        """Resend this host's data packets of ``parts`` (RETRANSMIT flag; the DPU never adds a
        packet twice)."""
        starts, ends = self.pk_start[parts], self.pk_start[parts + 1]
        r = np.repeat(starts - np.cumsum(np.r_[0, (ends - starts)[:-1]]), ends - starts) + \
            np.arange(int((ends - starts).sum()))
        hdr = self.batch.data.view(HEADER_DTYPE)[:, 0]
        hdr["flags"][r] = hdr["flags"][r] | int(Flags.RETRANSMIT)
        self._send(r)
        self.unanswered[parts] = 0
        self.resent[parts] = True
        self.last_resend[parts] = time.monotonic()
        self.ctx.stats.retransmissions += len(r)

    def _send_retx_all(self, parts: np.ndarray) -> None:
        """RETX_REQUEST(count=0) for each partition in ``parts``, built vectorized."""
        n = len(parts)
        b = packetize_control(PacketType.RETX_REQUEST, parts, job_id=self.ctx.job.job_id,
                              worker_id=self.ctx.worker_id, round=self.number, dest=self.owner[parts])
        self.ctx.ep.send_to_table(b, self.ctx.dpu_table)
        self.ctx.stats.retransmissions += n

    def _retx_request(self, p: int, seqs: np.ndarray) -> tuple[bytes, int]:
        h = wire.Header(type=PacketType.RETX_REQUEST, job_id=self.ctx.job.job_id,
                        worker_id=self.ctx.worker_id, partition=p, round=self.number, seq=0, total=1)
        return wire.build_packet(h, seqs), int(self.owner[p])

    def _check_members(self, stalled: float) -> None:
        """The round stalls: if the control plane says this host's job is gone, or a member the
        DPU is waiting for is dead or has left, say so now (not after the no-progress timeout)."""
        c = self.ctx
        m = c.membership
        if m.broken is not None:
            raise StaleJobError(f"allreduce round {self.number} of job {c.job.job_id} cannot complete: "
                                f"{m.broken}")
        gone = m.problem()
        if gone is None:
            return
        now = time.monotonic()
        stuck = np.flatnonzero(self.sent & ~self.done)
        fresh = [p for p in stuck.tolist() if now - self.status_at[p] < 1.0]
        waited = {w for p in fresh for w in self.missing.get(p, [])}
        # a member that is gone only matters if the DPU still waits for it (one that crashed or
        # left after delivering does not block this round; results may still be on their way)
        named = sorted(set(gone) & waited)
        if not named:
            return
        c.stats.last_missing = {int(p): self.missing.get(int(p), []) for p in fresh}
        raise MissingWorkersError(
            f"allreduce round {self.number} of job {c.job.job_id} stalled for {stalled:.1f} s: the DPU is "
            f"still waiting for worker(s) {named}: " + "; ".join(gone[w] for w in named), named)

    def _fail(self):
        """Raise the round's timeout, naming the workers the DPUs reported missing recently (a
        STATUS older than half the timeout may be stale: the DPU may have died since)."""
        c = self.ctx
        now = time.monotonic()
        stuck = np.flatnonzero(self.sent & ~self.done)
        fresh = [p for p in stuck.tolist() if now - self.status_at[p] < max(1.0, c.timeout / 2)]
        missing = sorted({w for p in fresh for w in self.missing.get(p, [])})
        c.stats.last_missing = {int(p): self.missing.get(int(p), []) for p in fresh}
        shown = ", ".join(str(p) for p in stuck[:8].tolist()) + (" ..." if len(stuck) > 8 else "")
        silent = sorted({int(self.owner[p]) for p in stuck.tolist()} -
                        {int(self.owner[p]) for p in fresh})
        parts = []
        if missing:
            parts.append(f"the DPU is still waiting for worker(s) {missing}")
        if silent:
            addrs = ", ".join(f"{a}:{b}" for a, b in (c.job.dpus[d] for d in silent))
            parts.append(f"no recent answer from DPU(s) {silent} ({addrs})")
        raise MissingWorkersError(
            f"allreduce round {self.number} of job {c.job.job_id} made no progress for {c.timeout:g} s: "
            f"{len(stuck)} partition(s) incomplete ({shown}); " + "; ".join(parts), missing)
