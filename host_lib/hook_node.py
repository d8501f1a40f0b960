"""The DDP hook on nodes of several ranks: reduce inside the node, dosa between nodes, gather inside.

A GPU node runs several ranks (torchrun's LOCAL_WORLD_SIZE) that share one NIC. Sending every
rank's top-k through that NIC sends the node's partitions L times, and a job's 64 workers
(``dosa.wire.MAX_WORKERS``) would be 64 processes, not 64 nodes. So, as NCCL's CollNet with SHARP
does, a bucket is handled in three steps:

1. **reduce-scatter inside the node** (the node's own process group: NVLink with NCCL on GPUs, Gloo
   here): local rank l owns the entries of the model's flat index space (the buckets in bucket
   order, as dosa's jobs number them) whose index is l modulo L, and receives the node's sum of
   them (:meth:`NodeLayout.plan`: one transposing copy puts each rank's entries side by side);
2. **dosa between nodes, per slice**: local rank l runs the hook's usual step (its encoders, its
   stream, its client) on slice l only, in its own dosa job, *slice job l*, whose N workers are the
   N nodes (worker id = the node's index). The DPU sees nodes, not processes: L jobs of N workers,
   each carrying 1/L of the model, so a node's link carries one node's traffic;
3. **all-gather inside the node**: each local rank's averaged slice goes to every rank of the node.

Why interleaved and not L contiguous pieces of each bucket: a job's size is fixed for the run, and
DDP rebuilds its buckets after the first step. Entries l, l + L, l + 2L, ... of the whole space
number ``ceil((numel - l) / L)`` whatever the buckets are; L pieces of each bucket, padded to equal
lengths for the reduce-scatter, would sum to a total that changes with the buckets. And every
bucket still splits evenly over the node's ranks, so they all work on every bucket.

Slice job l of the job J the environment names is job ``J + l`` (wrapping in 1..2^32-1; ``dosa
testbed run --ranks-per-node L`` reserves J..J+L-1) and local rank l binds DOSA_PORT + l
(``dosa.env.RankEnv.own_port``), so every node's worker of job l has the same port and the
results reach them by one multicast datagram.

**Error feedback stays exact.** The residual (and DGC's velocity) of slice l lives on local rank l,
in the node-sum domain: each entry of the node's gradient is owned by exactly one local rank, which
adds it to its residual, selects, and keeps what it did not send, as a flat rank does for its own
gradient; so what one node holds back is held once, by one rank. When DDP rebuilds its buckets
(after the first step) the slices cover other parameters, possibly owned by another local rank: each
rank spreads its old slices' residual over the new bucket layout (``hook_encoders.carry_over``, zeros
where it owned nothing) and a reduce-scatter inside the node hands each new owner its part. Every
entry has one non-zero contributor, so that sum is exact: nothing is lost or counted twice.

Collectives are issued in the same order on every rank of a node, as Gloo and NCCL need: the
reduce-scatters (and a rebuild's carry-over) from the hook, in bucket order, on one node group; the
all-gathers from one gathering thread, in bucket order, on a second node group (two threads issuing
on one group could interleave differently on two ranks).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from host_lib.encoder import RoundEncoder
from host_lib.hook_encoders import carry_over

log = logging.getLogger(__name__)

#: DOSA_JOB_ID is 1..2^32-1 (0 is no job)
_JOB_IDS = 2**32 - 1


@dataclass(frozen=True)
class NodeLayout:
    """Where a rank sits: node ``node`` of ``nodes``, local rank ``local`` of ``per_node``.
    torchrun numbers a node's ranks consecutively: rank = node * per_node + local."""

    node: int
    nodes: int
    local: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def rank(self) -> int:
        return self.node * self.per_node + self.local

    def slice_numel(self, numel: int) -> int:
        """Entries of this rank's slice job: the indices below ``numel`` equal to its local rank
        modulo ``per_node`` (the same whatever DDP's buckets are)."""
        return max(0, -(-(numel - self.local) // self.per_node))

    def plan(self, off: int, n: int) -> "BucketPlan":
        """How the bucket at ``off`` (its first entry's index in the job's space) of ``n`` entries
        is laid out for the node's collectives (:class:`BucketPlan`)."""
        per, me = self.per_node, self.local
        lead = off % per
        c = -(-(lead + n) // per)
        a = max(0, -(-(lead - me) // per))
        b = min(c, max(a, -(-(lead + n - me) // per)))
        return BucketPlan(off, n, lead, c, a, b)

    def slice_job_id(self, job_id: int) -> int:
        """The dosa job of this rank's slice: job_id + local rank, in 1..2^32-1."""
        return (int(job_id) - 1 + self.local) % _JOB_IDS + 1

    def node_ranks(self, node: int) -> list[int]:
        return [node * self.per_node + i for i in range(self.per_node)]

    def slice_ranks(self, local: int) -> list[int]:
        """The ranks that hold slice ``local`` on every node (the workers of slice job ``local``)."""
        return [n * self.per_node + local for n in range(self.nodes)]


@dataclass(frozen=True)
class BucketPlan:
    """A bucket of ``n`` entries starting at index ``off``, padded with ``lead`` zeros in front (so
    that its padded position t has index off - lead + t, whose owner is t modulo L) and zeros at the
    back up to ``L * c``, viewed as c rows of L: column l (made row l of the reduce-scatter's input
    by one transposing copy) is local rank l's. Of its ``c`` entries, [a, b) are the bucket's;
    those are this rank's slice, entries off + (a..b) * L + l - lead... of the job's space, which are
    consecutive in its slice job's space."""

    off: int
    n: int
    lead: int
    c: int
    a: int
    b: int

    def rows(self, x: torch.Tensor, per: int) -> torch.Tensor:
        """The reduce-scatter's input: ``x`` (the bucket, n entries) padded and transposed so that
        rank l's entries are the l-th block of c."""
        flat = x.reshape(-1)
        padded = flat.new_zeros(per * self.c)
        padded[self.lead:self.lead + self.n] = flat
        return padded.view(self.c, per).t().contiguous().view(-1)

    def unrows(self, gathered: torch.Tensor, per: int) -> torch.Tensor:
        """The inverse of :meth:`rows`: the bucket's n entries from the all-gather's output."""
        return gathered.view(per, self.c).t().reshape(-1)[self.lead:self.lead + self.n]

    def positions(self, local: int, per: int) -> torch.Tensor:
        """Where this rank's slice entries sit in the bucket (0..n-1), in slice order."""
        return torch.arange(self.a, self.b, dtype=torch.int64) * per + local - self.lead


def resolve_ranks_per_node(option: int | None, world: int, env=None) -> int:
    """How many ranks of a node reduce together. ``option`` None: torchrun's LOCAL_WORLD_SIZE when
    it is above 1 and the job spans more than one node (on a single node there is no one to
    aggregate with across the network: the ranks stay flat dosa workers, as on the loopback demo);
    an int forces it (1: flat). A ValueError sentence when it does not divide the world."""
    env = os.environ if env is None else env
    if option is None:
        try:
            per = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {env.get('LOCAL_WORLD_SIZE')!r}") from None
        return per if 1 < per < world and world % per == 0 else 1
    if isinstance(option, bool) or not isinstance(option, int) or option < 1:
        raise ValueError(f"ranks_per_node must be an integer >= 1, got {option!r}")
    if world % option:
        raise ValueError(f"ranks_per_node {option} does not divide the world size {world}")
    return option


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Sum ``inp`` (L * len(out) entries) over ``group``; this rank's share lands in ``out``
    (torch >= 2.13 calls it reduce_scatter_single; 2.x before, reduce_scatter_tensor)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class _Gatherer:
    """The all-gathers of a node, one bucket after another in bucket order, on their own thread and
    node group: a bucket's slice future completes (on dosa's stream thread, in any order), the
    thread gathers the node's slices into the bucket and completes DDP's future.

    Not a daemon, for the reason of host_lib.hook_step's encoding thread (it completes torch
    futures); it ends once the main thread has."""

    def __init__(self, group, per: int):
        self.group, self.per = group, per
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t: threading.Thread | None = None

    def submit(self, slice_fut: torch.futures.Future, row: torch.Tensor, plan: BucketPlan,
               buf: torch.Tensor, fut: torch.futures.Future) -> None:
        if self._t is None or not self._t.is_alive():
            self._t = threading.Thread(target=self._run, name="dosa-node-gather", daemon=False)
            self._t.start()
        self._q.put((slice_fut, row, plan, buf, fut))

    def close(self) -> None:
        if self._t is not None and self._t.is_alive():
            self._q.put(None)
            self._t.join(timeout=30)

    def _run(self) -> None:
        main = threading.main_thread()
        while True:
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                if not main.is_alive():
                    return
                continue
            if item is None:
                return
            slice_fut, row, plan, buf, fut = item
            try:
                slice_fut.wait()
                full = row.new_empty(row.numel() * self.per)
                _all_gather(full, row, self.group)
                buf.view(-1).copy_(plan.unrows(full, self.per))
            except BaseException as e:  # noqa: BLE001 - DDP re-raises it from the future
                fut.set_exception(e)
                continue
            fut.set_result(buf)


class NodeReducer:
    """A rank's part in the node-aware hook: its node's groups, the slice of each bucket it owns
    (with that slice's encoder), and the gathering thread. Made by every rank at once (the groups
    are created collectively, in the same order everywhere)."""

    def __init__(self, layout: NodeLayout, density: float, method: str, momentum: float,
                 masking: bool):
        self.layout = lay = layout
        self.density, self.method, self.momentum, self.masking = density, method, momentum, masking
        # every rank creates every group, in one order (torch.distributed.new_group's rule)
        rs = [dist.new_group(lay.node_ranks(n)) for n in range(lay.nodes)]
        ag = [dist.new_group(lay.node_ranks(n)) for n in range(lay.nodes)]
        cross = [dist.new_group(lay.slice_ranks(i)) for i in range(lay.per_node)]
        self.node_group, self.gather_group = rs[lay.node], ag[lay.node]
        #: the ranks holding this rank's slice on every node: the dense fallback of a parked step
        self.slice_group = cross[lay.local]
        self._gather = _Gatherer(self.gather_group, lay.per_node)
        self._offset = 0  #: where the step's next bucket starts in the job's (unsliced) space
        self.encoders: dict[int, RoundEncoder] = {}
        self.keys: dict[int, tuple] = {}  #: bucket index -> (parameter layout, offset)
        self.plans: dict[int, BucketPlan] = {}
        self._prev: tuple[dict, dict, dict] = ({}, {}, {})
        log.info("dosa hook: node-aware, node %d of %d, local rank %d of %d", lay.node, lay.nodes,
                 lay.local, lay.per_node)

    @classmethod
    def create(cls, per_node: int, density: float, method: str, momentum: float,
               masking: bool) -> "NodeReducer":
        """From torch.distributed's rank and world: node = rank // per_node (torchrun's numbering,
        checked against LOCAL_RANK when it is set)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        lay = NodeLayout(rank // per_node, world // per_node, rank % per_node, per_node)
        env_local = os.environ.get("LOCAL_RANK")
        if env_local not in (None, "") and int(env_local) != lay.local:
            raise ValueError(f"rank {rank} has LOCAL_RANK {env_local}, but with {per_node} ranks per "
                             f"node it would be local rank {lay.local}: the node-aware hook needs "
                             f"a node's ranks numbered consecutively (torchrun's order)")
        return cls(lay, density, method, momentum, masking)

    # ------------------------------------------------------------------ a bucket
    def new_step(self) -> None:
        """A step's first bucket: offsets start again; the next step's rebuilt buckets carry their
        residuals over from this step's encoders."""
        self._offset = 0
        self._prev = (dict(self.keys), dict(self.encoders), dict(self.plans))

    def reduce_scatter(self, buf: torch.Tensor) -> tuple[torch.Tensor, BucketPlan]:
        """This rank's row of the node's sum of ``buf`` (the step's next bucket), in buf's dtype,
        and the bucket's plan: the slice dosa reduces is ``row[plan.a:plan.b]``."""
        plan = self.layout.plan(self._offset, buf.numel())
        self._offset += buf.numel()
        row = buf.new_empty(plan.c)
        _reduce_scatter(row, plan.rows(buf, self.layout.per_node), self.node_group)
        return row, plan

    def gather(self, slice_fut: torch.futures.Future, row: torch.Tensor, plan: BucketPlan,
               buf: torch.Tensor) -> torch.futures.Future:
        """DDP's future for ``buf``: completed once ``slice_fut`` (the slice's dosa result written
        into ``row``) is and the node's rows are gathered into ``buf``."""
        fut: torch.futures.Future = torch.futures.Future()
        self._gather.submit(slice_fut, row, plan, buf, fut)
        return fut

    def encoder(self, bucket, buf: torch.Tensor, plan: BucketPlan, workers: int,
                rank: int) -> tuple[RoundEncoder, bool]:
        """The encoder of this rank's slice of ``bucket`` (its full buffer ``buf``, laid out by
        ``plan``), made anew when the bucket's parameters or offset changed, with the residual (and
        velocity) of those parameters moved from whichever local rank owned them (module
        docstring). Returns (encoder, whether a residual was carried over)."""
        idx, m = bucket.index(), plan.b - plan.a
        key = (tuple((p.data_ptr(), tuple(p.shape)) for p in bucket.parameters()), plan.off)
        enc = self.encoders.get(idx)
        if enc is not None and self.keys.get(idx) == key and enc.numel == m:
            return enc, False
        old_keys, old_encs, old_plans = self._prev
        enc = RoundEncoder(m, self.density, workers, self.method, seed=1000 * rank + idx,
                           device=buf.device, momentum=self.momentum, momentum_masking=self.masking)
        if old_keys:  # the same on every rank of the node: DDP's rebuild is the same everywhere
            old_layouts = {b: k[0] for b, k in old_keys.items()}
            r = self._moved(old_layouts, old_plans, {b: e.r for b, e in old_encs.items()}, key[0], plan)
            u = (self._moved(old_layouts, old_plans, {b: e.u for b, e in old_encs.items()
                                                      if e.u is not None}, key[0], plan)
                 if self.momentum else None)
            enc.load_state(r, u)
        self.keys[idx], self.plans[idx], self.encoders[idx] = key, plan, enc
        return enc, bool(old_keys)

    def _moved(self, old_layouts: dict, old_plans: dict, old_parts: dict, layout: tuple,
               plan: BucketPlan) -> torch.Tensor:
        """This rank's new slice of the state (residual or velocity) the node held for the
        parameters of ``layout``: each rank places its old slices in their old buckets (zeros
        elsewhere), carries them over to the new layout, and the node sums: one owner an entry."""
        per, me = self.layout.per_node, self.layout.local
        full_old = {}
        for b, part in old_parts.items():
            old = old_plans[b]
            part = torch.as_tensor(part).reshape(-1)
            full = torch.zeros(old.n, dtype=torch.float32, device=part.device)
            full[old.positions(me, per).to(part.device)] = part.float()
            full_old[b] = full
        mine = carry_over(old_layouts, full_old, layout, plan.n)
        row = torch.empty(plan.c, dtype=torch.float32, device=mine.device)
        _reduce_scatter(row, plan.rows(mine, per), self.node_group)
        return row[plan.a:plan.b]

    @property
    def residuals(self) -> dict:
        return {i: e.residual for i, e in self.encoders.items()}

    def close(self) -> None:
        self._gather.close()


def node_client_factory(layout: NodeLayout, job_options: dict | None = None):
    """``f(numel) -> client`` joining this rank's slice job (the environment's DOSA_JOB_ID + local
    rank) as its node's worker, with the node count as the job's workers."""
    from dosa.env import RankEnv
    from dosa.errors import DosaError
    from host_lib.client import AggregationClient  # imported late: dosa may be absent

    def factory(numel: int):
        env = RankEnv.parse()
        if env.job_config:
            raise DosaError("the node-aware hook joins one job per local rank through the control "
                            "plane; DOSA_JOB_CONFIG names one job (give a client_factory instead)")
        join = {**dict(job_options or {}), "job_id": layout.slice_job_id(env.job_id or 1),
                "workers": layout.nodes}
        client = AggregationClient.from_env(numel=numel, worker_id=layout.node, join=join)
        job_numel = getattr(getattr(client, "job", None), "numel", numel)
        if job_numel != numel:
            client.close()
            raise DosaError(f"the dosa job has numel {job_numel} but this rank's slices of the "
                            f"model's gradient have {numel} entries")
        return client

    return factory
