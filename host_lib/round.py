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
from typing import TYPE_CHECKING

import numpy as np

from dosa import _net, wire
from dosa.errors import DosaError
from dosa.packetizer import packetize_control, parse_batch
from dosa.wire import Flags, HEADER_DTYPE, PacketBatch, PacketType

from . import _round
from .membership import StaleJobError

if TYPE_CHECKING:
    from .client import AggregationClient


#: seconds without progress after which a round asks its membership whether a member is gone
STALL_CHECK_S = 0.5
#: least wait before asking for the missing packets of a partial result (reordering grace)
GAP_GRACE_S = 0.002


class MissingWorkersError(DosaError):
    """A round timed out; ``missing`` lists the worker ids the DPU(s) reported as not delivered."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class Round:
    """The state of one allreduce round on one host (vectorized over partitions and packets)."""

    def __init__(self, client: AggregationClient, batch: PacketBatch, scale_exp: int):
        self.c = client
        self.batch = batch
        self.scale_exp = scale_exp
        P = client.pmap.num_partitions
        self.P = P
        hdr = batch.data.view(HEADER_DTYPE)[:, 0]
        part = hdr["partition"].astype(np.int64)
        self.pk_start = np.searchsorted(part, np.arange(P + 1))
        self.owner = np.asarray(client.pmap.owner(np.arange(P)), np.int64)
        # aggregation slots (docs/dataplane.md, *Slots*): partition p shares its DPU's slot with
        # p - M*S (M DPUs, S slots there), and may be sent only once that one's result is in: a
        # slot's next occupant can complete only when every host sent it, so then every host
        # holds the previous result and the DPU may clear it. gate[p] = that partition, or -1.
        M = client.pmap.num_dpus
        step = M * np.array([client.job.slots_on(d) for d in range(M)], np.int64)[self.owner]
        self.gate = np.where(np.arange(P) >= step, np.arange(P) - step, -1)
        self.sent = np.zeros(P, bool)
        self.done = np.zeros(P, bool)
        self.res_total = np.zeros(P, np.int64)
        self.res_got = np.zeros(P, np.int64)
        self.got = np.zeros((P, wire.MAX_PACKETS_PER_CONTRIBUTION), bool)
        self.last_tx = np.zeros(P)
        self.tries = np.zeros(P, np.int64)
        self.unanswered = np.zeros(P, np.int64)  # RETX_REQUESTs without any answer since last data
        # accepted result packets, kept raw (copied out of the reused receive buffer) and decoded
        # once at the end of the round, in (partition, seq) order: no per-batch entry decoding and
        # no sort of the entries (results are sorted within a partition, partitions are ranges)
        self.raw: list[np.ndarray] = []
        self.raw_key: list[np.ndarray] = []
        self._got_u8 = self.got.view(np.uint8)  # the compiled intake's views of the same state
        self._done_u8 = self.done.view(np.uint8)
        self._scratch = np.empty((4, 0), np.int64)  # its output rows (reused across batches)
        self.next = 0
        self.released = P  # partitions [0, released) may be sent (a SparseStream releases them in ranges)
        self.missing: dict[int, list[int]] = {}
        self.status_at = np.full(P, -np.inf)  # when the last STATUS of each partition arrived
        self.resent = np.zeros(P, bool)  # data resent or re-requested: no RTT sample (Karn)
        self.last_resend = np.full(P, -np.inf)

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        c = self.c
        last_progress = time.monotonic()
        t = time.thread_time()
        while not self.done.all():
            self._fill_window()
            t = c._phase("send", t)
            b, sip, _ = c.ep.recv(min(c.rtt.rto / 2, GAP_GRACE_S))  # wake for the gap grace's timers
            t = c._phase("receive", t)
            if len(b) and self._absorb(b, sip):
                last_progress = time.monotonic()
            t = c._phase("absorb", t)
            now = time.monotonic()
            if now - last_progress > STALL_CHECK_S and c.membership is not None:
                self._check_members(now - last_progress)
            if now - last_progress > c.timeout:
                self._fail()
            self._retransmit(now, last_progress)
            t = c._phase("retransmit", t)
        c.last_missing = {}
        out = self._decode()
        c._phase("decode", t)
        return out

    def _decode(self) -> tuple[np.ndarray, np.ndarray]:
        """The round's result entries, from the raw packets kept by _absorb, sorted by index."""
        if not self.raw:
            return np.zeros(0, np.uint32), np.zeros(0, np.int32)
        data = np.concatenate(self.raw) if len(self.raw) > 1 else self.raw[0]
        order = np.argsort(np.concatenate(self.raw_key), kind="stable")
        hdr = data.view(HEADER_DTYPE)[:, 0][order]
        count = hdr["count"].astype(np.int64)
        m = int(count.sum())
        # where the blocks of each packet start comes from dosa.wire (PAYLOAD_BLOCKS): sparse u16
        # offsets right after the header and the s32 values at value_offset; dense values after it
        dense = hdr["type"] == PacketType.DENSE_RESULT
        offset_at = np.where(dense, -1, wire.HDR_LEN).astype(np.int64)
        value_at = np.where(dense, wire.HDR_LEN, wire.value_offset(count)).astype(np.int64)
        idx, val = np.empty(m, np.uint32), np.empty(m, np.int32)
        # a dense run carries the zero sums of its span too: they are no entries (not written)
        m = _net.decode_entries(data, order.astype(np.int64), count, hdr["base"].astype(np.int64),
                                offset_at, value_at, idx, val, True)
        if m < 0:
            raise DosaError("result packets with more entries than their slots (a bug: headers "
                            "are validated before)")
        idx, val = idx[:m], val[:m]
        if m > 1 and not bool((idx[1:] > idx[:-1]).all()):  # not expected from a DPU: sort anyway
            o = np.argsort(idx, kind="stable")
            idx, val = idx[o], val[o]
        return idx, val

    def _fill_window(self) -> None:
        inflight = int((self.sent & ~self.done).sum())
        room = self.c.window - inflight
        if room <= 0 or self.next >= self.released:
            return
        hi = min(self.released, self.next + room)
        g = self.gate[self.next:hi]
        busy = np.flatnonzero((g >= 0) & ~self.done[np.maximum(g, 0)])
        if len(busy):  # in order: stop at the first partition whose slot is still held
            hi = self.next + int(busy[0])
            if hi == self.next:
                return
        rows = np.arange(self.pk_start[self.next], self.pk_start[hi])
        self._send(rows)
        self.sent[self.next:hi] = True
        self.last_tx[self.next:hi] = time.monotonic()
        self.next = hi

    def _send(self, rows: np.ndarray) -> None:
        if self.c._rng is not None:
            rows = self.c._rng.permutation(rows)
        self.c.ep.send_to_table(self.batch, self.c.dpu_table, rows)

    def _absorb(self, b: PacketBatch, sip) -> bool:
        """Take the new result packets of this round out of a received batch; True on progress.

        One compiled pass over the headers (host_lib/_round.pyx: the header rules are the XDP
        program's generated check): only this round's result packets are validated and kept (raw,
        copied out of the reused receive buffer), STATUS packets are parsed; anything else is
        ignored."""
        n = len(b)
        if not n:
            return False
        sc = self._scratch
        if sc.shape[1] < n:
            sc = self._scratch = np.empty((4, max(n, 2 * sc.shape[1])), np.int64)
        nn, ns, nc = _round.absorb(b.data, b.lengths, n, self.c.job.job_id, self.c.round, self.P,
                                   self.scale_exp, self._got_u8, self._done_u8, self.res_total,
                                   self.res_got, sc[0], sc[1], sc[2], sc[3])
        if ns:
            st = sc[2, :ns]
            self._statuses(parse_batch(PacketBatch(b.data[st], b.lengths[st], b.dest[st]), on_error="drop"))
        if not nn:
            return False
        res = sc[0, :nn]
        self.raw.append(b.data[res])
        self.raw_key.append(sc[1, :nn].copy())
        if nc:
            # RTT samples (Karn): partitions done without any ask, resend or STATUS of ours: their
            # time includes no recovery, ours or (as far as we saw) another host's; one per batch,
            # the quickest, so other hosts' lateness inflates the timer as little as it can
            p = sc[3, :nc]
            fresh = p[(self.tries[p] == 0) & ~self.resent[p] & ~np.isfinite(self.status_at[p])]
            if len(fresh):
                self.c.rtt.sample(time.monotonic() - float(self.last_tx[fresh].max()))
        return True

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
            if self.c.worker_id in ws and not self.done[p] and self.sent[p] and \
                    time.monotonic() - self.last_resend[p] > GAP_GRACE_S:  # the DPU paces NACKs
                need.append(p)
        if need:  # the DPU lacks (part of) our contribution: it was lost, resend it
            parts = np.unique(need)
            self._resend_data(parts)
            self.c.retransmit_causes["resend_nack"] += len(parts)

    def _retransmit(self, now: float, last_progress: float) -> None:
        """Re-request what is overdue. A partition's timer runs from its last send or from the
        round's last progress, whichever is later: while results keep arriving the DPU is busy, not
        lossy, and resending would only add load (a 25M-entry round takes seconds).

        No result yet: ask first, with a tiny RETX_REQUEST(count=0). The DPU answers with the result
        (complete round) or a STATUS naming the workers it waits for; our data packets are resent
        only when that STATUS names us (see _absorb), or when two asks got no answer at all (the
        DPU worker may be restarting; the dataplane still merges). Some result packets: ask for
        the missing seqs."""
        c = self.c
        rto = c.rtt.rto
        if now - last_progress <= min(GAP_GRACE_S, rto):
            # nothing can be due: a partition's timer runs from max(its last send, the round's
            # last progress) and waits at least the gap grace or the RTO. Checked first because
            # this runs after every received batch (it was ~10% of a host's round CPU)
            return
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
        due = np.flatnonzero(self.sent & ~self.done & (since > wait))
        if not len(due):
            return
        nores = due[self.res_got[due] == 0]
        partial = due[self.res_got[due] > 0]
        resend = nores[self.unanswered[nores] >= 2]
        self.unanswered[nores] += 1
        if len(resend):
            self._resend_data(resend)
            c.retransmit_causes["resend_unanswered"] += len(resend)
        if len(nores):
            self._send_retx_all(nores)
            c.retransmit_causes["ask_result"] += len(nores)
        reqs = []
        for p in partial.tolist():
            have = self.got[p, :self.res_total[p]]
            seqs = np.flatnonzero(~have).astype(np.uint32)[:wire.MAX_RETX_ENTRIES]
            reqs.append(self._retx_request(p, seqs))
        if reqs:
            rb = PacketBatch.from_packets([q for q, _ in reqs], dest=[d for _, d in reqs])
            c.ep.send_to_table(rb, c.dpu_table)
            c.retransmissions += len(reqs)
            c.retransmit_causes["ask_packets"] += len(reqs)
        self.last_tx[due] = now
        self.tries[due] += 1

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
        self.c.retransmissions += len(r)

    def _send_retx_all(self, parts: np.ndarray) -> None:
        """RETX_REQUEST(count=0) for each partition in ``parts``, built vectorized."""
        n = len(parts)
        b = packetize_control(PacketType.RETX_REQUEST, parts, job_id=self.c.job.job_id,
                              worker_id=self.c.worker_id, round=self.c.round, dest=self.owner[parts])
        self.c.ep.send_to_table(b, self.c.dpu_table)
        self.c.retransmissions += n

    def _retx_request(self, p: int, seqs: np.ndarray) -> tuple[bytes, int]:
        h = wire.Header(type=PacketType.RETX_REQUEST, job_id=self.c.job.job_id,
                        worker_id=self.c.worker_id, partition=p, round=self.c.round, seq=0, total=1)
        return wire.build_packet(h, seqs), int(self.owner[p])

    def _check_members(self, stalled: float) -> None:
        """The round stalls: if the control plane says this host's job is gone, or a member the
        DPU is waiting for is dead or has left, say so now (not after the no-progress timeout)."""
        c = self.c
        m = c.membership
        if m.broken is not None:
            raise StaleJobError(f"allreduce round {c.round} of job {c.job.job_id} cannot complete: "
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
        c.last_missing = {int(p): self.missing.get(int(p), []) for p in fresh}
        raise MissingWorkersError(
            f"allreduce round {c.round} of job {c.job.job_id} stalled for {stalled:.1f} s: the DPU is "
            f"still waiting for worker(s) {named}: " + "; ".join(gone[w] for w in named), named)

    def _fail(self):
        """Raise the round's timeout, naming the workers the DPUs reported missing recently (a
        STATUS older than half the timeout may be stale: the DPU may have died since)."""
        c = self.c
        now = time.monotonic()
        stuck = np.flatnonzero(self.sent & ~self.done)
        fresh = [p for p in stuck.tolist() if now - self.status_at[p] < max(1.0, c.timeout / 2)]
        missing = sorted({w for p in fresh for w in self.missing.get(p, [])})
        c.last_missing = {int(p): self.missing.get(int(p), []) for p in fresh}
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
            f"allreduce round {c.round} of job {c.job.job_id} made no progress for {c.timeout:g} s: "
            f"{len(stuck)} partition(s) incomplete ({shown}); " + "; ".join(parts), missing)
