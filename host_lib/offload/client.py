"""Host side of the dataflow offload: a loader fed by the DPU's augmentation service, a validator
that has the DPU evaluate model snapshots (OffloadServices, which starts those services, is launcher.py's).

Example::

    from host_lib.offload import OffloadServices, OffloadedLoader, OffloadedValidator
    with OffloadServices(cpus="1", datasets=["digits"]) as svc:
        loader = OffloadedLoader(svc.augment_address, dataset="digits", batch_size=64, seed=1,
                                 fallback=True)
        validator = OffloadedValidator(svc.validate_address, dataset="digits")
        for epoch in range(5):
            loader.set_epoch(epoch)
            for x, y in loader:
                ...                                   # the usual training step
            handle = validator.submit(model, epoch)   # the DPU evaluates, the host trains on
        print(handle.result(timeout=60))

Exactness on failure: a batch counts as delivered only once it has arrived whole; after a failure the
loader continues (locally with ``fallback=True``, else it raises) from the next undelivered batch
index. Since a batch is a pure function of (seed, epoch, index) (see dosa/offload/augment.py), no
batch of the epoch is lost or repeated, and the fallback batches are bit-identical to the service's.
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import socket
import threading
import warnings

import numpy as np

from dosa.errors import DosaError
from dosa.offload.augment import AugmentConfig, make_pipeline
from dosa.offload.evaluate import DEFAULT_BATCH, evaluate_snapshot
from dosa.offload.models import check_spec, state_arrays
from dosa.offload.protocol import ConnectionClosed, FrameError, OffloadError, connect, recv_message, send_message


class ServiceLost(OffloadError):
    """An offload service died or became unreachable, and fallback was not enabled."""


class ServiceRefused(OffloadError):
    """The service answered with an error: a configuration problem, not a failure to fall back from."""


class OffloadFallbackWarning(RuntimeWarning):
    """Emitted once per loader/validator when it switches to local processing."""


def _service_error(msg) -> ServiceRefused:
    return ServiceRefused(f"the offload service refused the request: {msg.meta.get('message', '?')}")


class OffloadedLoader:
    """An iterable of training batches that fits wherever a torch DataLoader does.

    Args:
        address: "host:port" of the augmentation service.
        dataset: dataset spec (see dosa/offload/datasets.py), loaded by the service itself.
        batch_size, seed: as for the local pipeline; the same values give bit-identical batches.
        augment: an AugmentConfig, a dict of its fields, or None for no augmentation/no shuffling.
        fallback: on service failure, warn once and continue locally from the next batch; when
            False, raise ServiceLost.
        as_numpy: yield numpy arrays instead of torch tensors.
        return_ids: yield (x, y, ids) where ids are the samples' indices in the split.
        timeout: seconds to wait for the service (connect, or the next batch) before declaring it lost.

    Epochs: ``set_epoch(e)`` selects the epoch of the next pass (like DistributedSampler); without it,
    each pass uses the epoch after the previous one (0, 1, 2, ...).
    """

    def __init__(self, address, dataset: str = "digits", batch_size: int = 64, seed: int = 0,
                 augment: AugmentConfig | dict | None = AugmentConfig(), split: str = "train",
                 fallback: bool = False, drop_last: bool = False, as_numpy: bool = False,
                 return_ids: bool = False, timeout: float = 30.0):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DosaError(f"batch_size must be a positive integer, not {batch_size!r}")
        if not isinstance(seed, int) or seed < 0:
            raise DosaError(f"seed must be a non-negative integer, not {seed!r}")
        if timeout <= 0:
            raise DosaError("timeout must be positive")
        self.address = address
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.augment = AugmentConfig.from_dict(augment) if isinstance(augment, dict) else augment
        self.split = split
        self.fallback = fallback
        self.drop_last = drop_last
        self.as_numpy = as_numpy
        self.return_ids = return_ids
        self.timeout = timeout
        self._epoch = 0
        self._len: int | None = None
        self._local = None  # the local pipeline, built on first fallback
        self._sock: socket.socket | None = None  # kept between epochs
        self.fell_back = False
        #: batches received from the service / computed locally (over the loader's life)
        self.remote_batches = 0
        self.local_batches = 0

    # -- DataLoader-like surface -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or epoch < 0:
            raise DosaError(f"epoch must be a non-negative integer, not {epoch!r}")
        self._epoch = epoch

    def __len__(self) -> int:
        if self._len is None:
            if self.fell_back:
                self._len = len(self._local_pipeline())
            else:
                try:
                    self._len = self._remote_len()
                except (OffloadError, OSError) as e:
                    if isinstance(e, ServiceRefused) or not self.fallback:
                        raise self._lost(e, None, None) from None
                    self._fall_back(e, None, None)
                    self._len = len(self._local_pipeline())
        return self._len

    def __iter__(self):
        epoch = self._epoch
        self._epoch = epoch + 1
        return self._iterate(epoch)

    # -- internals -------------------------------------------------------------------------------
    def _remote_len(self) -> int:
        with connect(self.address, self.timeout) as sock:
            send_message(sock, "info", {"dataset": self.dataset, "split": self.split})
            msg = recv_message(sock)
        if msg.kind == "error":
            raise _service_error(msg)
        if msg.kind != "info" or not isinstance(msg.meta.get("samples"), int):
            raise FrameError(f"unexpected answer {msg.kind!r} to an info request")
        n = msg.meta["samples"]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _local_pipeline(self):
        if self._local is None:
            self._local = make_pipeline(self.dataset, self.split, self.batch_size, self.seed,
                                        self.augment, self.drop_last)
        return self._local

    def _lost(self, err, epoch, index) -> OffloadError:
        if isinstance(err, ServiceRefused):
            return err
        where = "" if epoch is None else f" at batch {index} of epoch {epoch}"
        return ServiceLost(f"augmentation service at {self.address} failed{where} "
                           f"({err.__class__.__name__}: {err}); pass fallback=True to continue locally")

    def _fall_back(self, err, epoch, index) -> None:
        self.fell_back = True
        where = "" if epoch is None else f" at batch {index} of epoch {epoch}"
        warnings.warn(f"augmentation service at {self.address} failed{where} ({err}); "
                      "continuing with local augmentation", OffloadFallbackWarning, stacklevel=3)

    def _out(self, x, y, ids):
        if not self.as_numpy:
            import torch
            x, y = torch.from_numpy(x), torch.from_numpy(y)
        return (x, y, ids) if self.return_ids else (x, y)

    def _iterate(self, epoch: int):
        n = len(self)
        next_index = 0
        if not self.fell_back:
            try:
                for x, y, ids in self._remote_epoch(epoch, n):
                    next_index += 1
                    self.remote_batches += 1
                    yield self._out(x, y, ids)
            except (OffloadError, OSError) as e:
                if isinstance(e, ServiceRefused) or not self.fallback:
                    raise self._lost(e, epoch, next_index) from None
                self._fall_back(e, epoch, next_index)
        if next_index < n:
            pipe = self._local_pipeline()
            for b in range(next_index, n):
                x, y, ids = pipe.batch(epoch, b)
                self.local_batches += 1
                yield self._out(x, y, ids)

    def _remote_epoch(self, epoch: int, n: int):
        """Yield (x, y, ids) of batches 0..n-1 from the service; raises on any deviation.

        The connection is kept between epochs (the service prepares the next epoch meanwhile). It
        is closed whenever an epoch does not end cleanly, since the stream's state is then unknown.
        A kept connection that turns out dead before its first answer is replaced once."""
        request = {"dataset": self.dataset, "split": self.split, "batch_size": self.batch_size,
                   "seed": self.seed, "epoch": epoch, "start": 0, "drop_last": self.drop_last,
                   "augment": None if self.augment is None else self.augment.to_dict()}
        sock, self._sock = self._sock, None
        reused = sock is not None
        try:
            try:
                if sock is None:
                    sock = connect(self.address, self.timeout)
                send_message(sock, "epoch", request)
                msg = recv_message(sock)
            except (ConnectionClosed, OSError):
                if not reused:
                    raise
                sock.close()
                sock = connect(self.address, self.timeout)
                send_message(sock, "epoch", request)
                msg = recv_message(sock)
            for expected in range(n + 1):
                if expected:
                    msg = recv_message(sock)
                if msg.kind == "error":
                    raise _service_error(msg)
                if msg.kind == "end" and expected == n:
                    self._sock, sock = sock, None  # clean end: keep it for the next epoch
                    return
                if expected == n or msg.kind != "batch" or msg.meta.get("index") != expected \
                        or msg.meta.get("epoch") != epoch or set(msg.arrays) != {"x", "y", "ids"}:
                    want = "the end" if expected == n else f"batch {expected}"
                    raise FrameError(f"expected {want} of epoch {epoch}, got {msg.kind} {msg.meta}")
                x, y, ids = msg.arrays["x"], msg.arrays["y"], msg.arrays["ids"]
                if x.dtype != np.float32 or x.ndim != 4 or y.dtype != np.int64 \
                        or ids.dtype != np.int64 or not len(x) == len(y) == len(ids) > 0:
                    raise FrameError(f"batch {expected} of epoch {epoch} has malformed arrays")
                yield x, y, ids
        finally:
            if sock is not None:
                sock.close()

    def close(self) -> None:
        """Close the kept connection (the service then stops preparing the next epoch)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ValidationHandle:
    """The pending metrics of one submitted snapshot."""

    def __init__(self, job: int, epoch):
        self.job, self.epoch = job, epoch
        self._future: cf.Future = cf.Future()
        self.local = False  # True when it was evaluated on the host (fallback)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict:
        """The metrics {loss, accuracy, samples, ...}; OffloadError if none within ``timeout`` s."""
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise OffloadError(f"no validation metrics for epoch {self.epoch} "
                               f"within {timeout} s") from None


