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
* **Overlap** (``overlap=True``, the default): the step is one streaming round
  (``host_lib.stream.SparseStream``). A bucket's entries go out as soon as DDP hands the bucket
  over, for every partition the buckets seen so far cover completely; its future completes (in the
  stream's thread) as soon as the partitions it overlaps are back. Encoding and sending run on the
  step's encoding thread (``_EncodeWorker``), buckets in order, so the hook returns to backward at
  once and waits only at the step's last bucket for that thread to finish. ``overlap=False`` parks every bucket until the last one and runs one
  blocking round (the same encoders and bytes: the baseline of the overlap measurement).
* The result is written into each bucket's buffer as ``sum / world_size`` (DDP averages); in
  ``gtopk`` jobs what this host sent but the DPU did not return goes back into the residual.
* The first dosa step always parks (only then is the model's gradient size known, for the join);
  the first ``dense_warmup_steps`` steps use the process group's dense allreduce.
* If dosa is unavailable (creating the client raises on any rank), every rank agrees, through one
  tiny process-group allreduce, to fall back to the process group's allreduce for the rest of the
  run, with ONE warning. Agreement matters: a rank that silently went dense while others wait for
  its dosa packets would hang or desynchronise the replicas.
"""
# no `from __future__ import annotations`: DDP checks the hook annotations are real types

import logging
import math
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from host_lib import hook_codec
from host_lib.compress import METHODS
from host_lib.device import same_device
from host_lib.encoder import EncodedRound, RoundEncoder

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
    overlapped_rounds: int = 0  #: of which streamed bucket by bucket (overlap with backward)
    dense_steps: int = 0  #: steps that used the process group (warm-up or fallback)
    fallbacks: int = 0  #: 1 once the hook fell back to the process group for good
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmissions: int = 0
    #: the client's retransmissions by cause (AggregationClient.retransmit_causes), this hook's run
    retransmit_causes: dict[str, int] = field(default_factory=dict)
    entries_sent: int = 0  #: nonzero (index, value) pairs this host sent
    numel: int = 0  #: size of the whole gradient (all buckets)
    buckets_per_step: int = 0  #: DDP buckets of the last dosa step
    densities: list[float] = field(default_factory=list)  #: sent entries / numel, per dosa round
    residual_remaps: int = 0  #: buckets whose layout changed (DDP rebuilds buckets after step 1)
    hook_seconds: float = 0.0  #: wall time inside the hook in dosa steps: what blocks backward
    hook_seconds_per_step: list[float] = field(default_factory=list)  #: the same, per dosa step
    allreduce_seconds: float = 0.0  #: parked steps: time in the blocking round (client.allreduce_sparse)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["densities"] = list(self.densities)
        d["retransmit_causes"] = dict(self.retransmit_causes)
        d["hook_seconds_per_step"] = list(self.hook_seconds_per_step)
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

    # joined through the control plane, the client keeps a membership (heartbeats; it leaves the
    # job on close, so the job's DPU slots are free for the next run)
    client = AggregationClient.from_env(numel=numel, join=dict(job_options or {}))
    job_numel = getattr(getattr(client, "job", None), "numel", numel)
    if job_numel != numel:
        client.close()
        raise DosaError(f"the dosa job has numel {job_numel} but the model's gradient has {numel} "
                        f"entries")
    return client


class _Step:
    """What the hook keeps while one step's buckets come in."""

    def __init__(self, scale_exp: int):
        self.scale_exp = scale_exp
        self.offset = 0  #: where the next bucket starts in the job's index space
        self.buckets = 0
        self.entries = 0
        self.hook_seconds = 0.0
        self.max_abs: list[float] = []  #: largest |sum| of each bucket's result (next round's scale)
        self.parked: list[tuple[int, torch.Tensor, torch.futures.Future]] = []
        self.stream = None
        self.encoder: _EncodeWorker | None = None  #: overlap: the thread encoding this step's buckets
        self.carry_idx = np.zeros(0, np.uint32)  #: entries of a partition the next bucket completes
        self.carry_q = np.zeros(0, np.int32)


class _EncodeWorker:
    """The step's encoding thread (overlap): each bucket is encoded and its complete partitions
    handed to the stream in the order DDP hands the buckets over, while backward goes on computing
    the next ones (the selection pass and the quantization release the GIL). The hook waits for it
    only at the step's last bucket, so that is all it blocks backward for.

    Not a daemon, for the stream thread's reason (host_lib.stream: it completes torch futures, and
    a daemon thread inside libtorch at exit aborts the process); it also ends once the main thread
    has (a step abandoned by an exception never sends its last bucket)."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="dosa-encode", daemon=False)
        self._t.start()

    def submit(self, fn: Callable[[], None], fut: torch.futures.Future) -> None:
        self._q.put((fn, fut))

    def finish(self) -> None:
        """Wait until every submitted bucket is encoded and sent (or failed)."""
        self._q.put(None)
        self._t.join()

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
            fn, fut = item
            if self._error is None:
                try:
                    fn()
                    continue
                except BaseException as e:  # noqa: BLE001 - DDP re-raises it from the future
                    self._error = e
            fut.set_exception(self._error)


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
                 overlap: bool = True, method: str = "fast"):
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
        if job_options is not None and not isinstance(job_options, dict):
            raise ValueError(f"job_options must be a dict, got {type(job_options).__name__}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        # hyperparameters
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.density = float(density)
        self.dense_warmup_steps = dense_warmup_steps
        self.process_group = process_group
        self.headroom = float(headroom)
        self.allow_fallback = bool(fallback)
        self.initial_scale_exp = scale_exp
        self.overlap = bool(overlap)
        self.method = method
        # internal state
        self._client = client
        if client_factory is None and client is None:
            opts = dict(job_options or {})
            client_factory = lambda numel: _default_client_factory(numel, opts)  # noqa: E731
        self._client_factory = client_factory
        self._client_ready = False  # creation + cross-rank agreement done
        self._use_fallback = False
        self._encoders: dict[int, RoundEncoder] = {}  # bucket index -> residual (+ velocity)
        self._layouts: dict[int, tuple] = {}  # bucket index -> parameter layout signature
        self._prev: tuple[dict, dict] = ({}, {})
        self._scale_exp: int | None = scale_exp
        self._client_base: dict[str, int] = {}
        self._step: _Step | None = None
        self._last_stream = None
        self._last_max_abs: list[float] = []
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

    @property
    def _residuals(self) -> dict[int, np.ndarray]:
        """Each bucket's residual (numpy; for tests and reports)."""
        return {i: e.residual for i, e in self._encoders.items()}

    @property
    def _gtopk(self) -> bool:
        return getattr(getattr(self._client, "job", None), "mode", "sum") == "gtopk"

    def _log_config_once(self) -> None:
        if not self._logged:
            self._logged = True
            log.info("dosa hook: density=%g method=%s overlap=%s momentum=%g dense_warmup_steps=%d "
                     "world_size=%d headroom=%g initial scale_exp=%s fallback=%s", self.density,
                     self.method, self.overlap, self.momentum, self.dense_warmup_steps,
                     self.world_size, self.headroom, self.initial_scale_exp, self.allow_fallback)

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
        self._ensure_client(int(numel))

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

    def _encoder_for(self, bucket: dist.GradBucket, buf: torch.Tensor) -> RoundEncoder:
        """The bucket's encoder (:func:`bucket_encoder`); counts the residuals carried over."""
        enc, remapped = bucket_encoder(self._encoders, self._layouts, self._prev, bucket, buf,
                                       self.density, self.world_size, dist.get_rank(self.group),
                                       self.method, self.momentum, self.momentum_masking)
        if remapped:
            self.stats.residual_remaps += 1
            log.debug("dosa hook: bucket %d changed layout; carrying its residual over", bucket.index())
        return enc

    def close(self) -> None:
        """Leave the dosa job (idempotent)."""
        if self._step is not None and self._step.encoder is not None:
            self._step.encoder.finish()
        stream, self._last_stream = self._last_stream, None
        if stream is not None:
            try:
                stream.finish(timeout=30)
            except Exception as e:  # noqa: BLE001 - closing must not mask the real outcome
                log.warning("dosa hook: the last round failed: %s", e)
        client, self._client = self._client, None
        if client is not None and hasattr(client, "close"):
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 - closing must not mask the real outcome
                log.warning("dosa hook: closing the client failed: %s", e)

    # ------------------------------------------------------------------ one step
    def _begin_step(self) -> _Step:
        """First bucket of a dosa step: the previous step's round is over (DDP waited for its
        futures); take its result's largest sum into the scale of this one."""
        stream, self._last_stream = self._last_stream, None
        if stream is not None:
            stream.finish()
        if self._last_max_abs and self._scale_exp is not None:
            self._scale_exp = hook_codec.next_scale_exp(max(self._last_max_abs), self.world_size,
                                                        self.headroom, self._scale_exp)
        self._last_max_abs = []
        self._prev = (dict(self._layouts), dict(self._encoders))
        step = _Step(self._scale_exp)
        self._step = step
        return step

    def _deliver(self, enc: RoundEncoder, sent: EncodedRound, buf: torch.Tensor, idx, sums,
                 scale_exp: int, max_abs: list) -> None:
        """Write one bucket's result (``idx`` local to the bucket) into its buffer as the average;
        gtopk: fold back what this host sent that did not come back."""
        world = self.world_size
        idx = np.asarray(idx, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= buf.numel()):
            raise ValueError(f"dosa result has indices outside [0, {buf.numel()})")
        vals = np.ldexp(np.asarray(sums, np.float64), -scale_exp)
        if vals.size:
            max_abs.append(float(np.abs(vals).max()))
        flat = buf.view(-1)
        flat.zero_()
        at = torch.from_numpy(idx).to(buf.device)
        flat[at] = torch.from_numpy((vals / world).astype(np.float32)).to(buf.device, buf.dtype)
        if self._gtopk and len(sent):
            enc.fold_back(*enc.unapplied(sent, idx), scale_exp)

    def _stream_bucket(self, step: _Step, bucket, buf: torch.Tensor, enc: RoundEncoder,
                       last: bool) -> torch.futures.Future:
        """Queue the bucket on the step's encoding thread (which encodes it and sends every
        partition the buckets so far cover) and return a future that the stream's thread completes
        when the bucket's partitions are back. At the last bucket, wait for the encoding thread."""
        client = self._client
        if step.stream is None:
            step.stream = client.open_stream(step.scale_exp)
            self._last_stream = step.stream
            step.encoder = _EncodeWorker()
        pmap = client.pmap
        psize, P = pmap.partition_size, pmap.num_partitions
        off, n = step.offset, buf.numel()
        step.offset += n
        if step.offset > client.job.numel or (last and step.offset != client.job.numel):
            raise ValueError(f"the model's gradient has {step.offset if last else 'more than ' + str(client.job.numel)} "
                             f"entries but the dosa job {client.job.job_id} has {client.job.numel} "
                             f"(connect(numel) takes the model's gradient size)")
        lo, hi = off // psize, (P if last else -(-(off + n) // psize))
        fut: torch.futures.Future = torch.futures.Future()
        s, max_abs, stream = step.scale_exp, step.max_abs, step.stream

        def encode_and_send():  # on the encoding thread, buckets in order
            sent = enc.encode(buf, s)
            step.entries += len(sent)
            idx = np.concatenate([step.carry_idx, (sent.indices.astype(np.int64) + off).astype(np.uint32)])
            q = np.concatenate([step.carry_q, sent.values])
            upto = P if last else (off + n) // psize
            cut = int(np.searchsorted(idx, upto * psize)) if not last else len(idx)
            stream.send(idx[:cut], q[:cut], upto)
            step.carry_idx, step.carry_q = idx[cut:], q[cut:]

            def done(cf):  # on the stream's thread
                try:
                    ridx, sums = cf.result()
                    a, b = np.searchsorted(ridx, [off, off + n])
                    self._deliver(enc, sent, buf, ridx[a:b].astype(np.int64) - off, sums[a:b], s, max_abs)
                except BaseException as e:  # noqa: BLE001 - DDP re-raises it from the future
                    fut.set_exception(e)
                    return
                fut.set_result(buf)

            stream.wait_for(lo, hi).add_done_callback(done)

        step.encoder.submit(encode_and_send, fut)
        if last:
            step.encoder.finish()  # every entry of the step is out (and counted in step.entries)
            step.encoder = None
        return fut

    def _run_parked(self, step: _Step) -> None:
        """One blocking round over every parked bucket (the same encoders), completing their futures."""
        parked, step.parked = step.parked, []
        try:
            encs, sents, offs = [], [], []
            off = 0
            for i, buf, _ in parked:
                enc = self._encoders[i]
                sent = enc.encode(buf, step.scale_exp)
                encs.append(enc)
                sents.append(sent)
                offs.append(off)
                off += buf.numel()
            idx = np.concatenate([(e.indices.astype(np.int64) + o).astype(np.uint32)
                                  for e, o in zip(sents, offs)]) if parked else np.zeros(0, np.uint32)
            q = np.concatenate([e.values for e in sents]) if parked else np.zeros(0, np.int32)
            step.entries += len(idx)
            t1 = time.perf_counter()
            ridx, sums = self._client.allreduce_sparse(idx, q, step.scale_exp)
            self.stats.allreduce_seconds += time.perf_counter() - t1
            ridx = np.asarray(ridx, np.int64)
            if ridx.size and (ridx.min() < 0 or ridx.max() >= off):
                raise ValueError(f"dosa result has indices outside [0, {off})")
            for (i, buf, _), enc, sent, o in zip(parked, encs, sents, offs):
                a, b = np.searchsorted(ridx, [o, o + buf.numel()])
                self._deliver(enc, sent, buf, ridx[a:b] - o, np.asarray(sums)[a:b], step.scale_exp,
                              step.max_abs)
        except BaseException as e:
            for _, _, fut in parked:
                fut.set_exception(e)
            raise
        for _, buf, fut in parked:
            fut.set_result(buf)

    def _end_step(self, step: _Step, numel: int) -> None:
        st = self.stats
        st.dosa_rounds += 1
        st.overlapped_rounds += step.stream is not None
        st.numel = numel
        st.buckets_per_step = step.buckets
        st.entries_sent += step.entries
        st.densities.append(step.entries / numel if numel else 0.0)
        st.hook_seconds += step.hook_seconds
        st.hook_seconds_per_step.append(step.hook_seconds)
        self._last_max_abs = step.max_abs
        self._step = None
        self.refresh_counters()

    def refresh_counters(self) -> None:
        """Copy the client's traffic counters into ``stats`` (the last step's are complete once
        DDP has waited for its futures; ``close`` refreshes them too)."""
        if self._client is not None:
            for key, val in hook_codec.client_counters(self._client).items():
                setattr(self.stats, key, val - self._client_base.get(key, 0))
            causes = getattr(self._client, "retransmit_causes", None)
            if causes is not None:
                self.stats.retransmit_causes = dict(causes)


def bucket_encoder(encoders: dict, layouts: dict, prev: tuple[dict, dict], bucket, buf: torch.Tensor,
                   density: float, world: int, rank: int, method: str, momentum: float,
                   masking: bool) -> tuple[RoundEncoder, bool]:
    """The encoder of DDP bucket ``bucket`` (its buffer ``buf``), from ``encoders``/``layouts``
    (bucket index -> encoder / parameter layout), made anew when the bucket's parameters changed.
    DDP rebuilds its buckets after the first step (gradient-ready order): a new encoder gets its
    parameters' residual (and velocity) carried over from the encoders of ``prev`` (the step
    before's ``(layouts, encoders)``), so nothing sent to the residual is lost. Seeded by rank and
    bucket. Returns (encoder, whether a residual was carried over). The dosa hook and the DGC-style
    baseline of ``dosa bench train`` both take their encoders from here, so the two make the same
    updates."""
    idx, n = bucket.index(), buf.numel()
    layout = tuple((p.data_ptr(), tuple(p.shape)) for p in bucket.parameters())
    enc = encoders.get(idx)
    if (enc is not None and layouts.get(idx) == layout and enc.numel == n
            and same_device(enc.device, buf.device)):
        return enc, False
    old_layouts, old_encs = prev
    enc = RoundEncoder(n, density, world, method, seed=1000 * rank + idx, device=buf.device,
                       momentum=momentum, momentum_masking=masking)
    enc.load_state(carry_over(old_layouts, {b: e.r for b, e in old_encs.items()}, layout, n),
                   carry_over(old_layouts, {b: e.u for b, e in old_encs.items() if e.u is not None},
                              layout, n) if momentum else None)
    layouts[idx] = layout
    encoders[idx] = enc
    return enc, bool(old_layouts)


def carry_over(old_layouts: dict, old_arrays: dict, layout: tuple, numel: int) -> torch.Tensor:
    """A per-bucket float32 tensor (residual or velocity) for a bucket of ``layout`` (a tuple of
    (data_ptr, shape) per parameter, in bucket order, which is the buffer order), filled from the
    arrays (tensors or numpy) of the old buckets that held the same parameters; zeros where a
    parameter is new. On the old arrays' device (CPU when there are none)."""
    where, device = {}, "cpu"
    for b, lay in old_layouts.items():
        arr = old_arrays.get(b)
        if arr is None:
            continue
        arr = torch.as_tensor(arr)
        device = arr.device
        off = 0
        for key in lay:
            n = math.prod(key[1])
            where[key] = (arr, off, n)
            off += n
    out = torch.zeros(numel, dtype=torch.float32, device=device)
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

    With ``state.overlap`` each bucket is encoded and its complete partitions sent right away, and
    its future completes when those partitions are back; otherwise buckets are parked until the
    last one (``bucket.is_last()``) and one blocking round reduces all of them.

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
    buf = bucket.buffer()
    if not buf.is_floating_point():
        raise TypeError(f"dosa_hook handles floating-point gradients, got {buf.dtype}")
    last = bucket.is_last()
    if state.stats.steps < state.dense_warmup_steps or state._use_fallback:
        if last:
            state.stats.steps += 1
            state.stats.dense_steps += 1
        return _dense_allreduce(state, bucket)
    step = state._step or state._begin_step()
    step.buckets += 1
    enc = state._encoder_for(bucket, buf)
    if state._client_ready and state.overlap and hasattr(state._client, "open_stream"):
        fut = state._stream_bucket(step, bucket, buf, enc, last)
        if last:
            state.stats.steps += 1
            step.hook_seconds += time.perf_counter() - t0
            state._end_step(step, step.offset)
        else:
            step.hook_seconds += time.perf_counter() - t0
        return fut
    fut = torch.futures.Future()
    step.parked.append((bucket.index(), buf, fut))
    if not last:
        step.hook_seconds += time.perf_counter() - t0
        return fut
    state.stats.steps += 1
    numel = sum(b.numel() for _, b, _ in step.parked)
    # Every bucket of the step is parked now, so the job's size is known and no collective of
    # this step is in flight: the moment to create the client and agree on it across ranks.
    state._ensure_client(numel)
    if state._use_fallback:
        state.stats.dense_steps += 1
        parked, step.parked = step.parked, []
        state._step = None
        for _, pbuf, pfut in parked:
            pbuf.div_(state.world_size)
            work = dist.all_reduce(pbuf, group=state.group, async_op=True)
            work.get_future().then(lambda f, pfut=pfut, pbuf=pbuf: pfut.set_result(pbuf))
        return fut
    if step.scale_exp is None:
        step.scale_exp = state._scale_exp
    state._run_parked(step)
    step.hook_seconds += time.perf_counter() - t0
    state._end_step(step, numel)
    return fut
