"""One training step's gradient buckets through dosa: the DDP hook's step runner.

DDP hands the buckets over in bucket-index order on every rank, and in that order they tile the
job's one index space. Two ways to run a step, the same encoders and the same bytes:

* **streaming** (:meth:`StepRunner.stream_bucket`): one ``host_lib.stream.SparseStream`` round per
  step. Each bucket is encoded on the step's encoding thread (:class:`_EncodeWorker`) and every
  partition the buckets so far cover completely is sent at once; the bucket's future completes (in
  the stream's thread) when the partitions it overlaps are back. The hook returns to backward at
  once and waits only at the last bucket for the encoding thread.
* **parked** (:meth:`StepRunner.park`, :meth:`StepRunner.run_parked`): every bucket waits for the
  last one, then one blocking round reduces them all (the first dosa step, when the client is made;
  ``overlap=False``; the baseline of the overlap measurement).

A result is written into each bucket's buffer as ``sum / world_size`` (DDP averages); in ``gtopk``
jobs what this host sent but the DPU did not return goes back into the residual. The largest sum of
a step sets the next step's scale exponent, the same on every rank (``hook_codec.next_scale_exp``).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from dosa.job import ResultMode
from host_lib import hook_codec
from host_lib.encoder import EncodedRound, RoundEncoder
from host_lib.hook_config import DosaHookStats, HookConfig
from host_lib.hook_encoders import BucketEncoders

log = logging.getLogger(__name__)


class _Step:
    """What the runner keeps while one step's buckets come in."""

    def __init__(self, scale_exp: int | None, world: int, divisor: int | None = None):
        self.scale_exp = scale_exp
        self.world = world  #: the dosa job's workers (the fixed point's clip bound)
        #: the ranks whose gradients the sums hold (DDP averages over them): ``world``, or on
        #: nodes of several ranks (host_lib.hook_node) nodes x ranks per node
        self.divisor = world if divisor is None else divisor
        self.gtopk = False  #: the job's result mode is gtopk (known once the client is)
        self.offset = 0  #: where the next bucket starts in the job's index space
        self.buckets = 0
        self.entries = 0
        self.hook_seconds = 0.0
        self.max_abs: list[float] = []  #: largest |sum| of each bucket's result (next round's scale)
        self.parked: list[tuple[int, torch.Tensor, torch.futures.Future]] = []
        #: each parked bucket's encoder, when the caller keeps them (the node-aware hook's slices)
        self.parked_encoders: dict[int, RoundEncoder] = {}
        self.stream = None
        self.encoder: _EncodeWorker | None = None  #: streaming: the thread encoding the buckets
        self.carry_idx = np.zeros(0, np.uint32)  #: entries of a partition the next bucket completes
        self.carry_q = np.zeros(0, np.int32)


