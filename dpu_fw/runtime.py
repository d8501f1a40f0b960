"""One job on one DPU worker shard: its hosts, its place in the compiled completion path, and the
policy around it: answering asks and duplicates from the shadow copy, telling a worker whose data
was lost (NACK), repairing a slot whose completion was never handled. The data path itself (settle,
extract, result packets, fan-out) is dpu_fw/_completion.pyx; the timings are dpu_fw/policy.py.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from dosa.job import JobConfig
from dosa.net import addr_arrays, multicast_group
from dosa.packetizer import packetize_status
from dosa.transport import UdpEndpoint
from dosa.wire import PacketBatch

from . import policy
from .state import JobState


class JobRuntime:
    """``state``: the job's JobState; ``engine``: the shard's CompletionEngine (the job is added
    to it here); ``shard``/``shards``: this worker serves the slots with slot % shards == shard
    (its completions, NACK scan and repairs; any shard answers asks, which only read)."""

    def __init__(self, job: JobConfig, dpu_index: int, state: JobState, engine, *, shard: int = 0,
                 shards: int = 1, multicast: bool = True):
        self.job = job
        self.dpu_index = dpu_index
        self.state = state
        self.engine = engine
        self.owned = job.pmap.owned_by(dpu_index)
        self.local_of = np.full(job.pmap.num_partitions, -1, np.int64)
        self.local_of[self.owned] = np.arange(len(self.owned))
        self.host_ip, self.host_port = addr_arrays(job.hosts)
        self.group = multicast_group(job) if multicast else None
        group = addr_arrays([self.group]) if self.group is not None else None
        info = state.info
        self.my_slots = np.arange(shard, info.slots, shards) if shards > 1 else None
        self.shard, self.shards = shard, shards
        lo = self.owned * job.partition_size
        k = job.gtopk_k(np.minimum(lo + job.partition_size, job.numel) - lo)
        engine.add_job(job.job_id, info, *state.addresses(), hosts=(self.host_ip, self.host_port),
                       group=None if group is None else (int(group[0][0]), int(group[1][0])),
                       gtopk=job.mode == "gtopk", k=np.atleast_1d(k), mtu=job.mtu)
        #: per worker, the latest (round, local partition) it delivered whole here, as a key
        #: (round * owned + lp): the evidence a NACK needs (a gap before it is a loss, not lateness)
        self.delivered = np.full(job.workers, -1, np.int64)
        self.stats = collections.Counter()  # answers by outcome, NACKs, repairs (for /metrics)
        self._answered: dict[tuple[int, int, int], float] = {}
        self._nacked: dict[tuple[int, int, int], float] = {}
        self._stuck: dict[tuple[int, int, int], float] = {}
        self._unsettled: dict[tuple[int, int], float] = {}
        self.nacks_on_ask = 0  # NACKs (a STATUS naming its recipient) sent on an ask

    def close(self) -> None:
        self.engine.drop_job(self.job.job_id)
        self.state.flush()

    def _key(self, lp: int, rnd: int) -> int:
        """The order in which every host sends this DPU's partitions: round-major, then partition."""
        return rnd * len(self.owned) + lp

    def _lost(self, lp: int, rnd: int, w: int) -> bool:
        """Evidence that worker ``w``'s data of (lp, rnd) was lost, not late: it delivered later."""
        return bool(self.delivered[w] > self._key(lp, rnd))

    def _emitted(self, lp: int, rnd: int) -> float:
        slot, g = self.state.occupant(lp, rnd)
        return float(self.engine.emitted(self.job.job_id)[slot * 2 + (g & 1)])

    def counters(self) -> dict[str, int]:
        """The job's counters on this shard: the engine's (completions, result packets and
        entries, ...) and the policy's (answers, NACKs)."""
        c = collections.Counter(self.engine.stats(self.job.job_id))
        c.update(self.stats)
        return dict(c)

    # ------------------------------------------------------------------ asks and duplicates
    def answer(self, lp: int, rnd: int, worker: int, ep: UdpEndpoint, seqs=None,
               statuses: list | None = None) -> str:
        """Resend (some of) a complete round's result to one host, or tell it who is missing.

        ``seqs``: None for a duplicate data packet of a complete round, else the result packets a
        RETX_REQUEST asks for (empty: the whole result). A whole result goes to the same host at
        most every ANSWER_GUARD s, counted from the fan-out too; an explicit ask is answered unless
        it repeats within NACK_GUARD or comes within ASK_GUARD of the fan-out."""
        st = self.state
        if not st.in_window(lp, rnd):
            return "retx_too_old"
        p = int(self.owned[lp])
        if not st.is_complete(lp, rnd):
            missing = st.missing_workers(lp, rnd)
            items = [(p, rnd, worker, missing)]
            # NACK: others are done, these are not, and they delivered later partitions (the
            # evidence of a loss): tell each at once instead of waiting for its own timer
            if len(missing) < self.job.workers:
                now = time.monotonic()
                for m in missing:
                    if m != worker and 0 <= m < len(self.host_ip) and self._lost(lp, rnd, m) and \
                            now - self._nacked.get((lp, rnd, m), -1.0) > policy.NACK_GUARD:
                        self._nacked[(lp, rnd, m)] = now
                        items.append((p, rnd, m, [m]))
                if len(self._nacked) > 65536:
                    self._nacked = {k: v for k, v in self._nacked.items() if now - v < policy.NACK_GUARD}
            self.nacks_on_ask += sum(1 for it in items if it[2] in it[3])
            if statuses is not None:
                statuses.extend(items)  # the caller sends them all in one batch
            else:
                self.send_statuses(items, ep)
            return "status_sent"
        if not st.is_settled(lp, rnd):
            return "answer_pending"  # complete, its completion not handled yet: the result is coming
        if seqs is None or not len(seqs):
            now = time.monotonic()
            key = (lp, rnd, worker)
            emitted = self._emitted(lp, rnd)
            if seqs is None:
                suppress = now - max(self._answered.get(key, -1.0), emitted) < policy.ANSWER_GUARD
            else:
                suppress = now - self._answered.get(key, -1.0) < policy.NACK_GUARD or \
                    now - emitted < policy.ASK_GUARD
            if suppress:
                return "answer_suppressed"
            if len(self._answered) > 65536:
                self._answered.clear()
            self._answered[key] = now
        res = self.engine.result(self.job.job_id, lp, rnd)
        if res is None:
            return "answer_pending"
        data, lengths = res
        batch = PacketBatch(data, lengths, np.full(len(lengths), -1, np.int64))
        rows = np.arange(len(batch))
        if seqs is not None and len(seqs):
            rows = np.unique(np.asarray(seqs, np.int64))
            rows = rows[(rows >= 0) & (rows < len(batch))]
        if len(rows):
            ep.send(batch, rows, np.full(len(rows), self.host_ip[worker]),
                    np.full(len(rows), self.host_port[worker]))
        return "retx_answered"

    def send_statuses(self, items: list, ep: UdpEndpoint) -> None:
        """STATUS packets for [(partition, round, worker, missing workers)], one sendmmsg."""
        n = len(items)
        b = packetize_status([it[0] for it in items], [it[1] for it in items], [it[3] for it in items],
                             job_id=self.job.job_id)
        w = np.array([it[2] for it in items], np.int64)
        ep.send(b, np.arange(n), self.host_ip[w], self.host_port[w])

    # ------------------------------------------------------------------ the periodic scan
    def scan(self, ep: UdpEndpoint, now: float) -> tuple[int, list]:
        """The NACK scan over this shard's slots: a worker missing (in part or whole) from a
        (partition, round) that other workers delivered whole, and that has delivered a later
        partition here, gets a STATUS naming it (it then resends its data) once that lasts
        NACK_GRACE_S, and again every NACK_REPEAT_S while it is missing. Also the repair: a slot
        whose next occupant has been complete for REPAIR_GRACE_S without its completion being
        handled. Returns (STATUS packets sent, [(job, partition, round, scale)] to handle)."""
        if not self.engine.needs_scan(self.job.job_id, self.shard, self.shards):
            self._stuck, self._unsettled = {}, {}
            return 0, []
        self.delivered = np.maximum(self.delivered, self.engine.max_key(self.job.job_id))
        missing, delivered = self.state.incomplete(self.my_slots)
        for lp, rnd, w in delivered:
            k = self._key(lp, rnd)
            if k > self.delivered[w]:
                self.delivered[w] = k
        items, stuck = [], {}
        for lp, rnd, w, _partial in missing:
            key = (lp, rnd, w)
            if w >= len(self.host_ip) or not self._lost(lp, rnd, w):
                continue  # late, not lost (as far as this DPU can see): the worker's timer asks
            first = stuck[key] = self._stuck.get(key, now)
            if now - first >= policy.NACK_GRACE_S and \
                    now - self._nacked.get(key, -1.0) > policy.NACK_REPEAT_S:
                self._nacked[key] = now
                items.append((int(self.owned[lp]), rnd, w, [w]))
        self._stuck = stuck
        if items:
            self.send_statuses(items, ep)
        repairs, unsettled = [], {}
        for lp, rnd in self.state.complete_unsettled(self.my_slots):
            first = unsettled[(lp, rnd)] = self._unsettled.get((lp, rnd), now)
            if now - first >= policy.REPAIR_GRACE_S:
                repairs.append((self.job.job_id, int(self.owned[lp]), rnd, self.state.scale_exp(lp, rnd)))
        self._unsettled = unsettled
        self.stats["repaired"] += len(repairs)
        return len(items), repairs
