"""The augmentation service: runs on the DPU's cores, loads the dataset itself, augments batches
ahead of time and streams them to its host.

Requests on a connection (see protocol.py for framing):
  ``info``  {dataset, split}                  -> ``info`` {samples, image_shape, classes, dtype}
  ``epoch`` {dataset, split, batch_size, seed, epoch, start, augment, drop_last}
            -> ``batch`` {epoch, index} + arrays x, y, ids   (one per batch, from ``start`` on)
            -> ``end`` {epoch, batches}
Anything wrong -> ``error`` {message}, then the connection is closed.

Prefetch and backpressure: a producer thread fills a bounded queue of ``prefetch`` batches (computed
by ``--workers`` threads at once) while the connection thread sends; once an epoch is sent it
prepares the first batches of the next one. When the host reads slowly, TCP's window fills,
``sendall`` blocks, the queue fills and the producer waits: at most ``prefetch`` batches (plus the
socket buffers) are ever ahead of the host. The host names the first batch it wants (``start``), so
a reconnect resumes exactly where it stopped.
"""
from __future__ import annotations

import argparse
import queue
import socket
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from dosa.errors import DosaError
from dosa.offload.augment import AugmentConfig, make_pipeline
from dosa.offload.datasets import load_dataset
from dosa.offload.protocol import ConnectionClosed, FrameError, recv_message, send_message

from . import _server

DEFAULT_PORT = 17801
DEFAULT_PREFETCH = 8
SPECULATIVE_BATCHES = 2  # batches of the next epoch prepared before the host asks for it
_DONE = object()


def _field(meta: dict, key: str, kind, default=None):
    v = meta.get(key, default)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        raise FrameError(f"request field {key!r} must be {kind.__name__}, not {v!r}")
    return v


