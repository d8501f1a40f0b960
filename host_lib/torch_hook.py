"""PyTorch DDP communication hook that runs the gradient allreduce through dosa.

Register it like PyTorch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``)::

    state = DosaHookState(density=0.01)             # joins the job named by DOSA_* env variables
    ddp_model.register_comm_hook(state, dosa_hook)

What one training step does (details and the reasons in ``docs/training.md``):

* DDP calls the hook once per gradient bucket, in bucket-index order on every rank. The hook parks
  every bucket until the last one of the step arrives and then runs **one dosa round over the
  concatenation of all buckets**: one index space per job (the model's gradient size, fixed for the
  whole run), a global top-k across layers, and one round per step, so every rank's rounds line up
  by construction.
* Per bucket, the error-feedback residual (keyed by bucket index) is added to the gradient; the
  concatenation is sparsified (top-k of ``|g + r|``), quantized to int32 fixed point, and summed by the
  DPU; everything not sent (unselected entries, rounding error, the clipped part, and in ``gtopk`` jobs
  the entries the DPU did not return) stays in the residual, so nothing is lost over time.
* The result is scattered into each bucket's buffer as ``sum / world_size`` (DDP averages).
* The first ``dense_warmup_steps`` steps use the process group's dense allreduce.
* If dosa is unavailable (creating the client raises on any rank), every rank agrees, through one
  tiny process-group allreduce, to fall back to the process group's allreduce for the rest of the
  run, with ONE warning. Agreement matters: a rank that silently went dense while others wait for
  its dosa packets would hang or desynchronise the replicas.
"""
# no `from __future__ import annotations`: DDP checks the hook annotations are real types

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from host_lib import hook_codec

log = logging.getLogger(__name__)

__all__ = ["DosaHookState", "DosaHookStats", "dosa_hook", "DosaUnavailableWarning"]


class DosaUnavailableWarning(RuntimeWarning):
    """Issued once when the hook falls back to the process group's dense allreduce."""


@dataclass
class DosaHookStats:
    """What the hook did so far. Byte counts are UDP payload bytes this host sent/received in dosa
    rounds, as reported by the client (``bytes_sent``/``bytes_received`` counters)."""

    steps: int = 0  #: optimizer steps seen (hook invocations for the last bucket)
    dosa_rounds: int = 0  #: steps whose gradients went through dosa
    dense_steps: int = 0  #: steps that used the process group (warm-up or fallback)
    fallbacks: int = 0  #: 1 once the hook fell back to the process group for good
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmissions: int = 0
    entries_sent: int = 0  #: nonzero (index, value) pairs this host sent
    numel: int = 0  #: size of the concatenated gradient
    buckets_per_step: int = 0  #: DDP buckets concatenated into the last dosa round
    densities: list[float] = field(default_factory=list)  #: sent entries / numel, per dosa round
    residual_remaps: int = 0  #: buckets whose layout changed (DDP rebuilds buckets after step 1)
    dosa_seconds: float = 0.0  #: wall time spent in dosa rounds (encode + allreduce + decode)
    allreduce_seconds: float = 0.0  #: of which waiting for the network round (client.allreduce_sparse)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["densities"] = list(self.densities)
        d["mean_density"] = float(np.mean(self.densities)) if self.densities else 0.0
        d["bytes_per_round"] = ((self.bytes_sent + self.bytes_received) / self.dosa_rounds
                                if self.dosa_rounds else 0.0)
        return d


def _default_client_factory(numel: int, job_options: dict | None = None):
    """Join the job the environment names with host_lib's AggregationClient: an explicit
    DOSA_JOB_CONFIG file, or the control plane at DOSA_CONTROL_ADDR:DOSA_CONTROL_PORT (set by
    ``dosa testbed run``). ``job_options`` (e.g. ``partition_size``, ``mode``) shape the job when this
    rank is the one whose join creates it."""
    from dosa.errors import DosaError
    from host_lib.client import AggregationClient  # imported late: dosa may be absent

    env = os.environ
    if job_options and not env.get("DOSA_JOB_CONFIG") and env.get("DOSA_CONTROL_ADDR") \
            and env.get("DOSA_CONTROL_PORT"):
        from control.api import join

        rank = int(env.get("RANK", "0"))
        job = join((env["DOSA_CONTROL_ADDR"], int(env["DOSA_CONTROL_PORT"])), worker_id=rank,
                   numel=numel, **job_options)
        client = AggregationClient(job, worker_id=rank)
    else:
        client = AggregationClient.from_env(numel=numel)
    job_numel = getattr(getattr(client, "job", None), "numel", numel)
    if job_numel != numel:
        client.close()
        raise DosaError(f"the dosa job has numel {job_numel} but the model's gradient has {numel} "
                        f"entries")
    return client


