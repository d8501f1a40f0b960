"""PyTorch DDP communication hook that runs the gradient allreduce through dosa.

Register it like PyTorch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``)::

    state = DosaHookState(density=0.01)             # joins the job named by DOSA_* env variables
    ddp_model.register_comm_hook(state, dosa_hook)

What one training step does (details and the reasons in ``docs/training.md``):

* DDP calls the hook once per gradient bucket, in bucket-index order on every rank. The buckets, in
  that order, tile the job's one index space (the model's gradient size, fixed for the run).
* Each bucket has its own :class:`host_lib.encoder.RoundEncoder` on the bucket's device: error
  feedback (float32 residual whatever the bucket's dtype: fp16/bf16 work), optional DGC momentum
  correction, top-k, fixed point. Only the selected entries cross to host memory.
* **Overlap** (``overlap=True``, the default): the step is one streaming round; a bucket's
  entries go out as soon as DDP hands it over and its future completes as soon as the partitions
  it overlaps are back. ``overlap=False`` parks every bucket until the last one and runs one
  blocking round (the same encoders and bytes: the baseline of the overlap measurement).
* The first dosa step always parks (only then is the model's gradient size known, for the join);
  the first ``dense_warmup_steps`` steps use the process group's dense allreduce.
* If dosa is unavailable (creating the client raises on any rank), every rank agrees, through one
  tiny process-group allreduce, to fall back to the process group's allreduce for the rest of the
  run, with ONE warning.
* **Nodes of several ranks** (torchrun's LOCAL_WORLD_SIZE > 1 on more than one node, or
  ``ranks_per_node``): reduce-scatter inside the node, dosa per slice between nodes (one worker per
  node in each slice's job), all-gather inside the node (``hook_node``).

As PyTorch's PowerSGD hook, the state holds the hyperparameters, the internal state and the
statistics, and the hook function says what happens to a bucket. The parts live beside it:
``hook_config`` (the frozen hyperparameters, the statistics), ``hook_encoders`` (each bucket's
encoder, carried across DDP's bucket rebuild), ``hook_client`` (the client, made once and agreed on
by every rank), ``hook_step`` (a step's buckets streamed or parked, results written back),
``hook_node`` (the node-aware reduction: the node's groups, each rank's slice and its encoder).
"""
# no `from __future__ import annotations`: DDP checks the hook annotations are real types

import logging
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from host_lib import hook_codec
from host_lib.hook_client import HookClient, default_client_factory
from host_lib.hook_config import DosaHookStats, HookConfig
from host_lib.hook_encoders import BucketEncoders
from host_lib.hook_node import NodeReducer, node_client_factory, resolve_ranks_per_node
from host_lib.hook_step import StepRunner, dense_allreduce

log = logging.getLogger(__name__)

__all__ = ["DosaHookState", "DosaHookStats", "dosa_hook", "DosaUnavailableWarning"]


class DosaUnavailableWarning(RuntimeWarning):
    """Issued once when the hook falls back to the process group's dense allreduce."""


