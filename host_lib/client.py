"""AggregationClient: one host's side of a dosa allreduce through the DPU(s).

The client holds what outlives a round: the job (explicit, from the DOSA_* environment, or joined
through the control plane, with its membership lease), the UDP endpoint, the scale exponent, the
encoder's residual, the RTT estimate, counters. A round: packetize this host's sparse (index, q)
entries into SPARSE_DATA packets for every partition (dosa.packetizer) and hand them to
``host_lib.round.Round``, which sends them through a bounded window, collects the results and
recovers losses (its docstring; docs/dpu_worker.md). ``open_stream`` starts a round fed while it
runs (host_lib.stream). A round that cannot complete raises ``MissingWorkersError`` (from
host_lib.round, importable from here) or ``StaleJobError`` (host_lib.membership).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time

import numpy as np

from dosa.env import RankEnv
from dosa.errors import DosaError
from dosa.job import JobConfig, ResultMode
from dosa import wire
from dosa.join import join_view
from dosa.net import addr_arrays, multicast_group, path_mtu
from dosa.packetizer import packetize
from dosa.transport import UdpEndpoint

from .encoder import RoundEncoder
from .membership import Membership, new_session
from .rto import RttEstimator
from .quantize import choose_scale_exp, clip_bound, dequantize
from .round import MissingWorkersError, Round
from .round_context import RoundContext, RoundStats
from .stream import FedRound, SparseStream

#: the client's public names; MissingWorkersError (host_lib.round's) is what a failed round raises
__all__ = ["AggregationClient", "AllreduceHandle", "MissingWorkersError"]


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
        join: with ``control``: keyword arguments of :func:`dosa.join.join_view` (job_id, address,
            port, workers, dpus, mode, density, partition_size, scale_exp, wait, env); an unset one
            is not read from the environment unless ``env`` says so (``from_env`` does).
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
            jkw = {"env": {}, **(join or {})}
            if numel is not None:
                jkw.setdefault("numel", int(numel))
            session = new_session()
            view = join_view((str(control[0]), int(control[1])), worker_id, session=session, **jkw)
            job = JobConfig.from_view(view)
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
                logging.getLogger("dosa.host").warning("%s; results will need retransmission", e)
                self.multicast_group = None
        self.dpu_table = addr_arrays(job.dpus)
        self._owner = np.asarray(self.pmap.owner(np.arange(self.pmap.num_partitions)), np.int64)
        self._engine = None
        self._dpu_ip_of = {int(ip): d for d, ip in enumerate(self.dpu_table[0])}
        self._encoder: RoundEncoder | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: what this client's rounds did (host_lib.round_context.RoundStats): every round adds to it
        self.round_stats = RoundStats()
        #: the retransmission timer, from the round trips this client measured (host_lib/rto.py)
        self.rtt = RttEstimator(self.retx_interval)
        self._rng = np.random.default_rng() if shuffle_sends else None

    # what the rounds report, by the names the client always had
    round = property(lambda self: self.round_stats.rounds, doc="completed rounds: the next round's number")
    retransmissions = property(lambda self: self.round_stats.retransmissions)
    retransmit_causes = property(lambda self: self.round_stats.retransmit_causes,
                                 doc="retransmissions by cause (host_lib.round_context.RoundStats)")
    last_missing = property(lambda self: self.round_stats.last_missing)
    phase_cpu = property(lambda self: self.round_stats.phase_cpu,
                         doc="CPU seconds by phase of the rounds; the benchmark's phase breakdown")

    def _round_engine(self):
        """The compiled round engine (host_lib/_engine.pyx), made once per client: its buffers
        (receive, entry arena) are reused by every round."""
        if self._engine is None:
            from ._engine import RoundEngine

            P = self.pmap.num_partitions
            # aggregation slots (docs/dataplane.md, *Slots*): partition p shares its DPU's slot with
            # p - M*S (M DPUs, S slots there), and may be sent only once that one's result is in: a
            # slot's next occupant can complete only when every host sent it, so then every host
            # holds the previous result and the DPU may clear it. gate[p] = that partition, or -1.
            M = self.pmap.num_dpus
            step = M * np.array([self.job.slots_on(d) for d in range(M)], np.int64)[self._owner]
            gate = np.where(np.arange(P) >= step, np.arange(P) - step, -1)
            self._engine = RoundEngine(P, self.pmap.partition_size, self.job.numel, gate,
                                       self.job.job_id, *self.dpu_table, self.window, self.ep.gso,
                                       self.ep.counters,
                                       int(self._rng.integers(1, 2**62)) if self._rng is not None else 0)
        return self._engine

    def _context(self) -> RoundContext:
        """What a round of this client gets (host_lib.round_context): it reports into round_stats."""
        return RoundContext(self.job, self.worker_id, self.pmap, self.ep, self._round_engine(),
                            self._owner, self.dpu_table, self.rtt, self.timeout, self.membership,
                            self.round_stats, self._rng)

    # ------------------------------------------------------------------ public API
    @classmethod
    def from_env(cls, numel: int, **kw) -> "AggregationClient":
        """Join the job the DOSA_* environment names (``dosa testbed run`` sets it): the control
        plane at DOSA_CONTROL_ADDR:DOSA_CONTROL_PORT, or an explicit DOSA_JOB_CONFIG file.
        ``worker_id`` (default RANK) and ``join`` (``job_id``, ``workers``, ...) override what the
        environment says: the node-aware hook joins its slice's job as its node
        (host_lib.hook_node)."""
        env = RankEnv.parse()
        worker_id = kw.pop("worker_id", None)
        worker_id = env.rank if worker_id is None else worker_id
        if env.job_config:
            return cls(JobConfig.load(env.job_config), worker_id=worker_id, **kw)
        if env.control is None:
            raise DosaError("no dosa job in the environment: set DOSA_CONTROL_ADDR/DOSA_CONTROL_PORT "
                            "or DOSA_JOB_CONFIG")
        # what the environment leaves unset, dosa.join.join_view reads from it; a host's own
        # defaults for the job its join may create: job 1 of one worker, the path's MTU
        join = {"env": env, "job_id": env.job_id or 1, "workers": env.world_size or 1,
                **(kw.pop("join", None) or {})}
        if "mtu" not in join:
            # the largest frame the path to the DPU takes (every rank computes the same on a fabric
            # of one MTU, so the job's first joiner and the rest agree)
            mtu = path_mtu((env.dpu_addrs or [env.control[0]])[0])  # plain IPv4 addresses
            if mtu is not None and mtu >= wire.MIN_MTU:
                join["mtu"] = min(mtu, wire.MAX_MTU)
        return cls(worker_id=worker_id, control=env.control, numel=numel, join=join, **kw)

    @property
    def stats(self) -> dict:
        return {"bytes_sent": self.ep.sent_bytes, "bytes_received": self.ep.recv_bytes,
                "packets_sent": self.ep.sent_packets, "packets_received": self.ep.recv_packets,
                "retransmissions": self.retransmissions, "rounds": self.round,
                "retransmit_causes": dict(self.retransmit_causes)}

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
        out = np.zeros(self.job.numel, np.float32)
        ridx, sums = self.allreduce_sparse(sent.indices, sent.values, s, dense_out=out)
        if self.job.mode == ResultMode.GTOPK:
            self._encoder.fold_back(*self._encoder.unapplied(sent, ridx), s)
        m = float(np.abs(dequantize(sums, s)).max()) if len(sums) else 0.0
        if m > 0:
            self.scale_exp = choose_scale_exp(m, self.job.workers)
        return out

    def allreduce_async(self, array: np.ndarray) -> AllreduceHandle:
        """Start ``allreduce(array)`` in the background; rounds run in submission order."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dosa-allreduce")
        return AllreduceHandle(self._pool.submit(self.allreduce, np.array(array, np.float32)))

    def allreduce_sparse(self, indices, values, scale_exp: int, *, dense_out=None,
                         dense_clear=None) -> tuple[np.ndarray, np.ndarray]:
        """One round with entries the caller compressed and quantized itself.

        Args:
            indices: sorted unique u32 positions; values: int32 (respecting clip_bound(workers)).
            scale_exp: the round's exponent, identical on every host.
            dense_out: optional float32 array of numel entries that also gets the result,
                ``sum * 2^-scale_exp`` at every result index, written partition by partition as
                each comes in (while the round waits for the others), after zeroing there the
                indices ``dense_clear`` (ascending unique: what the previous round wrote into it;
                None: nothing to clear). Entries elsewhere are left as they are.
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
        self.round_stats.phase("packetize", t0)
        out = Round(self._context(), batch, int(scale_exp), dense_out, dense_clear).run()
        self.round_stats.rounds += 1
        return out

    def open_fed_round(self, scale_exp: int, *, dense_out=None, dense_clear=None):
        """Start a round fed in ascending partition ranges by this thread (host_lib.stream.FedRound:
        ``feed(indices, values, upto)`` sends a range at once, ``finish()`` returns the result);
        ``dense_out``/``dense_clear`` as for allreduce_sparse."""
        return FedRound(self._context(), int(scale_exp), dense_out, dense_clear)

    def open_stream(self, scale_exp: int):
        """Start a round whose partitions are handed over in ascending ranges while it runs
        (host_lib.stream.SparseStream: a DDP step's buckets, sent as backward produces them)."""
        return SparseStream(self._context(), int(scale_exp))

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