class DosaHookState:
    """Configuration, internal state and statistics of :func:`dosa_hook`.

    Args:
        client: an already joined client (``host_lib.client.AggregationClient`` or anything with
            ``allreduce_sparse(indices, values, scale_exp) -> (indices, sums)``, ``stats`` and
            ``close()``). Mutually exclusive with ``client_factory``.
        client_factory: ``f(numel) -> client``, called lazily at the first dosa step, when the
            gradient size is known. Default (neither given): join the job named by the DOSA_*
            environment variables (what ``dosa testbed run`` sets).
        density: fraction of the gradient entries each host sends per step, in (0, 1].
        dense_warmup_steps: number of first steps reduced densely by the process group (>= 0).
        process_group: group for the dense path and the fallback agreement (default: WORLD).
        scale_exp: fixed-point exponent of the first dosa round (-32..62); later rounds adapt it from
            the previous round's result, identically on every rank. Default: the client's.
        headroom: factor between the largest previous sum and the clip bound when adapting the scale
            (>= 1); larger is safer against growing gradients, smaller is more precise.
        fallback: if True (default), fall back to the process group when dosa is unavailable;
            if False, raise instead.
        momentum: momentum correction (Deep Gradient Compression, Lin et al. 2018), in [0, 1).
            When > 0 the hook keeps a per-bucket velocity ``u = momentum * u + g`` and sparsifies
            ``residual + u`` instead of ``residual + g``: the optimizer must then run WITHOUT
            momentum (it would apply it twice). Sparsifying the velocity, not the gradient, keeps
            momentum from acting on stale residuals, which is what slows plain error feedback.
        job_options: with the default client factory and a control plane, extra job shape for the
            join that creates the job (``partition_size``: spread a small model over several DPUs;
            ``mode``: ``sum`` or ``gtopk``).
        momentum_masking: with momentum, zero the velocity of the entries just sent (DGC's
            "momentum factor masking": those entries' past must not push them again).

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
                 momentum: float = 0.0, momentum_masking: bool = True, job_options: dict | None = None):
        if client is not None and client_factory is not None:
            raise ValueError("give either client or client_factory, not both")
        if client_factory is not None and not callable(client_factory):
            raise ValueError(f"client_factory must be callable, got {type(client_factory).__name__}")
        if client is not None and not hasattr(client, "allreduce_sparse"):
            raise ValueError("client must have an allreduce_sparse(indices, values, scale_exp) method")
        if isinstance(density, bool) or not isinstance(density, (int, float)) \
                or not math.isfinite(density) or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if isinstance(dense_warmup_steps, bool) or not isinstance(dense_warmup_steps, int) \
                or dense_warmup_steps < 0:
            raise ValueError(f"dense_warmup_steps must be an integer >= 0, got {dense_warmup_steps!r}")
        if scale_exp is not None and (isinstance(scale_exp, bool) or not isinstance(scale_exp, int)
                                      or not hook_codec.SCALE_EXP_MIN <= scale_exp <= hook_codec.SCALE_EXP_MAX):
            raise ValueError(f"scale_exp must be an integer in [{hook_codec.SCALE_EXP_MIN}, "
                             f"{hook_codec.SCALE_EXP_MAX}], got {scale_exp!r}")
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
                or not math.isfinite(headroom) or headroom < 1.0:
            raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")

        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
                or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        # hyperparameters
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.density = float(density)
        self.dense_warmup_steps = dense_warmup_steps
        self.process_group = process_group
        self.headroom = float(headroom)
        self.allow_fallback = bool(fallback)
        self.initial_scale_exp = scale_exp
        # internal state
        self._client = client
        if job_options is not None and not isinstance(job_options, dict):
            raise ValueError(f"job_options must be a dict, got {type(job_options).__name__}")
        if client_factory is None and client is None:
            opts = dict(job_options or {})
            client_factory = lambda numel: _default_client_factory(numel, opts)  # noqa: E731
        self._client_factory = client_factory
        self._client_ready = False  # creation + cross-rank agreement done
        self._use_fallback = False
        self._residuals: dict[int, np.ndarray] = {}  # bucket index -> float32 residual
        self._velocities: dict[int, np.ndarray] = {}  # bucket index -> velocity (momentum > 0)
        self._layouts: dict[int, tuple] = {}  # bucket index -> parameter layout signature
        self._pending: list[tuple[int, torch.Tensor, torch.futures.Future]] = []
        self._prev: tuple[dict, dict, dict] = ({}, {}, {})
        self._scale_exp: int | None = scale_exp
        self._client_base: dict[str, int] = {}
        # statistics
        self.stats = DosaHookStats()
        self._logged = False

    # ------------------------------------------------------------------ helpers
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
        return self._client

    def _log_config_once(self) -> None:
        if not self._logged:
            self._logged = True
            log.info("dosa hook: density=%g dense_warmup_steps=%d world_size=%d headroom=%g "
                     "initial scale_exp=%s fallback=%s", self.density, self.dense_warmup_steps,
                     self.world_size, self.headroom, self.initial_scale_exp, self.allow_fallback)

    def _ensure_client(self, numel: int) -> None:
        """Create the client (once) and agree across ranks whether every rank has one."""
        if self._client_ready:
            return
        error: BaseException | None = None
        if self._client is None:
            try:
                self._client = self._client_factory(numel)
            except Exception as e:  # noqa: BLE001 - any failure means "dosa unavailable"
                error = e
        ok = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.SUM, group=self.group)
        n_failed = int(ok.item())
        self._client_ready = True
        if n_failed == 0:
            self._client_base = hook_codec.client_counters(self._client)
            if self._scale_exp is None:
                self._scale_exp = hook_codec.initial_scale_exp(self._client)
            return
        why = (f"{type(error).__name__}: {error}" if error is not None
               else f"dosa is unavailable on {n_failed} other rank(s)")
        if not self.allow_fallback:
            raise RuntimeError(f"dosa hook: dosa is unavailable ({why}) and fallback=False")
        self._use_fallback = True
        self.stats.fallbacks = 1
        warnings.warn(f"dosa unavailable ({why}); falling back to the process group's dense "
                      f"allreduce for the rest of the run", DosaUnavailableWarning, stacklevel=2)
        self.close()

    def _residual_for(self, bucket: dist.GradBucket, numel: int) -> np.ndarray:
        """The bucket's residual (and velocity). DDP rebuilds its buckets after the first step
        (gradient-ready order): a bucket whose parameter layout changed gets its parameters'
        residual carried over from wherever they were, so nothing sent to the residual is lost."""
        idx = bucket.index()
        if not self._pending:  # first bucket of a step: the layouts every bucket had before it
            self._prev = (dict(self._layouts), dict(self._residuals), dict(self._velocities))
        layout = tuple((p.data_ptr(), tuple(p.shape)) for p in bucket.parameters())
        if self._layouts.get(idx) != layout or self._residuals[idx].size != numel:
            old_layouts, old_res, old_vel = self._prev
            if old_layouts:
                self.stats.residual_remaps += 1
                log.debug("dosa hook: bucket %d changed layout; carrying its residual over", idx)
            self._layouts[idx] = layout
            self._residuals[idx] = carry_over(old_layouts, old_res, layout, numel)
            if self.momentum:
                self._velocities[idx] = carry_over(old_layouts, old_vel, layout, numel)
        return self._residuals[idx]

    def close(self) -> None:
        """Leave the dosa job (idempotent)."""
        client, self._client = self._client, None
        if client is not None and hasattr(client, "close"):
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 - closing must not mask the real outcome
                log.warning("dosa hook: closing the client failed: %s", e)

    # ------------------------------------------------------------------ the dosa round
    def _run_round(self) -> None:
        """Concatenate the parked buckets, run one dosa round, complete every bucket's future."""
        pending, self._pending = self._pending, []
        t0 = time.perf_counter()
        try:
            bufs = [b.detach().reshape(-1) for _, b, _ in pending]
            sizes = [b.numel() for b in bufs]
            parts = []
            for (i, _, _), b in zip(pending, bufs):
                g = b.numpy().astype(np.float32, copy=False)
                if self.momentum:
                    u = self._velocities[i]
                    u *= self.momentum
                    u += g
                    g = u
                parts.append(g + self._residuals[i])
            acc = np.concatenate(parts)
            world = self.world_size
            enc = hook_codec.encode(acc, self.density, self._scale_exp, world)
            t1 = time.perf_counter()
            res_idx, res_sums = self._client.allreduce_sparse(enc.indices, enc.values, enc.scale_exp)
            self.stats.allreduce_seconds += time.perf_counter() - t1
            avg, new_residual, max_abs = hook_codec.decode(acc.size, enc, res_idx, res_sums, world)
            self._scale_exp = hook_codec.next_scale_exp(max_abs, world, self.headroom, enc.scale_exp)
            if self.momentum and self.momentum_masking and enc.indices.size:
                starts = np.cumsum([0] + sizes)
                which = np.searchsorted(starts, enc.indices, side="right") - 1
                for j, (i, _, _) in enumerate(pending):
                    sel = enc.indices[which == j].astype(np.int64) - starts[j]
                    self._velocities[i][sel] = 0.0
            off = 0
            for (i, buf, fut), n in zip(pending, sizes):
                self._residuals[i] = new_residual[off:off + n]
                buf.copy_(torch.from_numpy(avg[off:off + n]).view_as(buf))
                off += n
            st = self.stats
            st.dosa_rounds += 1
            st.numel = acc.size
            st.buckets_per_step = len(pending)
            st.entries_sent += int(enc.indices.size)
            st.densities.append(enc.indices.size / acc.size if acc.size else 0.0)
            for key, val in hook_codec.client_counters(self._client).items():
                setattr(st, key, val - self._client_base.get(key, 0))
            st.dosa_seconds += time.perf_counter() - t0
        except BaseException as e:
            for _, _, fut in pending:
                fut.set_exception(e)
            raise
        for _, buf, fut in pending:
            fut.set_result(buf)


