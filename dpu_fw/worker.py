"""The DPU worker: turns completed partitions into SPARSE_RESULT packets for every host of a job,
keeps them as the shadow copy, answers duplicates and RETX_REQUESTs, and advances rounds.

Two modes, one protocol (docs/dpu_worker.md):

* ``xdp``: the XDP dataplane merged the data already; completions come from its ring buffer, the
  partition's sums are read zero-copy from the pinned mmap-ed buffer. Only what XDP passes (dups of a
  complete round, RETX_REQUEST) reaches this worker's socket.
* ``userspace``: this worker receives every packet with recvmmsg and merges it itself
  (:class:`dpu_fw.userspace.MergeState`, Cython), applying the dataplane's rules.

Round bookkeeping is the same in both (docs/protocol.md): when round r+1 of a partition completes,
round r's buffer is cleared and base_round advanced to r+1 BEFORE r+1's result is emitted. The
shadow copy of a round is its built result packets (a cache: it can always be rebuilt from the
buffer, which is only cleared by that advance, so a restarted worker loses nothing).
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time

import numpy as np

from dosa.errors import DosaError
from dosa.job import DPU_MODES, JobConfig
from dosa.net import addr_arrays, multicast_group
from dosa.packetizer import packetize_results, packetize_status, parse_batch
from dosa.transport import UdpEndpoint
from dosa.wire import Flags, PacketBatch, PacketType

from . import _merge
from .emit import Scratch, build_results
from .userspace import DUP_OF_COMPLETE, VERDICTS, MergeState, top_k_abs

log = logging.getLogger("dosa.dpu")
#: Seconds during which a whole result is not sent to the same host again (see JobRuntime.answer):
#: right after the fan-out the result is still on its way, and a host that asked before it arrived
#: would otherwise double the DPU's send load exactly when it is busiest.
ANSWER_GUARD = 0.1
#: Seconds during which a missing worker is not NACKed again for the same (partition, round): one
#: NACK per asker's timer would make it resend its contribution once per other host.
NACK_GUARD = 0.002
#: Seconds after a fan-out during which an explicit ask for the whole result is not answered: the
#: result is still on its way (a host starved of CPU asks before it has read it).
ASK_GUARD = 0.02
#: The NACK scan (JobRuntime.nack_scan): how often, how long a worker may miss from a (partition,
#: round) before it is told, and how often again. A worker is NACKed only on evidence of loss: it
#: has delivered a later partition of this DPU (a host sends its partitions in order, and one host's
#: packets reach a DPU in order), like TCP's fast retransmit after duplicate ACKs. A worker that is
#: merely late (hosts start a round tens of ms apart on a loaded machine, its packets still queued
#: before the DPU) shows no such evidence and is left to its own retransmission timer, which asks and
#: gets a STATUS naming it: NACKing it would only make it resend what is already on its way.
NACK_SCAN_S = 0.002
NACK_GRACE_S = 0.002
NACK_REPEAT_S = 0.01
#: Completed partitions whose results are built and sent per sendmmsg batch: results then flow to the
#: hosts while the rest are built (a host seeing no progress for its retransmission interval asks again).
EMIT_CHUNK = 32
#: Seconds between two writes of the stats file (dpu run --stats-file), for /metrics.
STATS_EVERY = 0.5
#: completion events of a job this worker does not serve yet are kept this long (the dataplane had
#: the job installed before this worker's discovery saw it: a job's first partition can complete
#: within milliseconds of the install), then handled once the job is served, else counted
#: ``completion_unknown``; at most PARKED_MAX per job are kept
PARKED_S = 2.0
PARKED_MAX = 65536


class JobRuntime:
    """One job on this DPU: owned partitions, host addresses, shadow copies, and a state backend
    (``MergeState`` in userspace mode, the dataplane maps in XDP mode)."""

    def __init__(self, job: JobConfig, dpu_index: int, backend):
        self.job = job
        self.dpu_index = dpu_index
        pmap = job.pmap
        self.pmap = pmap
        self.owned = pmap.owned_by(dpu_index)
        self.local_of = np.full(pmap.num_partitions, -1, np.int64)
        self.local_of[self.owned] = np.arange(len(self.owned))
        self.lo = self.owned * pmap.partition_size
        self.hi = np.minimum(self.lo + pmap.partition_size, pmap.numel)
        self.k = job.gtopk_k(self.hi - self.lo)
        self.pmap = pmap
        self.host_ip, self.host_port = addr_arrays(job.hosts)
        # one send per result packet to the job's group (the fabric replicates it), else unicast
        # fan-out; a failing group send falls back to fan-out for good (see _fan_out)
        self.group = multicast_group(job)
        if self.group is not None:
            self.group_ip, self.group_port = addr_arrays([self.group])
        self.backend = backend
        #: (lp, rnd) -> (batch, row a, row b, idx, entry s, entry e): the shadow copy is rows a:b of
        #: batch (a whole emitted chunk, shared), its non-zero indices idx[s:e]; sliced when used
        self.shadow: dict[tuple[int, int], tuple] = {}
        self.saturated = 0
        self._answered: dict[tuple[int, int, int], float] = {}
        self._emitted: dict[tuple[int, int], float] = {}
        self._nacked: dict[tuple[int, int, int], float] = {}
        self._stuck: dict[tuple[int, int, int], float] = {}  # (lp, rnd, w) -> first seen missing
        self.nacks_on_ask = 0  # NACKs (a STATUS naming its recipient) sent on an ask; the scan's: worker stats
        #: per worker, the latest (round, local partition) it delivered whole here, as a key
        #: (``_key``): the evidence a NACK needs (a gap before it is a loss, not lateness)
        self.delivered = np.full(job.workers, -1, np.int64)
        #: this job's counters on this DPU (completions, result packets/entries, answers to
        #: retransmission requests by outcome, userspace merge verdicts): /metrics serves them
        self.stats = collections.Counter()
        self._scratch = Scratch()  # dpu_fw.emit's worst-case extraction arrays, reused

    def _sums(self, lp: int, rnd: int):
        """(indices, sums to send, all non-zero indices) of (lp, rnd) from its buffer."""
        buf = self.backend.buffer(lp, rnd)
        touched = self.backend.touched(lp, rnd)
        if touched is None:
            idx, sums, nsat = _merge.extract_nonzero(buf, int(self.lo[lp]))
        else:
            idx, sums, nsat = _merge.extract_listed(buf, *touched, int(self.lo[lp]))
        if nsat:
            self._saturated(lp, rnd, nsat)
        nz = idx
        if self.job.mode == "gtopk":
            idx, sums = top_k_abs(idx, sums, int(self.k[lp]))
        return idx, sums, nz

    def _key(self, lp: int, rnd: int) -> int:
        """The order in which every host sends this DPU's partitions: round-major, then partition."""
        return rnd * len(self.owned) + lp

    def _lost(self, lp: int, rnd: int, w: int) -> bool:
        """Evidence that worker ``w``'s data of (lp, rnd) was lost, not late: it delivered later."""
        return bool(self.delivered[w] > self._key(lp, rnd))

    def _saturated(self, lp: int, rnd: int, nsat: int) -> None:
        self.saturated += nsat
        log.error("job %d partition %d round %d: %d sums outside s32 were saturated (hosts "
                  "exceeded the clip bound)", self.job.job_id, self.owned[lp], rnd, nsat)

    def _flags(self) -> int:
        return int(Flags.GTOPK) if self.job.mode == "gtopk" else 0

    def result(self, lp: int, rnd: int) -> PacketBatch:
        """The result packets of (lp, rnd): from the shadow cache, or built from the buffer."""
        hit = self.shadow.get((lp, rnd))
        if hit is not None:
            batch, a, b = hit[:3]
            if a == 0 and b == len(batch):
                return batch
            return PacketBatch(batch.data[a:b], batch.lengths[a:b], batch.dest[a:b])
        idx, sums, nz = self._sums(lp, rnd)
        # the same encoder as _emit's (bases at the partition's start): a result answered before
        # its completion event was handled, and then fanned out, goes out as identical copies
        batch = packetize_results(idx, sums, self.pmap, job_id=self.job.job_id, round=rnd,
                                  scale_exp=self.backend.scale_exp(lp, rnd), flags=self._flags(),
                                  partitions=self.owned[lp:lp + 1], mtu=self.job.mtu)
        self.shadow[(lp, rnd)] = (batch, 0, len(batch), nz, 0, len(nz))
        return batch

    def complete_many(self, comps: list[tuple[int, int]], ep: UdpEndpoint) -> None:
        """Completions of (local partition, round), in order: advance each where due, then build
        the results of all of them with one vectorized packetization per (round, scale) and send
        every packet to every host with one sendmmsg."""
        groups: dict[tuple[int, int], list[int]] = {}
        self.stats["completions"] += len(comps)
        # every worker delivered these whole
        np.maximum(self.delivered, max(self._key(lp, rnd) for lp, rnd in comps), out=self.delivered)
        for lp, rnd in comps:
            self._settle(lp, rnd)
            groups.setdefault((rnd, self.backend.scale_exp(lp, rnd)), []).append(lp)
        for (rnd, scale), lps in groups.items():
            lps = sorted(set(lps))
            for i in range(0, len(lps), EMIT_CHUNK):
                self._emit(rnd, scale, lps[i:i + EMIT_CHUNK], ep)

    def _emit(self, rnd: int, scale: int, lps: list[int], ep: UdpEndpoint) -> None:
        """Build and fan out the results of ``lps`` (ascending) for ``rnd``: in sum mode straight
        from the buffers (dpu_fw.emit.build_results: one Cython pass and one packet writer for all
        of them), in gtopk mode through top_k_abs and one vectorized packetization."""
        now = time.monotonic()
        parts = self.owned[lps]
        if self.job.mode == "gtopk":
            got = [self._sums(lp, rnd) for lp in lps]
            idx = np.concatenate([g[0] for g in got])
            sums = np.concatenate([g[1] for g in got])
            batch = packetize_results(idx, sums, self.pmap, job_id=self.job.job_id, round=rnd,
                                      scale_exp=scale, flags=self._flags(), partitions=parts,
                                      mtu=self.job.mtu)
            nentries = len(idx)
            hp = batch.headers()["partition"].astype(np.int64)
            rows = np.append(np.searchsorted(hp, parts, "left"), len(batch)).tolist()
            nz = [(g[2], 0, len(g[2])) for g in got]
        else:
            be = self.backend
            res = build_results([be.buffer(lp, rnd) for lp in lps], parts, self.lo[lps],
                                self.pmap, job_id=self.job.job_id, round=rnd, scale_exp=scale,
                                flags=self._flags(), mtu=self.job.mtu, scratch=self._scratch,
                                lists=[be.touched(lp, rnd) for lp in lps])
            batch, nentries = res.batch, len(res.idx)
            rows = res.rows.tolist()
            st = res.starts.tolist()
            nz = [(res.idx, st[k], st[k + 1]) for k in range(len(lps))]
            if res.nsat.any():
                for k in np.flatnonzero(res.nsat).tolist():
                    self._saturated(lps[k], rnd, int(res.nsat[k]))
        self.stats["result_packets"] += len(batch)
        self.stats["result_entries"] += nentries
        for k, lp in enumerate(lps):
            self.shadow[(lp, rnd)] = (batch, rows[k], rows[k + 1], *nz[k])
            self._emitted[(lp, rnd)] = now
        if len(self._emitted) > 65536:
            self._emitted = {k: v for k, v in self._emitted.items() if now - v < ANSWER_GUARD}
        self._fan_out(batch, ep)

    def _fan_out(self, batch: PacketBatch, ep: UdpEndpoint) -> None:
        """Every packet of ``batch`` to every host: once to the job's multicast group, or (no group,
        or sending to it failed) to each host in turn."""
        n, h = len(batch), len(self.host_ip)
        if self.group is not None:
            try:
                ep.send(batch, np.arange(n), np.full(n, self.group_ip[0]), np.full(n, self.group_port[0]))
                return
            except (OSError, DosaError) as e:
                log.warning("job %d: multicast to %s:%d failed (%s); unicast fan-out from now on",
                            self.job.job_id, *self.group, e)
                self.group = None
        # host-major: each host's copy is one run of a partition's packets, so UDP GSO sends it
        # as one datagram (dosa.transport)
        rows = np.tile(np.arange(n), h)
        ep.send(batch, rows, np.repeat(self.host_ip, n), np.repeat(self.host_port, n))

    def _settle(self, lp: int, rnd: int) -> None:
        """Before (lp, rnd)'s result goes out: if it is the occupant after its slot's base (in
        userspace mode every partition is its own slot and occupants are rounds), every host holds
        the base's result (it sent (lp, rnd) only then), so clear the base and advance
        (docs/dataplane.md, *Slots*). Also called when answering a retransmission, so a worker
        killed between a completion and its advance repairs itself."""
        if self.backend.is_next(lp, rnd):
            prev = self.backend.previous(lp, rnd)
            old = self.shadow.pop(prev, None)
            self.backend.advance(lp, rnd, None if old is None else old[3][old[4]:old[5]], prev)
            before = self.backend.previous(*prev) if prev is not None else None
            if before is not None:
                self.shadow.pop(before, None)

    def complete(self, lp: int, rnd: int, ep: UdpEndpoint) -> None:
        """Round ``rnd`` of local partition ``lp`` completed: advance if it was base+1, then emit."""
        self.complete_many([(lp, rnd)], ep)

    def answer(self, lp: int, rnd: int, worker: int, ep: UdpEndpoint, seqs=None,
               statuses: list | None = None) -> str:
        """Resend (some of) a complete round's result to one host, or tell it who is missing.

        A whole result goes to the same host at most every ANSWER_GUARD s, counted from the
        fan-out too: a host that resends all its data packets of a partition triggers one answer,
        not one per packet, and an ask that crossed the fan-out is not answered twice."""
        if not self.backend.in_window(lp, rnd):
            return "retx_too_old"
        p = int(self.owned[lp])
        if not self.backend.is_complete(lp, rnd):
            missing = self.backend.missing_workers(lp, rnd)
            items = [(p, rnd, worker, missing)]
            # NACK: others are done, these are not, and they delivered later partitions (the
            # evidence of a loss): tell each at once (a STATUS naming it makes it resend its data)
            # instead of waiting for its own timer
            if len(missing) < self.job.workers:
                now = time.monotonic()
                for m in missing:
                    if m != worker and 0 <= m < len(self.host_ip) and self._lost(lp, rnd, m) and \
                            now - self._nacked.get((lp, rnd, m), -1.0) > NACK_GUARD:
                        self._nacked[(lp, rnd, m)] = now
                        items.append((p, rnd, m, [m]))
                if len(self._nacked) > 65536:
                    self._nacked = {k: v for k, v in self._nacked.items() if now - v < NACK_GUARD}
            self.nacks_on_ask += sum(1 for it in items if it[2] in it[3])  # STATUS naming its recipient
            if statuses is not None:
                statuses.extend(items)  # the caller sends them all in one batch
            else:
                self.send_statuses(items, ep)
            return "status_sent"
        if seqs is None or not len(seqs):
            now = time.monotonic()
            key = (lp, rnd, worker)
            # a data duplicate is answered once per ANSWER_GUARD; an explicit ask (RETX_REQUEST,
            # count 0) comes once per the host's measured RTO: it is answered unless it repeats
            # within NACK_GUARD or comes within ASK_GUARD of the fan-out (the result is on its way)
            if seqs is None:
                suppress = now - max(self._answered.get(key, -1.0),
                                     self._emitted.get((lp, rnd), -1.0)) < ANSWER_GUARD
            else:
                suppress = now - self._answered.get(key, -1.0) < NACK_GUARD or \
                    now - self._emitted.get((lp, rnd), -1.0) < ASK_GUARD
            if suppress:
                return "answer_suppressed"
            if len(self._answered) > 65536:
                self._answered.clear()
            self._answered[key] = now
        self._settle(lp, rnd)
        batch = self.result(lp, rnd)
        rows = np.arange(len(batch))
        if seqs is not None and len(seqs):
            rows = np.unique(np.asarray(seqs, np.int64))
            rows = rows[rows < len(batch)]
        if len(rows):
            ep.send(batch, rows, np.full(len(rows), self.host_ip[worker]),
                    np.full(len(rows), self.host_port[worker]))
        return "retx_answered"


    def nack_scan(self, ep: UdpEndpoint, now: float) -> int:
        """NACK where the DPU sees a loss: a worker missing (in part or whole) from a (partition,
        round) that other workers have delivered whole, and that has delivered a later partition
        here, gets a STATUS naming it (it then resends its data) once that lasts NACK_GRACE_S, and
        again every NACK_REPEAT_S while it is missing. Returns the STATUS packets sent."""
        missing, delivered = self.backend.incomplete()
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
            if now - first >= NACK_GRACE_S and now - self._nacked.get(key, -1.0) > NACK_REPEAT_S:
                self._nacked[key] = now
                items.append((int(self.owned[lp]), rnd, w, [w]))
        self._stuck = stuck
        if items:
            self.send_statuses(items, ep)
        return len(items)

    def send_statuses(self, items: list, ep: UdpEndpoint) -> None:
        """STATUS packets for [(partition, round, worker, missing workers)], one sendmmsg."""
        n = len(items)
        b = packetize_status([it[0] for it in items], [it[1] for it in items], [it[3] for it in items],
                             job_id=self.job.job_id)
        w = np.array([it[2] for it in items], np.int64)
        ep.send(b, np.arange(n), self.host_ip[w], self.host_port[w])


