"""The DPU worker: one shard's loop. The data path runs compiled (dpu_fw/_completion.pyx, and in
userspace mode dpu_fw/_softmerge.pyx); this loop keeps the policy: which jobs (discovery), the
packets the data path hands up (asks, duplicates of complete rounds, heartbeats), the NACK scan,
and the counters.

Two modes, one protocol and one state layout (docs/dpu_worker.md):

* ``xdp``: the XDP dataplane merged the data already; completions come from this shard's ring
  buffer. Only what XDP passes (duplicates of a complete round, RETX_REQUEST, HEARTBEAT) reaches
  the socket.
* ``userspace``: the shard receives every packet and merges it itself with the dataplane's rules.

With ``shards`` > 1 (``dosa dpu run --workers N``, dpu_fw/shards.py) this process serves the slots
with slot % shards == shard: their completions, NACK scan and repairs.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time

import numpy as np

from dataplane import layout
from dosa.counters import NUM_COUNTERS, Counter
from dosa.errors import DosaError
from dosa.job import DPU_MODES, JobConfig
from dosa.packetizer import parse_batch
from dosa.transport import UdpEndpoint
from dosa.wire import PacketBatch, PacketType

from . import policy
from ._completion import ENGINE_MAX_JOBS, CompletionEngine
from .discovery import Discovery
from .runtime import JobRuntime
from .state import JobState

log = logging.getLogger("dosa.dpu")
#: counters of the userspace merge's verdicts, by their lower-case names (dosa/counters.py)
VERDICT_NAMES = {int(c): c.name.lower() for c in Counter}


def open_maps(instance: str | None):
    try:
        from dataplane.maps import DataplaneMaps
    except ImportError as e:
        raise DosaError(f"XDP mode needs the dataplane package ({e}); use --mode userspace") from None
    return DataplaneMaps.open(instance or "default")


class DpuWorker:
    """Serves the jobs of one DPU (``dpu_index`` in each job's ``dpus`` list) in one mode, as shard
    ``shard`` of ``shards``. ``discover``: optional ``f() -> [JobConfig]`` polled for jobs
    installed after start (dpu_fw.discovery). ``sock``: an already bound socket to use (the shards
    of a userspace worker share a port, dpu_fw/shards.py)."""

    def __init__(self, jobs: list[JobConfig], dpu_index: int, *, mode: str = "userspace",
                 bind: tuple[str, int] | None = None, state_dir: str | None = None,
                 instance: str | None = None, discover=None, shard: int = 0, shards: int = 1,
                 sock=None):
        if mode not in DPU_MODES:
            raise DosaError(f"mode must be one of {DPU_MODES}, got {mode!r}")
        if not 0 <= shard < shards <= layout.MAX_SHARDS:
            raise DosaError(f"shard {shard} of {shards}: 1..{layout.MAX_SHARDS} shards are possible")
        if bind is None:
            if not jobs:
                raise DosaError("give the address to listen on, or a job config that names it")
            bind = jobs[0].dpus[dpu_index]
        self.mode, self.dpu_index, self.state_dir = mode, dpu_index, state_dir
        self.shard, self.shards = shard, shards
        self.stats = collections.Counter()
        self.stats_file: str | None = None  # publish_stats() writes here (dpu run --stats-file)
        self._steering_warned = False
        self._retired: dict[int, collections.Counter] = {}  # counters of jobs no longer served
        self._stop = threading.Event()
        self.discovery = Discovery(discover)
        self._static = {j.job_id for j in jobs}  # given at start: never dropped by discovery
        self._next_scan = 0.0
        self.jobs: dict[int, JobRuntime] = {}
        self.maps = None
        self.soft = None
        #: userspace merge verdicts per engine job row (+1 row for packets of no served job)
        self.verdicts = np.zeros((ENGINE_MAX_JOBS + 1, NUM_COUNTERS), np.int64)
        try:
            self.ep = UdpEndpoint(bind, sock=sock)
            self.multicast = True
            try:
                self.ep.set_multicast_source(bind[0])
            except DosaError as e:
                log.warning("%s: results go by unicast fan-out", e)
                self.multicast = False
            self.engine = CompletionEngine(self.ep.fd, self.ep.counters, self.ep.gso)
            if mode == "xdp":
                self.maps = open_maps(instance)
                self.engine.set_ring(self.maps.ring(shard), self.maps.settings, shard)
            else:
                from ._softmerge import SoftMerge

                self.soft = SoftMerge(self.engine, self._sock_fds(), self.ep.counters, self.verdicts,
                                      shard=shard, shards=shards)
            for j in jobs:
                self.add_job(j)
        except BaseException:
            self.close()
            raise

    def _sock_fds(self) -> list[int]:
        return [self.ep.fd, *([self.ep.msock.fileno()] if self.ep.msock is not None else [])]

    # ------------------------------------------------------------------ jobs
    def add_job(self, j: JobConfig, dpu_index: int | None = None) -> None:
        """Serve job ``j`` (its partitions owned by this DPU) from now on. ``dpu_index``: this
        DPU's index in ``j.dpus`` (default: the worker's)."""
        di = self.dpu_index if dpu_index is None else dpu_index
        if not 0 <= di < len(j.dpus):
            raise DosaError(f"job {j.job_id} has {len(j.dpus)} DPUs; index {di} is not one")
        if self.maps is not None:
            state = JobState.in_maps(self.maps, j)
        else:
            sd = None if self.state_dir is None else f"{self.state_dir}/job{j.job_id}-dpu{di}"
            state = JobState.allocate(j, di, sd)
        # userspace: this shard's memory holds its partitions only (the merge drops the others'),
        # so its NACK scan and repairs cover every slot of it; XDP: the slots are shared, sharded
        sh = (self.shard, self.shards) if self.maps is not None else (0, 1)
        self.jobs[j.job_id] = JobRuntime(j, di, state, self.engine, shard=sh[0], shards=sh[1],
                                         multicast=self.multicast)
        log.info("DPU %d shard %d/%d serves job %d (%s mode, %d workers, %d partitions owned)", di,
                 self.shard, self.shards, j.job_id, self.mode, j.workers, len(self.jobs[j.job_id].owned))

    def drop_job(self, job_id: int) -> None:
        """Stop serving ``job_id`` (released): in userspace mode its state goes (also the files
        under ``state_dir``: a later job of the same id starts clean)."""
        rt = self.jobs.get(job_id)
        if rt is None:
            return
        self._retire(job_id, rt)
        del self.jobs[job_id]
        rt.close()
        if self.mode == "userspace" and self.state_dir is not None:
            import shutil

            shutil.rmtree(f"{self.state_dir}/job{job_id}-dpu{rt.dpu_index}", ignore_errors=True)
        log.info("DPU %d no longer serves job %d (released)", rt.dpu_index, job_id)

    def _retire(self, job_id: int, rt: JobRuntime) -> None:
        # counters only grow: a released job's stay (a later job of the same id adds to them)
        self._retired.setdefault(job_id, collections.Counter()).update(self._job_counters(job_id, rt))
        row = self.engine.slot_of(job_id)
        if row >= 0:
            self.verdicts[row] = 0

    def _discover(self, urgent: bool = False) -> None:
        found = self.discovery.poll(urgent)
        if found is None:  # not time yet, or the source could not be read: change nothing
            return
        me = self.ep.address
        seen = {j.job_id: j for j in found}
        # a job released by the control plane is gone from the source: stop serving it; one
        # re-created under the same id (another run) differs or reappears: serve it afresh
        for job_id in [i for i, rt in self.jobs.items() if i not in self._static and
                       (i not in seen or (seen[i].complete and seen[i] != rt.job))]:
            self.drop_job(job_id)
        for j in found:
            if j.job_id in self.jobs or not j.complete:  # incomplete: members joining or leaving
                continue
            di = self.dpu_index
            mine = [i for i, d in enumerate(j.dpus) if d == me or (d[0] == me[0] and me[0] != "0.0.0.0")]
            if mine:
                di = mine[0]
            try:
                self.add_job(j, di)
            except DosaError as e:
                log.warning("cannot serve job %d: %s", j.job_id, e)

    # ------------------------------------------------------------------ main loop
    def stop(self, *_):
        self._stop.set()

    def run(self, duration: float | None = None) -> None:
        """Serve until stop() (or SIGTERM/SIGINT when run from the CLI) or ``duration`` seconds."""
        end = None if duration is None else time.monotonic() + duration
        next_publish = 0.0
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            self.step(0.05)
            if time.monotonic() >= next_publish:
                if self.stats_file:
                    self.publish_stats()
                self._check_steering()
                next_publish = time.monotonic() + policy.STATS_EVERY
        if self.stats_file:
            self.publish_stats()
        for rt in self.jobs.values():
            rt.state.flush()

    def step(self, timeout: float) -> None:
        """Discovery, then the data path for up to ``timeout`` s (NACK_SCAN_S while jobs are
        served), the packets it hands up, and the scan when due."""
        self._discover()
        if self.discovery.parked:
            self.engine.handle(self.discovery.unpark(self.jobs))
        if self.jobs:
            timeout = min(timeout, max(0.0, self._next_scan - time.monotonic()))
        if self.soft is not None:
            n = self.soft.step(timeout)
            if n:
                s = self.soft
                self.handle(PacketBatch(s.passed_data[:n], s.passed_lengths[:n].copy(),
                                        np.full(n, -1, np.int64)), s.passed_ip[:n].copy(),
                            s.passed_port[:n].copy())
        else:
            _, readable = self.engine.step(timeout, self._sock_fds())
            if readable:
                batch, src_ip, src_port = self.ep.recv(0.0)
                if len(batch):
                    self.handle(batch, src_ip, src_port)
        unknown = self.engine.take_unknown()
        if unknown:
            self._discover(urgent=True)
            self.engine.handle([r for r in unknown if r[0] in self.jobs])
            self.discovery.park([r for r in unknown if r[0] not in self.jobs])
        now = time.monotonic()
        if self.jobs and now >= self._next_scan:
            self._next_scan = now + policy.NACK_SCAN_S
            repairs = []
            for rt in list(self.jobs.values()):
                sent, fix = rt.scan(self.ep, now)
                self.stats["nack_sent"] += sent
                repairs += fix
            if repairs:
                self.engine.handle(repairs)

    # ------------------------------------------------------------------ packets handed up
    def handle(self, batch: PacketBatch, src_ip: np.ndarray, src_port: np.ndarray) -> None:
        parsed = parse_batch(batch, on_error="drop")
        self.stats["malformed"] += parsed.dropped
        if not len(parsed):
            return
        h = parsed.headers
        sip, sport = src_ip[parsed.kept], src_port[parsed.kept]
        jobs = h["job_id"].astype(np.int64)
        for job_id in np.unique(jobs).tolist():
            sel = np.flatnonzero(jobs == job_id)
            rt = self.jobs.get(job_id)
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
        inside = part < rt.job.pmap.num_partitions
        lp = np.where(inside, rt.local_of[np.where(inside, part, 0)], -1)
        owned = src_ok & (lp >= 0)
        self.stats["not_owner"] += int((src_ok & (lp < 0)).sum())
        data = owned & ((t == PacketType.SPARSE_DATA) | (t == PacketType.DENSE_DATA))
        retx = owned & (t == PacketType.RETX_REQUEST)
        other = owned & ~data & ~retx
        self.stats["heartbeat"] += int((other & (t == PacketType.HEARTBEAT)).sum())
        self.stats["unsupported_type"] += int((other & (t != PacketType.HEARTBEAT)).sum())
        rnd = h["round"].astype(np.int64)
        # data reaching this loop is a duplicate of a complete round (XDP passes only those; the
        # userspace merge hands up only those): answer each (partition, round, worker) once
        d = np.flatnonzero(data)
        if len(d):
            if self.mode == "xdp":
                self.stats[VERDICT_NAMES[Counter.PASS_DUP_OF_COMPLETE]] += len(d)
            key = np.unique(np.stack([lp[d], rnd[d], w[d]], 1), axis=0)
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

    # ------------------------------------------------------------------ counters
    def _job_counters(self, job_id: int, rt: JobRuntime) -> collections.Counter:
        c = collections.Counter(rt.counters())
        row = self.engine.slot_of(job_id)
        if self.soft is not None and row >= 0:
            for code, n in enumerate(self.verdicts[row].tolist()):
                if n:
                    c[VERDICT_NAMES[code]] += n
        return c

    def job_stats(self) -> dict[int, dict[str, int]]:
        """Per job id: its counters on this shard (also of jobs released since; they only grow)."""
        out = {j: collections.Counter(c) for j, c in self._retired.items()}
        for j, rt in self.jobs.items():
            out.setdefault(j, collections.Counter()).update(self._job_counters(j, rt))
        return {j: dict(c) for j, c in out.items()}

    def totals(self) -> dict[str, int]:
        """The shard's own counters (drops by reason, parking, NACKs, the merge's verdicts of
        packets of no served job)."""
        c = collections.Counter(self.stats)
        c.update(self.discovery.stats)
        if self.soft is not None:
            for code, n in enumerate(self.verdicts[-1].tolist()):
                if n:
                    c[VERDICT_NAMES[code]] += n
        return dict(c)

    def _check_steering(self) -> None:
        """Say once when packets of other shards' partitions reach this one (userspace shards):
        its senders' GSO datagrams arrive unsegmented, and every such packet costs a resend."""
        if self.soft is None or self._steering_warned:
            return
        wrong = int(self.verdicts[:, int(Counter.WRONG_SHARD)].sum())
        if wrong:
            self._steering_warned = True
            log.warning("shard %d/%d: %d packet(s) of other shards' partitions reached it (counted as "
                        "wrong_shard; their hosts resend them): the hosts' UDP GSO datagrams reach "
                        "this DPU unsegmented (veth, loopback), so the kernel steers each by its first "
                        "packet; segment them before the DPU (ethtool -K <dev> tx-udp-segmentation "
                        "off on the port that feeds it) or use XDP mode", self.shard, self.shards, wrong)

    def publish_stats(self) -> None:
        """Write this shard's counters as JSON to ``stats_file`` (atomic rename), for the control
        process's /metrics (control/metrics.py reads it; docs/control.md *Metrics*)."""
        import json

        doc = {"pid": os.getpid(), "time": time.time(), "dpu_index": self.dpu_index,
               "mode": self.mode, "shard": self.shard, "shards": self.shards,
               "stats": self.totals(), "jobs": {str(j): c for j, c in self.job_stats().items()},
               "time_ns": {"settle": self.engine.ns_settle, "build": self.engine.ns_build,
                           "send": self.engine.ns_send}}
        tmp = f"{self.stats_file}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.stats_file)
        except OSError as e:
            log.warning("cannot write stats to %s: %s", self.stats_file, e)

    def close(self) -> None:
        for rt in getattr(self, "jobs", {}).values():
            rt.state.flush()
        if getattr(self, "ep", None) is not None:
            self.ep.close()
        if self.maps is not None and hasattr(self.maps, "close"):
            self.maps.close()
            self.maps = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def install_signal_handlers(worker: DpuWorker) -> None:
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