class DosaHookState:
    """Configuration, internal state and statistics of :func:`dosa_hook`.

    Args:
        client: an already joined client (``host_lib.client.AggregationClient``, or anything with
            ``allreduce_sparse(indices, values, scale_exp) -> (indices, sums)``, ``stats``,
            ``close()`` and, for overlap, ``pmap`` and ``open_stream(scale_exp)``). Mutually
            exclusive with ``client_factory``.
        client_factory: ``f(numel) -> client``, called lazily at the first dosa step, when the
            gradient size is known. Default (neither given): join the job named by the DOSA_*
            environment variables (what ``dosa testbed run`` sets).
        density: fraction of the gradient entries each host sends per step, in (0, 1]; k per
            bucket is ``host_lib.compress.target_k`` (round(density * bucket size), at least 1).
        dense_warmup_steps: number of first steps reduced densely by the process group (>= 0).
        process_group: group for the dense path and the fallback agreement (default: WORLD).
        scale_exp: fixed-point exponent of the first dosa round (-32..62); later rounds adapt it from
            the previous round's result, identically on every rank. Default: the client's.
        headroom: factor between the largest previous sum and the clip bound when adapting the scale
            (>= 1); larger is safer against growing gradients, smaller is more precise.
        fallback: if True (default), fall back to the process group when dosa is unavailable;
            if False, raise instead.
        momentum: momentum correction (Deep Gradient Compression, Lin et al. 2018), in [0, 1).
            When > 0 every bucket keeps a velocity ``u = momentum * u + g`` and sparsifies
            ``residual + u`` instead of ``residual + g``: the optimizer must then run WITHOUT
            momentum (it would apply it twice).
        momentum_masking: with momentum, zero the velocity of the entries just sent (DGC's
            "momentum factor masking": those entries' past must not push them again).
        job_options: with the default client factory and a control plane, extra job shape for the
            join that creates the job (``partition_size``; ``mode``: ``sum`` or ``gtopk``).
        overlap: stream each bucket as DDP hands it over (default) instead of one blocking round
            at the last bucket.
        method: top-k selector, ``fast`` (default; the Cython single pass on CPU) or ``exact``.
        ranks_per_node: ranks that share a node and reduce inside it first (``hook_node``): None
            (default) takes torchrun's LOCAL_WORLD_SIZE when the job spans more than one node;
            1 keeps every rank a dosa worker of its own. With a ``client_factory``, on nodes of
            several ranks, the factory must join the slice job of this rank (``hook_node``).

    Example::
        >>> # xdoctest: +SKIP
        >>> state = DosaHookState(density=0.01, dense_warmup_steps=10)
        >>> ddp_model.register_comm_hook(state, dosa_hook)
        >>> ... train ...
        >>> print(state.stats.as_dict())
        >>> state.close()
    """

    def __init__(self, client=None, client_factory: Callable[[int], Any] | None = None,
                 density: float = 0.01, dense_warmup_steps: int = 0, process_group=None,
                 scale_exp: int | None = None, headroom: float = 2.0, fallback: bool = True,
                 momentum: float = 0.0, momentum_masking: bool = True, job_options: dict | None = None,
                 overlap: bool = True, method: str = "fast", ranks_per_node: int | None = None):
        if client is not None and client_factory is not None:
            raise ValueError("give either client or client_factory, not both")
        if client_factory is not None and not callable(client_factory):
            raise ValueError(f"client_factory must be callable, got {type(client_factory).__name__}")
        if client is not None and not hasattr(client, "allreduce_sparse"):
            raise ValueError("client must have an allreduce_sparse(indices, values, scale_exp) method")
        # hyperparameters
        self.config = c = HookConfig(density, dense_warmup_steps, scale_exp, headroom, fallback,
                                     momentum, momentum_masking, job_options, overlap, method)
        self.process_group = process_group
        # internal state
        if ranks_per_node is not None:
            resolve_ranks_per_node(ranks_per_node, ranks_per_node)  # the type check, now
        self._ranks_per_node = ranks_per_node
        self._default_client = client_factory is None and client is None
        if self._default_client:
            opts = dict(c.job_options)
            client_factory = lambda numel: default_client_factory(numel, opts)  # noqa: E731
        self._link = HookClient(client, client_factory)
        self._use_fallback = False
        self._encoders = BucketEncoders(c.density, c.method, c.momentum, c.momentum_masking)
        # statistics
        self.stats = DosaHookStats()
        self._runner = StepRunner(c, self._encoders, self.stats)
        self._logged = False
        self._node: NodeReducer | None = None
        self._node_checked = False
        if dist.is_available() and dist.is_initialized():
            self._node_setup()  # every rank makes its state at once: the node's groups now

    density = property(lambda self: self.config.density)
    dense_warmup_steps = property(lambda self: self.config.dense_warmup_steps)
    momentum = property(lambda self: self.config.momentum)
    overlap = property(lambda self: self.config.overlap)

    @property
    def group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def using_fallback(self) -> bool:
        return self._use_fallback

    @property
    def client(self):
        return self._link.client

    @property
    def _residuals(self) -> dict:
        """Each bucket's residual (numpy; for tests and reports); on nodes of several ranks, of
        this rank's slice of each bucket."""
        return self._node.residuals if self._node is not None else self._encoders.residuals

    @property
    def node(self) -> NodeReducer | None:
        """The node-aware reduction (``hook_node``), or None when every rank is a dosa worker."""
        return self._node

    def _node_setup(self) -> NodeReducer | None:
        """Decide once whether ranks reduce inside their node, and if so make the node's groups
        (collectively: every rank calls this at the same point, at construction or at the first
        dosa bucket) and, with the default client, join the slice job instead of the rank's."""
        if not self._node_checked:
            self._node_checked = True
            per = resolve_ranks_per_node(self._ranks_per_node, dist.get_world_size(self.group))
            if per > 1:
                c = self.config
                self._node = NodeReducer.create(per, c.density, c.method, c.momentum, c.momentum_masking)
                if self._default_client:
                    self._link = HookClient(None, node_client_factory(self._node.layout,
                                                                      dict(c.job_options)))
        return self._node

    def _log_config_once(self) -> None:
        if not self._logged:
            self._logged = True
            c = self.config
            log.info("dosa hook: density=%g method=%s overlap=%s momentum=%g dense_warmup_steps=%d "
                     "world_size=%d ranks_per_node=%d headroom=%g initial scale_exp=%s fallback=%s",
                     c.density, c.method, c.overlap, c.momentum, c.dense_warmup_steps, self.world_size,
                     self._node.layout.per_node if self._node is not None else 1, c.headroom,
                     c.scale_exp, c.fallback)

    def connect(self, numel: int) -> None:
        """Join the dosa job now, for a model of ``numel`` gradient entries: every rank calls it,
        like ``init_process_group`` (it agrees across ranks, over the process group, whether dosa
        is available; with ``fallback`` the hook then uses the group's allreduce). Without it the
        first dosa step joins and pays for the join. After DDP wrapped the model::

            state.connect(sum(p.numel() for p in model.parameters() if p.requires_grad))
        """
        if numel < 1:
            raise ValueError(f"numel must be positive, got {numel}")
        self._log_config_once()
        node = self._node_setup()
        self._ensure_client(int(numel) if node is None else node.layout.slice_numel(int(numel)))

    def _ensure_client(self, numel: int) -> None:
        """Create the client (once) and agree across ranks whether every rank has one; if not,
        fall back (or raise, without ``fallback``)."""
        if self._link.ready:
            return
        why = self._link.agree(numel, self.group)
        if why is None:
            if self._runner.scale_exp is None:
                self._runner.scale_exp = hook_codec.initial_scale_exp(self._link.client)
            return
        if not self.config.fallback:
            raise RuntimeError(f"dosa hook: dosa is unavailable ({why}) and fallback=False")
        self._use_fallback = True
        self.stats.fallbacks = 1
        warnings.warn(f"dosa unavailable ({why}); falling back to the process group's dense "
                      f"allreduce for the rest of the run", DosaUnavailableWarning, stacklevel=2)
        self._runner.close()
        self._link.close(log)

    def close(self) -> None:
        """Leave the dosa job (idempotent)."""
        self._runner.close()
        self._link.close(log)
        if self._node is not None:
            self._node.close()

    def refresh_counters(self) -> None:
        """Copy the client's traffic counters into ``stats`` (the last step's are complete once
        DDP has waited for its futures; ``close`` refreshes them too)."""
        for key, val in self._link.counters().items():
            setattr(self.stats, key, val)
        causes = getattr(self._link.client, "retransmit_causes", None)
        if causes is not None:
            self.stats.retransmit_causes = dict(causes)