class DpuWorker:
    """Serves the jobs of one DPU (``dpu_index`` in each job's ``dpus`` list) in one mode."""

    def __init__(self, jobs: list[JobConfig], dpu_index: int, *, mode: str = "userspace",
                 bind: tuple[str, int] | None = None, state_dir: str | None = None,
                 instance: str | None = None, discover=None):
        """``discover``: optional ``f() -> [JobConfig]`` polled twice a second for jobs installed
        after start (XDP mode: the dataplane's maps; userspace: the control plane)."""
        if mode not in DPU_MODES:
            raise DosaError(f"mode must be one of {DPU_MODES}, got {mode!r}")
        if bind is None:
            if not jobs:
                raise DosaError("give the address to listen on, or a job config that names it")
            bind = jobs[0].dpus[dpu_index]
        self.mode = mode
        self.dpu_index = dpu_index
        self.state_dir = state_dir
        self.stats = collections.Counter()
        self.stats_file: str | None = None  # publish_stats() writes here (dpu run --stats-file)
        self._retired: dict[int, collections.Counter] = {}  # counters of jobs no longer served
        self._stop = threading.Event()
        self.maps = None
        self.discover = discover
        self._static = {j.job_id for j in jobs}  # given at start: never dropped by discovery
        self._next_scan = 0.0
        self._next_discover = 0.0
        self._parked: dict[int, tuple[float, list]] = {}  # job id -> (first seen, completions)
        self._xdp_poll = None  # XDP mode: waits on the completion ring and the socket at once
        self.jobs: dict[int, JobRuntime] = {}
        if mode == "xdp":
            from .xdp_backend import open_maps

            self.maps = open_maps(instance)
        try:
            for j in jobs:
                self.add_job(j)
            self.ep = UdpEndpoint(bind)
            try:
                self.ep.set_multicast_source(bind[0])
            except DosaError as e:
                log.warning("%s: results go by unicast fan-out", e)
                for rt in self.jobs.values():
                    rt.group = None
        except BaseException:
            if self.maps is not None:
                self.maps.close()
            raise

    def add_job(self, j: JobConfig, dpu_index: int | None = None) -> None:
        """Serve job ``j`` (its partitions owned by this DPU) from now on. ``dpu_index``: this
        DPU's index in ``j.dpus`` (default: the worker's)."""
        di = self.dpu_index if dpu_index is None else dpu_index
        if not 0 <= di < len(j.dpus):
            raise DosaError(f"job {j.job_id} has {len(j.dpus)} DPUs; index {di} is not one")
        pmap = j.pmap
        owned = pmap.owned_by(di)
        if self.mode == "userspace":
            lo = owned * pmap.partition_size
            hi = np.minimum(lo + pmap.partition_size, pmap.numel)
            sd = None if self.state_dir is None else f"{self.state_dir}/job{j.job_id}-dpu{di}"
            backend = UserspaceBackend(MergeState(owned, lo, hi, j.workers, pmap.partition_size, sd))
        else:
            from .xdp_backend import XdpBackend

            backend = XdpBackend(self.maps, j, owned)
        self.jobs[j.job_id] = JobRuntime(j, di, backend)
        log.info("DPU %d serves job %d (%s mode, %d workers, %d partitions owned)", di,
                 j.job_id, self.mode, j.workers, len(owned))

    def _discover(self, urgent: bool = False) -> None:
        """Poll ``discover`` for new jobs: twice a second, or at once (at most every 50 ms) when
        traffic or a completion of an unknown job shows that one was just installed."""
        now = time.monotonic()
        if self.discover is None or now < self._next_discover - (0.45 if urgent else 0.0):
            return
        self._next_discover = now + 0.5
        me = self.ep.address if hasattr(self, "ep") else None
        found = self.discover()
        if found is None:  # the source could not be read this time: change nothing
            return
        # a job released by the control plane is gone from the source: stop serving it; one
        # re-created under the same id (another run) differs or reappears: serve it afresh
        seen = {j.job_id: j for j in found}
        for job_id in [i for i, rt in self.jobs.items() if i not in self._static and
                       (i not in seen or (seen[i].complete and seen[i] != rt.job))]:
            self.drop_job(job_id)
        for j in found:
            if j.job_id in self.jobs or not j.complete:  # incomplete: members joining or leaving
                continue
            di = self.dpu_index
            if me is not None:
                mine = [i for i, d in enumerate(j.dpus) if d == me or (d[0] == me[0] and me[0] != "0.0.0.0")]
                if mine:
                    di = mine[0]
            try:
                self.add_job(j, di)
            except DosaError as e:
                log.warning("cannot serve job %d: %s", j.job_id, e)

    def drop_job(self, job_id: int) -> None:
        """Stop serving ``job_id`` (released): its shadow copies go, and in userspace mode its
        merge state (also the files under ``state_dir``: a later job of the same id starts clean)."""
        rt = self.jobs.pop(job_id, None)
        if rt is None:
            return
        # counters only grow: a released job's stay (a later job of the same id adds to them)
        self._retired.setdefault(job_id, collections.Counter()).update(rt.stats)
        rt.backend.flush()
        if self.mode == "userspace" and self.state_dir is not None:
            import shutil

            shutil.rmtree(f"{self.state_dir}/job{job_id}-dpu{rt.dpu_index}", ignore_errors=True)
        log.info("DPU %d no longer serves job %d (released)", rt.dpu_index, job_id)

    # ------------------------------------------------------------------ main loop
    def stop(self, *_):
        self._stop.set()

    def run(self, duration: float | None = None) -> None:
        """Serve until stop() (or SIGTERM/SIGINT when run from the CLI) or ``duration`` seconds."""
        end = None if duration is None else time.monotonic() + duration
        next_publish = 0.0
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            self.step(0.05)
            if self.stats_file and time.monotonic() >= next_publish:
                self.publish_stats()
                next_publish = time.monotonic() + STATS_EVERY
        if self.stats_file:
            self.publish_stats()
        for rt in self.jobs.values():
            rt.backend.flush()

    def step(self, timeout: float) -> None:
        self._discover()
        if self._parked:
            self._unpark()
        if self.maps is not None:
            # wait for a completion event or a packet, whichever comes first (at most 2 ms): a
            # completion frees an aggregation slot every host's window may be waiting for, so it
            # is taken at once rather than after a socket wait (docs/dataplane.md, *Slots*)
            ready = self._wait_xdp(min(timeout, 0.002))
            comps = self.maps.poll_completions(0)
            if comps:
                self._on_completions(comps)
            timeout = 0.0 if ready is not None else min(timeout, 0.002)
            recv = ready is None or bool(ready & self._sock_fds)  # empty sockets: no recv this step
        else:
            recv = True
        now = time.monotonic()
        if self.jobs and now >= self._next_scan:
            self._next_scan = now + NACK_SCAN_S
            for rt in list(self.jobs.values()):
                self.stats["nack_sent"] += rt.nack_scan(self.ep, now)
        if not recv:
            return
        if self.jobs:
            timeout = min(timeout, NACK_SCAN_S)
        batch, src_ip, src_port = self.ep.recv(timeout)
        if len(batch):
            self.handle(batch, src_ip, src_port)

    def _wait_xdp(self, timeout: float) -> set | None:
        """Block until the ring buffer or a socket is readable or ``timeout`` passed; returns the
        readable fds (the step skips its recv when no socket is among them: in XDP mode the data
        never reaches the sockets, and an empty recv costs more than the poll), or None when the
        maps offer no pollable fd (then the caller waits in recv as before)."""
        if self._xdp_poll is None:
            fd = getattr(self.maps, "completion_fd", None)
            if fd is None:
                return None
            import select

            self._sock_fds = {self.ep.sock.fileno(),
                              *([self.ep.msock.fileno()] if self.ep.msock is not None else [])}
            self._xdp_poll = select.poll()
            for f in (fd(), *self._sock_fds):
                self._xdp_poll.register(f, select.POLLIN)
        return {f for f, _ in self._xdp_poll.poll(max(1, int(timeout * 1000)))}

    def _on_completions(self, comps) -> None:
        """Completion events from the dataplane, grouped by job and handled in arrival order."""
        by_job: dict[int, list] = {}
        for c in comps:
            by_job.setdefault(c.job_id, []).append(c)
        for job_id, cs in by_job.items():
            rt = self.jobs.get(job_id)
            if rt is None:
                self._discover(urgent=True)
                rt = self.jobs.get(job_id)
            if rt is None:
                self._park(job_id, cs)
                continue
            ok = [(int(rt.local_of[c.partition]), int(c.round)) for c in cs
                  if 0 <= c.partition < len(rt.local_of) and rt.local_of[c.partition] >= 0]
            self.stats["completion_unknown"] += len(cs) - len(ok)
            if ok:
                rt.complete_many(ok, self.ep)
                self.stats["completions"] += len(ok)

    def _park(self, job_id: int, cs: list) -> None:
        """Keep completions of a job not served yet (PARKED_S); beyond PARKED_MAX they are lost."""
        since, kept = self._parked.setdefault(job_id, (time.monotonic(), []))
        room = PARKED_MAX - len(kept)
        kept.extend(cs[:max(0, room)])
        self.stats["completion_unknown"] += max(0, len(cs) - max(0, room))

    def _unpark(self) -> None:
        """Handle the parked completions of jobs served now; count those parked too long."""
        now = time.monotonic()
        for job_id in list(self._parked):
            since, cs = self._parked[job_id]
            if job_id in self.jobs:
                del self._parked[job_id]
                self.stats["completion_parked"] += len(cs)
                self._on_completions(cs)
            elif now - since > PARKED_S:
                del self._parked[job_id]
                self.stats["completion_unknown"] += len(cs)

    # ------------------------------------------------------------------ one received batch
    def handle(self, batch: PacketBatch, src_ip: np.ndarray, src_port: np.ndarray) -> None:
        parsed = parse_batch(batch, on_error="drop")
        self.stats["malformed"] += parsed.dropped
        if not len(parsed):
            return
        h = parsed.headers
        sip, sport = src_ip[parsed.kept], src_port[parsed.kept]
        jobs = h["job_id"].astype(np.int64)
        for job_id in np.unique(jobs).tolist():
            rt = self.jobs.get(job_id)
            sel = np.flatnonzero(jobs == job_id)
            if rt is None:
                self._discover(urgent=True)
                rt = self.jobs.get(job_id)
            if rt is None:
                self.stats["unknown_job"] += len(sel)
                continue
            self._handle_job(rt, parsed, sel, sip[sel], sport[sel])

    def _handle_job(self, rt: JobRuntime, parsed, sel, sip, sport) -> None:
        h = parsed.headers[sel]
        t = h["type"].astype(np.int64)
        w = h["worker_id"].astype(np.int64)
        part = h["partition"].astype(np.int64)
        known = w < rt.job.workers
        wc = np.where(known, w, 0)
        src_ok = known & (rt.host_ip[wc] == sip) & (rt.host_port[wc] == sport)
        self.stats["unknown_worker"] += int((~known).sum())
        self.stats["bad_source"] += int((known & ~src_ok).sum())
        inside = part < rt.pmap.num_partitions
        lp = np.where(inside, rt.local_of[np.where(inside, part, 0)], -1)
        owned = src_ok & (lp >= 0)
        self.stats["not_owner"] += int((src_ok & (lp < 0)).sum())
        data = owned & ((t == PacketType.SPARSE_DATA) | (t == PacketType.DENSE_DATA))  # dense runs too
        retx = owned & (t == PacketType.RETX_REQUEST)
        other = owned & ~data & ~retx
        self.stats["heartbeat"] += int((other & (t == PacketType.HEARTBEAT)).sum())
        self.stats["unsupported_type"] += int((other & (t != PacketType.HEARTBEAT)).sum())
        rnd = h["round"].astype(np.int64)
        if data.any():
            d = np.flatnonzero(data)
            if self.mode == "userspace":
                verdict, comps = rt.backend.state.merge(
                    lp[d], rnd[d], w[d], h["seq"][d], h["total"][d], h["count"][d],
                    h["scale_exp"][d], parsed.indices, parsed.values, parsed.offsets[sel[d]])
                for v, n in zip(*np.unique(verdict, return_counts=True)):
                    self.stats[VERDICTS[int(v)]] += int(n)
                    rt.stats[VERDICTS[int(v)]] += int(n)
                if comps:
                    rt.complete_many(comps, self.ep)
                    self.stats["completions"] += len(comps)
                dup = d[verdict == DUP_OF_COMPLETE]
            else:
                dup = d  # XDP passes only duplicates of a complete round to the socket
                self.stats[VERDICTS[DUP_OF_COMPLETE]] += len(d)
            # answer each (partition, round, worker) once per batch, from the shadow copy
            if len(dup):
                key = np.unique(np.stack([lp[dup], rnd[dup], w[dup]], 1), axis=0)
                for klp, kr, kw in key.tolist():
                    outcome = rt.answer(klp, kr, kw, self.ep)
                    self.stats[outcome] += 1
                    rt.stats[outcome] += 1
        statuses: list = []
        for i in np.flatnonzero(retx).tolist():
            j = sel[i]
            seqs = parsed.indices[parsed.offsets[j]:parsed.offsets[j + 1]]
            self.stats["retx_request"] += 1
            outcome = rt.answer(int(lp[i]), int(rnd[i]), int(w[i]), self.ep, seqs, statuses)
            self.stats[outcome] += 1
            rt.stats["retx_request"] += 1
            rt.stats[outcome] += 1
        if statuses:
            rt.send_statuses(statuses, self.ep)

    def job_stats(self) -> dict[int, dict[str, int]]:
        """Per job id: its counters on this DPU (also of jobs released since; they only grow)."""
        out = {j: collections.Counter(c) for j, c in self._retired.items()}
        for j, rt in self.jobs.items():
            out.setdefault(j, collections.Counter()).update(rt.stats)
        return {j: dict(c) for j, c in out.items()}

    def publish_stats(self) -> None:
        """Write this worker's counters as JSON to ``stats_file`` (atomic rename), for the control
        process's /metrics (control/metrics.py reads it; docs/control.md *Metrics*)."""
        import json

        doc = {"pid": os.getpid(), "time": time.time(), "dpu_index": self.dpu_index,
               "mode": self.mode, "stats": dict(self.stats),
               "jobs": {str(j): c for j, c in self.job_stats().items()}}
        tmp = f"{self.stats_file}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.stats_file)
        except OSError as e:
            log.warning("cannot write stats to %s: %s", self.stats_file, e)

    def close(self) -> None:
        self.ep.close()
        for rt in self.jobs.values():
            rt.backend.flush()
        if self.maps is not None and hasattr(self.maps, "close"):
            self.maps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class UserspaceBackend:
    """The state backend of userspace mode: a MergeState this process merges into."""

    def __init__(self, state: MergeState):
        self.state = state

    def incomplete(self):
        """Like XdpBackend.incomplete: ([(lp, round, worker, partial)] of the workers missing from a
        round of a partition that other workers have delivered whole, [(lp, round, worker)] of those
        other workers)."""
        st = self.state
        cand = np.argwhere((st.done_workers > 0) & (st.done_workers < st.workers))
        missing, delivered = [], []
        for lp, par in cand.tolist():
            b = int(st.base_round[lp])
            rnd = b if (b & 1) == par else b + 1
            t, d = st.totals[lp, par], st.delivered[lp, par]
            whole = (t > 0) & (d >= t)
            for w in np.flatnonzero(~whole).tolist():
                missing.append((lp, rnd, w, bool(d[w] > 0)))
            for w in np.flatnonzero(whole).tolist():
                delivered.append((lp, rnd, w))
        return missing, delivered

    def is_next(self, lp, rnd):
        return rnd == int(self.state.base_round[lp]) + 1

    def previous(self, lp, rnd):
        return (lp, rnd - 1) if rnd > 0 else None

    def in_window(self, lp, rnd):
        return self.state.in_window(lp, rnd)

    def is_complete(self, lp, rnd):
        return self.state.is_complete(lp, rnd)

    def missing_workers(self, lp, rnd):
        return self.state.missing_workers(lp, rnd)

    def buffer(self, lp, rnd):
        return self.state.buffer(lp, rnd)

    def touched(self, lp, rnd):
        return None  # MergeState keeps no touched lists: results scan the buffer

    def scale_exp(self, lp, rnd):
        return int(self.state.scale_of[lp, rnd & 1])

    def advance(self, lp, rnd, nonzero, prev=None):
        self.state.advance(lp, rnd, nonzero)

    def flush(self):
        self.state.flush()


def install_signal_handlers(worker: DpuWorker) -> None:
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)