class OffloadedValidator:
    """Submit model snapshots to the DPU's validation service; collect the metrics later.

    Args:
        address: "host:port" of the validation service.
        dataset: dataset spec whose validation split is used (the service loads it itself).
        fallback: if the service is down, evaluate on the host instead (in a background thread,
            with one warning) rather than failing the handle with ServiceLost.
    """

    def __init__(self, address, dataset: str = "digits", batch_size: int = DEFAULT_BATCH,
                 fallback: bool = False, timeout: float = 30.0):
        self.address, self.dataset, self.batch_size = address, dataset, batch_size
        self.fallback, self.timeout = fallback, timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pending: dict[int, tuple[ValidationHandle, dict, dict]] = {}
        self._jobs = itertools.count(1)
        self._local_pool: cf.ThreadPoolExecutor | None = None
        self.fell_back = False

    def submit(self, model_or_state, epoch=None, spec: dict | None = None) -> ValidationHandle:
        """Snapshot ``model_or_state`` now (training may go on changing it) and have it evaluated.

        ``spec`` defaults to ``model.spec`` (models built by dosa.offload.models carry it)."""
        spec = check_spec(spec if spec is not None else getattr(model_or_state, "spec", None))
        arrays = state_arrays(model_or_state)
        handle = ValidationHandle(next(self._jobs), epoch)
        with self._lock:
            if not self.fell_back:
                try:
                    self._send(handle, spec, arrays)
                    return handle
                except (OffloadError, OSError) as e:
                    self._on_lost(e)
            self._evaluate_locally(handle, spec, arrays)
        return handle

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._local_pool is not None:
            self._local_pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals (call with self._lock held) ----------------------------------------------------
    def _send(self, handle, spec, arrays) -> None:
        if self._sock is None:
            self._sock = connect(self.address, self.timeout)
            self._sock.settimeout(None)  # the receiver waits as long as evaluations take
            threading.Thread(target=self._receive, args=(self._sock,), daemon=True,
                             name="offload-validator").start()
        self._pending[handle.job] = (handle, spec, arrays)
        try:
            send_message(self._sock, "evaluate", {"job": handle.job, "epoch": handle.epoch,
                                                  "model": spec, "dataset": self.dataset,
                                                  "batch_size": self.batch_size}, arrays)
        except BaseException:
            self._pending.pop(handle.job, None)
            raise

    def _on_lost(self, err) -> None:
        """The service is gone: fail (or re-run locally) every pending job."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        pending, self._pending = list(self._pending.values()), {}
        if not self.fallback:
            lost = ServiceLost(f"validation service at {self.address} failed ({err})")
            for handle, _, _ in pending:
                handle._future.set_exception(lost)
            raise lost
        if not self.fell_back:
            self.fell_back = True
            warnings.warn(f"validation service at {self.address} failed ({err}); "
                          "evaluating snapshots on the host", OffloadFallbackWarning, stacklevel=4)
        for handle, spec, arrays in pending:
            self._evaluate_locally(handle, spec, arrays)

    def _evaluate_locally(self, handle, spec, arrays) -> None:
        if self._local_pool is None:
            self._local_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="offload-local-eval")
        handle.local = True

        def run():
            try:
                handle._future.set_result(evaluate_snapshot(spec, arrays, self.dataset,
                                                            self.batch_size))
            except BaseException as e:
                handle._future.set_exception(e)
        self._local_pool.submit(run)

    def _receive(self, sock: socket.socket) -> None:
        while True:
            try:
                msg = recv_message(sock)
            except (OffloadError, OSError) as e:
                with self._lock:
                    if self._sock is not sock:
                        return  # closed on purpose
                    try:
                        self._on_lost(e)
                    except ServiceLost:
                        pass  # already delivered to the handles
                return
            with self._lock:
                entry = self._pending.pop(msg.meta.get("job"), None)
            if entry is None:
                continue
            handle = entry[0]
            if msg.kind == "metrics":
                handle._future.set_result({k: msg.meta[k] for k in
                                           ("loss", "accuracy", "samples", "seconds") if k in msg.meta})
            else:
                handle._future.set_exception(ServiceRefused(
                    f"validation of epoch {handle.epoch} failed on the DPU: {msg.meta.get('message')}"))


class LocalLoader:
    """The same batches as OffloadedLoader, computed on the host (the baseline, and what the
    offloaded loader falls back to). Same surface: ``len``, ``set_epoch``, one epoch per pass."""

    def __init__(self, dataset: str = "digits", batch_size: int = 64, seed: int = 0,
                 augment: AugmentConfig | dict | None = AugmentConfig(), split: str = "train",
                 drop_last: bool = False, as_numpy: bool = False, return_ids: bool = False):
        self.pipeline = make_pipeline(dataset, split, batch_size, seed, augment, drop_last)
        self.as_numpy, self.return_ids = as_numpy, return_ids
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self.pipeline)

    def __iter__(self):
        epoch, self._epoch = self._epoch, self._epoch + 1
        for x, y, ids in self.pipeline.iter_epoch(epoch):
            if not self.as_numpy:
                import torch
                x, y = torch.from_numpy(x), torch.from_numpy(y)
            yield (x, y, ids) if self.return_ids else (x, y)