class Producer:
    """Computes batches ``start..`` of one epoch into a bounded queue, in order, on its own thread;
    with a worker pool, up to ``workers`` batches are computed at once (numpy's random generators
    and array operations release the GIL, so threads scale over the DPU's cores)."""

    def __init__(self, pipe, key: tuple, epoch: int, start: int, prefetch: int,
                 speculative: bool = False, pool: ThreadPoolExecutor | None = None,
                 workers: int = 1):
        self.pipe, self.key, self.epoch, self.start = pipe, key, epoch, start
        self._pool, self._workers = pool, workers
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        # A speculative producer (the next epoch, not asked for yet) stops after a few batches
        # until confirm(): enough to hide the epoch boundary, little waste if never asked for.
        self._confirmed = threading.Event()
        if not speculative:
            self._confirmed.set()
        self._thread = threading.Thread(target=self._run, name="augment-producer", daemon=True)
        self._thread.start()

    def matches(self, key: tuple, epoch: int, start: int) -> bool:
        return (self.key, self.epoch, self.start) == (key, epoch, start)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def confirm(self) -> None:
        self._confirmed.set()

    def _run(self) -> None:
        inflight: deque = deque()
        try:
            for b in range(self.start, len(self.pipe)):
                if b - self.start >= SPECULATIVE_BATCHES:
                    while not self._confirmed.wait(0.2):
                        if self._stop.is_set():
                            return
                if self._pool is None:
                    if not self._put((b, self.pipe.batch(self.epoch, b))):
                        return
                    continue
                inflight.append((b, self._pool.submit(self.pipe.batch, self.epoch, b)))
                if len(inflight) >= self._workers:
                    done, fut = inflight.popleft()
                    if not self._put((done, fut.result())):
                        return
            while inflight:
                done, fut = inflight.popleft()
                if not self._put((done, fut.result())):
                    return
            self._put(_DONE)
        except Exception as e:  # reported to the host as an error message
            self._put(e)
        finally:
            for _, fut in inflight:
                fut.cancel()

    def get(self):
        return self._ready.get()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class AugmentServer(_server.Server):
    name = "augment"

    def __init__(self, address, prefetch: int = DEFAULT_PREFETCH, preload: tuple[str, ...] = (),
                 workers: int = 1):
        if not 1 <= prefetch <= 1024:
            raise DosaError(f"prefetch must be in [1, 1024], not {prefetch}")
        if not 1 <= workers <= 256:
            raise DosaError(f"workers must be in [1, 256], not {workers}")
        self.prefetch, self.workers = prefetch, workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="augment-worker") if workers > 1 else None
        for spec in preload:  # load before announcing READY, so the first epoch starts at once
            load_dataset(spec)
        super().__init__(address)

    def serve_connection(self, sock: socket.socket) -> None:
        """Answer requests until the host hangs up. After streaming an epoch, the next epoch of the
        same pipeline is prepared speculatively: a host that asks for it next (the usual case)
        finds its first batches ready instead of waiting at every epoch boundary."""
        producer: Producer | None = None
        try:
            while True:
                try:
                    msg = recv_message(sock)
                except ConnectionClosed:
                    return
                if msg.kind == "info":
                    ds = load_dataset(_field(msg.meta, "dataset", str))
                    split = ds.split(_field(msg.meta, "split", str, "train"))
                    send_message(sock, "info", {"samples": len(split), "image_shape": split.image_shape,
                                                "classes": ds.classes, "dtype": "float32"})
                elif msg.kind == "epoch":
                    key, epoch, start = self._parse_epoch(msg.meta)
                    if producer is None or not producer.matches(key, epoch, start):
                        if producer is not None:
                            producer.close()
                        producer = Producer(self._pipeline(key), key, epoch, start, self.prefetch,
                                            pool=self.pool, workers=self.workers)
                    producer.confirm()
                    self._stream(sock, producer)
                    producer = Producer(producer.pipe, key, epoch + 1, 0, self.prefetch,
                                        speculative=True, pool=self.pool, workers=self.workers)
                else:
                    raise FrameError(f"unknown request {msg.kind!r}")
        finally:
            if producer is not None:
                producer.close()

    @staticmethod
    def _parse_epoch(meta: dict) -> tuple[tuple, int, int]:
        augment = meta.get("augment")
        if augment is not None and not isinstance(augment, dict):
            raise FrameError("request field 'augment' must be an object or null")
        cfg = AugmentConfig.from_dict(augment) if augment is not None else None
        key = (_field(meta, "dataset", str), _field(meta, "split", str, "train"),
               _field(meta, "batch_size", int), _field(meta, "seed", int), cfg,
               _field(meta, "drop_last", bool, False))
        return key, _field(meta, "epoch", int), _field(meta, "start", int, 0)

    @staticmethod
    def _pipeline(key: tuple):
        dataset, split, batch_size, seed, cfg, drop_last = key
        return make_pipeline(dataset, split, batch_size, seed, cfg, drop_last=drop_last)

    @staticmethod
    def _stream(sock: socket.socket, producer: Producer) -> None:
        pipe, epoch = producer.pipe, producer.epoch
        if epoch < 0 or not 0 <= producer.start <= len(pipe):
            raise DosaError(f"epoch {epoch} / start batch {producer.start} out of range "
                            f"(the epoch has {len(pipe)} batches)")
        while True:
            item = producer.get()
            if item is _DONE:
                send_message(sock, "end", {"epoch": epoch, "batches": len(pipe)})
                return
            if isinstance(item, Exception):
                raise DosaError(f"augmentation failed: {item}")
            b, (x, y, ids) = item
            send_message(sock, "batch", {"epoch": epoch, "index": b}, {"x": x, "y": y, "ids": ids})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}",
                   help=f"HOST:PORT to listen on (port 0 picks a free one; default 0.0.0.0:{DEFAULT_PORT})")
    _server.add_common_arguments(p)
    p.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH,
                   help=f"batches prepared ahead of the host (default {DEFAULT_PREFETCH})")
    p.add_argument("--workers", type=int, default=None,
                   help="batches augmented in parallel (default: one per CPU of --cpus, else 1)")
    p.add_argument("--dataset", action="append", default=[],
                   help="dataset spec to load before announcing READY (repeatable)")


def serve(args) -> int:
    _server.configure_logging()
    cpus = _server.parse_cpus(args.cpus)
    _server.pin(cpus)  # before loading data, so even that runs on the DPU's cores
    workers = args.workers if args.workers is not None else len(cpus or ()) or 1
    server = AugmentServer(args.listen, prefetch=args.prefetch, preload=tuple(args.dataset),
                           workers=workers)
    return _server.run(server, cpus, exit_with_parent=args.exit_with_parent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpu_fw.offload.service",
                                description="dosa augmentation service (runs on the DPU's cores)")
    add_arguments(p)
    return _server.main_guard(serve, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