def dosa_hook(state: DosaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the gradients through a dosa sparse allreduce.

    With ``state.overlap`` each bucket is encoded and its complete partitions sent right away, and
    its future completes when those partitions are back; otherwise buckets are parked until the
    last one (``bucket.is_last()``) and one blocking round reduces all of them
    (``host_lib.hook_step``).

    Args:
        state: the :class:`DosaHookState` (shared by all buckets of the model).
        bucket: the gradient bucket DDP hands over (a flat buffer of several gradients, any float
            dtype, on any device).

    Returns:
        A future whose value is ``bucket.buffer()`` holding the averaged gradient.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(DosaHookState(density=0.01), dosa_hook)
    """
    t0 = time.perf_counter()
    state._log_config_once()
    buf, last, stats, runner = bucket.buffer(), bucket.is_last(), state.stats, state._runner
    if not buf.is_floating_point():
        raise TypeError(f"dosa_hook handles floating-point gradients, got {buf.dtype}")
    if stats.steps < state.dense_warmup_steps or state.using_fallback:
        if last:
            stats.steps += 1
            stats.dense_steps += 1
        return dense_allreduce(buf, state.group, state.world_size)
    node = state._node_setup()
    if node is not None:  # reduce inside the node; dosa carries this rank's slice (hook_node)
        if runner.step is None:
            node.new_step()
        full, (row, plan) = buf, node.reduce_scatter(buf)
        buf = row[plan.a:plan.b]
    step = runner.step or (runner.begin(state.world_size) if node is None else
                           runner.begin(node.layout.nodes, divisor=state.world_size))
    step.buckets += 1
    if node is None:
        enc, remapped = state._encoders.for_bucket(bucket, buf, step.world, dist.get_rank(state.group))
    else:
        enc, remapped = node.encoder(bucket, full, plan, step.world, dist.get_rank(state.group))
    if remapped:
        stats.residual_remaps += 1
        log.debug("dosa hook: bucket %d changed layout; carrying its residual over", bucket.index())
    if state.overlap and state._link.streams:
        fut = runner.stream_bucket(step, state.client, buf, enc, last)
    else:
        fut = runner.park(step, bucket.index(), buf, enc if node is not None else None)
    if node is not None:
        fut = node.gather(fut, row, plan, full)
    if last:
        stats.steps += 1
        if step.stream is None:
            # Every bucket of the step is parked now, so the job's size is known and no collective
            # of this step is in flight: the moment to create the client and agree on it.
            state._ensure_client(runner.parked_numel(step))
            if state.using_fallback:
                stats.dense_steps += 1
                runner.run_parked_dense(step, state.group if node is None else node.slice_group)
                return fut
            runner.run_parked(step, state.client)
    step.hook_seconds += time.perf_counter() - t0
    if last:
        runner.end(step, step.offset)
        state.refresh_counters()
    return fut