class _EncodeWorker:
    """The step's encoding thread (streaming): each bucket is encoded and its complete partitions
    handed to the stream in the order DDP hands the buckets over, while backward goes on computing
    the next ones (the selection pass and the quantization release the GIL).

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


class StepRunner:
    """The steps of one model's hook: the scale exponent carried between them, the step in
    progress, and the last step's stream (finished when the next step begins)."""

    def __init__(self, config: HookConfig, encoders: BucketEncoders, stats: DosaHookStats):
        self.config, self.encoders, self.stats = config, encoders, stats
        self.scale_exp: int | None = config.scale_exp
        self.step: _Step | None = None
        self._last_stream = None
        self._last_max_abs: list[float] = []

    def begin(self, world: int, divisor: int | None = None) -> _Step:
        """First bucket of a dosa step: the previous step's round is over (DDP waited for its
        futures); take its result's largest sum into the scale of this one. ``world``: the dosa
        job's workers; ``divisor``: the ranks the sums average over (default ``world``)."""
        stream, self._last_stream = self._last_stream, None
        if stream is not None:
            stream.finish()
        if self._last_max_abs and self.scale_exp is not None:
            self.scale_exp = hook_codec.next_scale_exp(max(self._last_max_abs), world,
                                                       self.config.headroom, self.scale_exp)
        self._last_max_abs = []
        self.encoders.new_step()
        self.step = _Step(self.scale_exp, world, divisor)
        return self.step

    def _deliver(self, step: _Step, enc: RoundEncoder, sent: EncodedRound, buf: torch.Tensor, idx,
                 sums, scale_exp: int) -> None:
        """Write one bucket's result (``idx`` local to the bucket) into its buffer as the average;
        gtopk: fold back what this host sent that did not come back."""
        idx = np.asarray(idx, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= buf.numel()):
            raise ValueError(f"dosa result has indices outside [0, {buf.numel()})")
        vals = np.ldexp(np.asarray(sums, np.float64), -scale_exp)
        if vals.size:
            step.max_abs.append(float(np.abs(vals).max()))
        flat = buf.view(-1)
        flat.zero_()
        at = torch.from_numpy(idx).to(buf.device)
        flat[at] = torch.from_numpy((vals / step.divisor).astype(np.float32)).to(buf.device, buf.dtype)
        if step.gtopk and len(sent):
            enc.fold_back(*enc.unapplied(sent, idx), scale_exp)

    def stream_bucket(self, step: _Step, client, buf: torch.Tensor, enc: RoundEncoder,
                      last: bool) -> torch.futures.Future:
        """Queue the bucket on the step's encoding thread (which encodes it and sends every
        partition the buckets so far cover) and return a future that the stream's thread completes
        when the bucket's partitions are back. At the last bucket, wait for the encoding thread."""
        if step.stream is None:
            step.gtopk = _gtopk(client)
            step.stream = client.open_stream(step.scale_exp)
            self._last_stream = step.stream
            step.encoder = _EncodeWorker()
        pmap, job = client.pmap, client.job
        psize, P = pmap.partition_size, pmap.num_partitions
        off, n = step.offset, buf.numel()
        step.offset += n
        if step.offset > job.numel or (last and step.offset != job.numel):
            raise ValueError(f"the model's gradient has {step.offset if last else 'more than ' + str(job.numel)} "
                             f"entries but the dosa job {job.job_id} has {job.numel} "
                             f"(connect(numel) takes the model's gradient size)")
        lo, hi = off // psize, (P if last else -(-(off + n) // psize))
        fut: torch.futures.Future = torch.futures.Future()
        s, stream = step.scale_exp, step.stream

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
                    self._deliver(step, enc, sent, buf, ridx[a:b].astype(np.int64) - off, sums[a:b], s)
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

    def park(self, step: _Step, index: int, buf: torch.Tensor,
             enc: RoundEncoder | None = None) -> torch.futures.Future:
        """Keep the bucket until the step's last one; its future completes when the round does.
        ``enc``: the bucket's encoder, when it is not ``encoders[index]``."""
        fut: torch.futures.Future = torch.futures.Future()
        step.parked.append((index, buf, fut))
        if enc is not None:
            step.parked_encoders[index] = enc
        return fut

    def parked_numel(self, step: _Step) -> int:
        """The size of the step's parked buckets: the gradient's, at the last bucket."""
        return sum(b.numel() for _, b, _ in step.parked)

    def run_parked(self, step: _Step, client) -> None:
        """One blocking round over every parked bucket (the same encoders), completing their futures."""
        if step.scale_exp is None:
            step.scale_exp = self.scale_exp
        step.gtopk = _gtopk(client)
        parked, step.parked = step.parked, []
        try:
            encs, sents, offs = [], [], []
            off = 0
            for i, buf, _ in parked:
                enc = step.parked_encoders[i] if i in step.parked_encoders else self.encoders[i]
                encs.append(enc)
                sents.append(enc.encode(buf, step.scale_exp))
                offs.append(off)
                off += buf.numel()
            step.offset = off
            idx = np.concatenate([(e.indices.astype(np.int64) + o).astype(np.uint32)
                                  for e, o in zip(sents, offs)]) if parked else np.zeros(0, np.uint32)
            q = np.concatenate([e.values for e in sents]) if parked else np.zeros(0, np.int32)
            step.entries += len(idx)
            t1 = time.perf_counter()
            ridx, sums = client.allreduce_sparse(idx, q, step.scale_exp)
            self.stats.allreduce_seconds += time.perf_counter() - t1
            ridx = np.asarray(ridx, np.int64)
            if ridx.size and (ridx.min() < 0 or ridx.max() >= off):
                raise ValueError(f"dosa result has indices outside [0, {off})")
            for (i, buf, _), enc, sent, o in zip(parked, encs, sents, offs):
                a, b = np.searchsorted(ridx, [o, o + buf.numel()])
                self._deliver(step, enc, sent, buf, ridx[a:b] - o, np.asarray(sums)[a:b], step.scale_exp)
        except BaseException as e:
            for _, _, fut in parked:
                fut.set_exception(e)
            raise
        for _, buf, fut in parked:
            fut.set_result(buf)

    def run_parked_dense(self, step: _Step, group) -> None:
        """The step's parked buckets through the process group's allreduce (dosa unavailable)."""
        parked, step.parked = step.parked, []
        self.step = None
        for _, buf, fut in parked:
            buf.div_(step.divisor)
            work = dist.all_reduce(buf, group=group, async_op=True)
            work.get_future().then(lambda f, fut=fut, buf=buf: fut.set_result(buf))

    def end(self, step: _Step, numel: int) -> None:
        """The step's statistics; its largest sums set the next step's scale."""
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
        self.step = None

    def close(self) -> None:
        """Wait for the encoding thread and finish the last round (a failure is logged: closing
        must not mask the run's real outcome)."""
        if self.step is not None and self.step.encoder is not None:
            self.step.encoder.finish()
        stream, self._last_stream = self._last_stream, None
        if stream is not None:
            try:
                stream.finish(timeout=30)
            except Exception as e:  # noqa: BLE001
                log.warning("dosa hook: the last round failed: %s", e)


def _gtopk(client) -> bool:
    """Whether the client's job returns only the largest sums (what was sent but not returned is
    folded back into the residual)."""
    return getattr(getattr(client, "job", None), "mode", ResultMode.SUM) == ResultMode.GTOPK


def dense_allreduce(buf: torch.Tensor, group, world: int) -> torch.futures.Future:
    """The process group's allreduce, averaged: what DDP does without a hook."""
    buf.div_(world)
    return (dist.all_reduce(buf, group=group, async_op=True)
            .get_future().then(lambda fut: fut.value()[0]))