def carry_over(old_layouts: dict, old_arrays: dict, layout: tuple, numel: int) -> np.ndarray:
    """A per-bucket array (residual or velocity) for a bucket of ``layout`` (a tuple of
    (data_ptr, shape) per parameter, in bucket order, which is the buffer order), filled from the
    arrays of the old buckets that held the same parameters; zeros where a parameter is new."""
    where = {}
    for b, lay in old_layouts.items():
        arr = old_arrays.get(b)
        if arr is None:
            continue
        off = 0
        for key in lay:
            n = math.prod(key[1])
            where[key] = (arr, off, n)
            off += n
    out = np.zeros(numel, dtype=np.float32)
    off = 0
    for key in layout:
        n = math.prod(key[1])
        if key in where:
            arr, o, m = where[key]
            out[off:off + n] = arr[o:o + m]
        off += n
    return out


def _dense_allreduce(state: DosaHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The process group's allreduce, averaged: what DDP does without a hook."""
    buf = bucket.buffer()
    buf.div_(state.world_size)
    return (dist.all_reduce(buf, group=state.group, async_op=True)
            .get_future().then(lambda fut: fut.value()[0]))


def dosa_hook(state: DosaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the gradients through a dosa sparse allreduce.

    Buckets of a step are parked until the last one (``bucket.is_last()``) arrives; then one dosa
    round reduces all of them and their futures complete together (DDP waits for all futures only at
    the end of backward, so parking costs no overlap that a blocking round could have had).

    Args:
        state: the :class:`DosaHookState` (shared by all buckets of the model).
        bucket: the gradient bucket DDP hands over (a flat float32 buffer of several gradients).

    Returns:
        A future whose value is ``bucket.buffer()`` holding the averaged gradient.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(DosaHookState(density=0.01), dosa_hook)
    """
    state._log_config_once()
    buf = bucket.buffer()
    if buf.dtype != torch.float32:
        raise TypeError(f"dosa_hook handles float32 gradients, got {buf.dtype}")
    last = bucket.is_last()
    if state.stats.steps < state.dense_warmup_steps or state._use_fallback:
        if last:
            state.stats.steps += 1
            state.stats.dense_steps += 1
        return _dense_allreduce(state, bucket)
    state._residual_for(bucket, buf.numel())
    fut: torch.futures.Future = torch.futures.Future()
    state._pending.append((bucket.index(), buf, fut))
    if not last:
        return fut
    state.stats.steps += 1
    # Every bucket of the step is parked now, so the job's size is known and no collective of
    # this step is in flight: the moment to create the client and agree on it across ranks.
    state._ensure_client(sum(b.numel() for _, b, _ in state._pending))
    if state._use_fallback:
        state.stats.dense_steps += 1
        pending, state._pending = state._pending, []
        for _, pbuf, pfut in pending:
            pbuf.div_(state.world_size)
            work = dist.all_reduce(pbuf, group=state.group, async_op=True)
            work.get_future().then(lambda f, pfut=pfut, pbuf=pbuf: pfut.set_result(pbuf))
        return fut
    state._run_round()
    return fut
