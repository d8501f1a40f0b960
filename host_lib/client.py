"""AggregationClient: one host's side of a dosa allreduce through the DPU(s).

A round: packetize this host's sparse (index, q) entries into SPARSE_DATA packets for every partition
(dosa.packetizer), send them to each partition's owning DPU through a bounded window of partitions
in flight, collect the result packets of every partition, retransmit on timeouts, and return
the sums. Everything per packet is vectorized (one sendmmsg/recvmmsg per batch, numpy bookkeeping);
Python loops only run over partitions whose timer fired.

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

import concurrent.futures
import time

import numpy as np

from dosa import _net, wire
from dosa.env import RankEnv
from dosa.errors import DosaError
from dosa.job import JobConfig
from dosa.net import addr_arrays, multicast_group
from dosa.packetizer import packetize, packetize_control, parse_batch
from dosa.transport import UdpEndpoint
from dosa.wire import Flags, HEADER_DTYPE, PacketBatch, PacketType

from .encoder import RoundEncoder
from .membership import Membership, StaleJobError, new_session
from .rto import RttEstimator
from .quantize import choose_scale_exp, clip_bound, dequantize

_RESULT_TYPES = (PacketType.SPARSE_RESULT, PacketType.DENSE_RESULT)


class AllreduceHandle:
    """What ``allreduce_async`` returns: ``wait(timeout=None)`` gives the result or raises."""

    def __init__(self, future: concurrent.futures.Future):
        self._f = future

    def done(self) -> bool:
        return self._f.done()

    def wait(self, timeout: float | None = None):
        try:
            return self._f.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DosaError(f"allreduce still running after waiting {timeout} s") from None


class AggregationClient:
    """Joins a job and runs allreduce rounds through its DPUs.

    Args:
        job: the job's JobConfig (explicit), or None with ``control=(addr, port)`` to join through
            the control plane's API.
        worker_id: this host's rank (index into ``job.hosts``; its address is where it binds).
        timeout: seconds without any progress after which a round fails with a DosaError naming
            the missing workers.
        retx_interval: seconds before a partition's packets (or missing results) are re-requested.
        window: partitions in flight at once (bounds the DPU's and the socket's backlog).
        density: fraction of entries ``allreduce(array)`` sends (default: the job's).
        join: with ``control``: keyword arguments of :func:`join_via_control` (job_id, address,
            port, workers, dpus, mode, density, partition_size, scale_exp, wait).
        shuffle_sends: send every batch in random order (a test aid: reordering where the kernel
            has no netem; the protocol must not care).
    Example:
        >>> with AggregationClient(job, worker_id=0) as c:
        ...     total = c.allreduce(grad)          # float32 sum over all hosts
    """

    def __init__(self, job: JobConfig | None = None, *, worker_id: int, control=None, join: dict | None = None,
                 timeout: float = 10.0, retx_interval: float = 0.2, window: int = 256,
                 density: float | None = None, bind: tuple[str, int] | None = None, numel=None,
                 shuffle_sends: bool = False):
        if job is None:
            if control is None:
                raise DosaError("give either an explicit job config or control=(addr, port)")
            jkw = dict(join or {})
            if numel is not None:
                jkw.setdefault("numel", int(numel))
            session = new_session()
            job, view = join_via_control(control, worker_id, session=session, return_view=True, **jkw)
            # heartbeats and leave: the job ends with this client, or with its lease (a crash)
            self.membership = Membership(control, job, worker_id, session, view.get("generation"))
        if not 0 <= worker_id < job.workers:
            raise DosaError(f"worker_id {worker_id} outside 0..{job.workers - 1} for job {job.job_id}")
        if timeout <= 0 or retx_interval <= 0 or window < 1:
            raise DosaError("timeout and retx_interval must be positive and window at least 1")
        self.job = job
        self.worker_id = worker_id
        self.pmap = job.pmap
        self.timeout = float(timeout)
        self.retx_interval = float(retx_interval)
        self.window = int(window)
        self.round = 0
        self.scale_exp = job.scale_exp
        self.initial_scale_exp = job.scale_exp
        self.density = job.density if density is None else float(density)
        self.ep = UdpEndpoint(bind or job.hosts[worker_id])
        # results come once per packet to the job's group when the fabric allows it (the DPU
        # derives the same group from the job); retransmitted results still come by unicast
        self.multicast_group = multicast_group(job) if bind is None else None
        if self.multicast_group is not None:
            try:
                self.ep.join_group(*self.multicast_group, job.hosts[worker_id][0])
            except DosaError as e:
                import logging

                logging.getLogger("dosa.host").warning("%s; results will need retransmission", e)
                self.multicast_group = None
        self.dpu_table = addr_arrays(job.dpus)
        self._dpu_ip_of = {int(ip): d for d, ip in enumerate(self.dpu_table[0])}
        self._encoder: RoundEncoder | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.retransmissions = 0
        #: the retransmission timer, from the round trips this client measured (host_lib/rto.py)
        self.rtt = RttEstimator(self.retx_interval)
        self._rng = np.random.default_rng() if shuffle_sends else None
        self.last_missing: dict[int, list[int]] = {}
        #: CPU seconds (this thread's, user + sys) spent per phase of the rounds, summed over rounds:
        #: packetize, send, receive (the recv system calls), absorb (header checks, bookkeeping),
        #: retransmit, decode. The benchmark's phase breakdown reads it.
        self.phase_cpu: dict[str, float] = {}

    def _phase(self, name: str, t0: float) -> float:
        """Add this thread's CPU time since ``t0`` to ``phase_cpu[name]``; returns the time now."""
        t = time.thread_time()
        self.phase_cpu[name] = self.phase_cpu.get(name, 0.0) + t - t0
        return t

    # ------------------------------------------------------------------ public API
    @classmethod
    def from_env(cls, numel: int, **kw) -> "AggregationClient":
        """Join the job the DOSA_* environment names (``dosa testbed run`` sets it): the control
        plane at DOSA_CONTROL_ADDR:DOSA_CONTROL_PORT, or an explicit DOSA_JOB_CONFIG file."""
        env = RankEnv.parse()
        if env.job_config:
            return cls(JobConfig.load(env.job_config), worker_id=env.rank, **kw)
        if env.control is None:
            raise DosaError("no dosa job in the environment: set DOSA_CONTROL_ADDR/DOSA_CONTROL_PORT "
                            "or DOSA_JOB_CONFIG")
        join = {"job_id": env.job_id or 1, "workers": env.world_size or 1}
        if env.host_addr:
            join["address"] = env.host_addr
        if env.port:
            join["port"] = env.port
        if env.dpu_addrs:
            join["dpus"] = env.dpu_addrs
        join.update(kw.pop("join", None) or {})
        return cls(worker_id=env.rank, control=env.control, numel=numel, join=join, **kw)

    @property
    def stats(self) -> dict:
        return {"bytes_sent": self.ep.sent_bytes, "bytes_received": self.ep.recv_bytes,
                "packets_sent": self.ep.sent_packets, "packets_received": self.ep.recv_packets,
                "retransmissions": self.retransmissions, "rounds": self.round}

    def allreduce(self, array: np.ndarray) -> np.ndarray:
        """Sum ``array`` (float32, ``job.numel`` entries) over all hosts; returns float32.

        Only the top ``density`` fraction (plus what error feedback carried over) is sent, quantized
        with the round's scale exponent; what was not sent stays in this client's residual and goes
        out in later rounds. The scale of round r > 0 is chosen from round r-1's result (the same on
        every host), so all hosts agree without talking.
        """
        x = np.asarray(array, np.float32).reshape(-1)
        if x.size != self.job.numel:
            raise DosaError(f"allreduce of {x.size} entries, but job {self.job.job_id} has numel "
                            f"{self.job.numel}")
        if self._encoder is None:
            self._encoder = RoundEncoder(self.job.numel, self.density, self.job.workers,
                                         seed=self.worker_id)
        s = self.scale_exp
        sent = self._encoder.encode(x, s)
        ridx, sums = self.allreduce_sparse(sent.indices, sent.values, s)
        if self.job.mode == "gtopk":
            self._encoder.fold_back(*self._encoder.unapplied(sent, ridx), s)
        out = np.zeros(self.job.numel, np.float32)
        vals = dequantize(sums, s)
        out[ridx] = vals
        m = float(np.abs(vals).max()) if len(vals) else 0.0
        if m > 0:
            self.scale_exp = choose_scale_exp(m, self.job.workers)
        return out

    def allreduce_async(self, array: np.ndarray) -> AllreduceHandle:
        """Start ``allreduce(array)`` in the background; rounds run in submission order."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dosa-allreduce")
        return AllreduceHandle(self._pool.submit(self.allreduce, np.array(array, np.float32)))

    def allreduce_sparse(self, indices, values, scale_exp: int) -> tuple[np.ndarray, np.ndarray]:
        """One round with entries the caller compressed and quantized itself.

        Args:
            indices: sorted unique u32 positions; values: int32 (respecting clip_bound(workers)).
            scale_exp: the round's exponent, identical on every host.
        Returns:
            (indices u32 sorted, sums int32): the non-zero sums (sum mode) or the k largest |sum|
            per partition (gtopk mode).
        """
        values = np.asarray(values)
        if len(values) and np.abs(values.astype(np.int64)).max() > clip_bound(self.job.workers):
            raise DosaError(f"values exceed the clip bound {clip_bound(self.job.workers)} for "
                            f"{self.job.workers} workers: the DPU's sum could overflow s32")
        t0 = time.thread_time()
        try:
            batch = packetize(indices, values, self.pmap, job_id=self.job.job_id,
                              worker_id=self.worker_id, round=self.round, scale_exp=int(scale_exp),
                              mtu=self.job.mtu)
        except ValueError as e:
            raise DosaError(f"cannot packetize round {self.round}: {e}") from None
        self._phase("packetize", t0)
        out = _Round(self, batch, int(scale_exp)).run()
        self.round += 1
        return out

    def open_stream(self, scale_exp: int):
        """Start a round whose partitions are handed over in ascending ranges while it runs
        (host_lib.stream.SparseStream: a DDP step's buckets, sent as backward produces them)."""
        from .stream import SparseStream  # stream builds on _Round, defined here

        return SparseStream(self, int(scale_exp))

    #: no heartbeat-based membership unless joined through the control plane
    membership: Membership | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.membership is not None:
            self.membership.close()  # leave the job: the last one out releases it
        self.ep.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Round:
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
        self.raw_count: list[np.ndarray] = []
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
        if _net.decode_entries(data, order.astype(np.int64), count, hdr["base"].astype(np.int64),
                               offset_at, value_at, idx, val) != m:
            raise DosaError("result packets with more entries than their slots (a bug: headers "
                            "are validated before)")
        if dense.any():  # a dense run carries the zero sums of its span too: they are no entries
            keep = ~(np.repeat(dense, count) & (val == 0))
            idx, val = idx[keep], val[keep]
            m = len(idx)
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

        Headers are read in place (a view of the receive buffer); only this round's result packets
        are validated and kept (raw), STATUS packets are parsed; anything else is ignored."""
        n = len(b)
        if not n:
            return False
        hv = b.data.view(HEADER_DTYPE)[:n, 0]
        t = hv["type"]
        mine = (hv["job_id"] == self.c.job.job_id) & (hv["round"] == self.c.round) \
            & (hv["partition"] < self.P) & (hv["worker_id"] == wire.DPU_SENDER_ID)
        st = np.flatnonzero(mine & (t == PacketType.STATUS))
        if len(st):
            self._statuses(parse_batch(PacketBatch(b.data[st], b.lengths[st], b.dest[st]), on_error="drop"))
        res = np.flatnonzero(mine & np.isin(t, _RESULT_TYPES) & (hv["scale_exp"] == self.scale_exp))
        if not len(res):
            return False
        res = res[wire.header_ok(hv[res], np.asarray(b.lengths[res], np.int64))]
        p = hv["partition"][res].astype(np.int64)
        s = hv["seq"][res].astype(np.int64)
        key = p * wire.MAX_PACKETS_PER_CONTRIBUTION + s
        key, first = np.unique(key, return_index=True)
        res, p, s = res[first], p[first], s[first]
        new = ~self.got[p, s] & ~self.done[p]
        if not new.any():
            return False
        res, p, s, key = res[new], p[new], s[new], key[new]
        self.got[p, s] = True
        self.res_total[p] = hv["total"][res]
        np.add.at(self.res_got, p, 1)
        self.raw.append(b.data[res])
        self.raw_key.append(key)
        self.raw_count.append(hv["count"][res].astype(np.int64))
        was = self.done[p]
        self.done |= (self.res_total > 0) & (self.res_got >= self.res_total)
        # RTT samples (Karn): partitions done without any ask, resend or STATUS of ours: their
        # time includes no recovery, ours or (as far as we saw) another host's; one per batch,
        # the quickest, so other hosts' lateness inflates the timer as little as it can
        fresh = p[~was & self.done[p] & (self.tries[p] == 0) & ~self.resent[p]
                  & ~np.isfinite(self.status_at[p])]
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
            self._resend_data(np.unique(need))

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
        backoff = 2.0 ** np.minimum(self.tries, 1)
        since = now - np.maximum(self.last_tx, last_progress)
        # a visible gap (some of the partition's result packets are in, not all; they come back
        # to back, so the rest is lost or reordered): ask after a reordering grace, not the RTO
        # (the grace doubles per try, up to 16x: a lost request or answer is asked again soon)
        # a partition with no result while a later one of its DPU is done has a visible gap too:
        # every host sends in partition order, so its (one-packet) result was most likely lost
        rto = c.rtt.rto
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
        if len(nores):
            self._send_retx_all(nores)
        reqs = []
        for p in partial.tolist():
            have = self.got[p, :self.res_total[p]]
            seqs = np.flatnonzero(~have).astype(np.uint32)[:wire.MAX_RETX_ENTRIES]
            reqs.append(self._retx_request(p, seqs))
        if reqs:
            rb = PacketBatch.from_packets([q for q, _ in reqs], dest=[d for _, d in reqs])
            c.ep.send_to_table(rb, c.dpu_table)
            c.retransmissions += len(reqs)
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


#: seconds without progress after which a round asks its membership whether a member is gone
STALL_CHECK_S = 0.5
#: least wait before asking for the missing packets of a partial result (reordering grace)
GAP_GRACE_S = 0.002


class MissingWorkersError(DosaError):
    """A round timed out; ``missing`` lists the worker ids the DPU(s) reported as not delivered."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


def local_address_towards(addr: str) -> str:
    """The local IPv4 address the kernel would use to reach ``addr`` (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def join_via_control(control, worker_id: int, numel=None, *, job_id: int | None = None,
                     address: str | None = None, port: int | None = None, workers=None, dpus=None,
                     wait: float = 60.0, return_view: bool = False, **shape) -> JobConfig:
    """Join a job through the control plane's API (control.api) and return its JobConfig.

    Blocks until every worker has joined (at most ``wait`` s): results fan out to every host, so a
    job is only usable once all are known. The first joiner creates the job from the shape given
    (numel, workers, dpus, ...), like a torchrun rendezvous.
    """
    try:
        from dosa.join import join_raw
    except ImportError:
        raise DosaError("the control plane's join API (control.api) is not available; "
                        "give the job config explicitly") from None
    if job_id is None:
        raise DosaError("joining through the control plane needs the job id")
    ctl = (str(control[0]), int(control[1]))
    if address is None:
        address = local_address_towards(ctl[0])
    body = dict(shape)
    if numel is not None:
        body["numel"] = int(numel)
    if workers is not None:
        body["workers"] = int(workers)
    if dpus:
        body["dpus"] = list(dpus)
    view = join_raw(ctl, job_id, address, port, worker_id, wait, **body)
    job = JobConfig.from_view(view)
    return (job, view) if return_view else job
