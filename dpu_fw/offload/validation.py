"""The validation service: the host pushes a model snapshot after an epoch and keeps training; the
DPU rebuilds the model from its spec, evaluates it on the validation split and sends the metrics.

Requests on a connection (framing in protocol.py); several may be in flight, answered in order:
  ``evaluate`` {job, epoch, model: spec, dataset, batch_size} + the state dict as named arrays
      -> ``metrics`` {job, epoch, loss, accuracy, samples, seconds}
      -> ``failed``  {job, message}   (a bad snapshot fails that job only; the connection stays)

The evaluation itself is dosa.offload.evaluate.evaluate_snapshot, the single evaluation path:
the service calls it, and so does a host that evaluates locally (fallback, or to check the
service), hence equal snapshots give equal metrics.
"""
from __future__ import annotations

import argparse
import queue
import socket
import threading
import time

from dosa.errors import DosaError
from dosa.offload.evaluate import DEFAULT_BATCH, evaluate_snapshot, validation_batches
from dosa.offload.models import check_spec
from dosa.offload.protocol import ConnectionClosed, FrameError, recv_message, send_message

from . import _server

DEFAULT_PORT = 17802
MAX_QUEUED = 16  # snapshots waiting per connection before the host feels backpressure

class ValidationServer(_server.Server):
    name = "validate"

    def __init__(self, address, threads: int = 1, preload: tuple[str, ...] = ()):
        import torch  # noqa: F401 - fail at start, not at the first snapshot
        torch.set_num_threads(threads)
        for spec in preload:
            validation_batches(spec)
        super().__init__(address)

    def serve_connection(self, sock: socket.socket) -> None:
        """Read snapshots as they come (so a host's ``submit`` never waits for an evaluation to
        finish) into a bounded queue; an evaluator thread answers them in order."""
        jobs: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        evaluator = threading.Thread(target=self._evaluate_loop, args=(sock, jobs), daemon=True,
                                     name="validate-evaluator")
        evaluator.start()
        try:
            while True:
                try:
                    msg = recv_message(sock)
                except ConnectionClosed:
                    return
                if msg.kind != "evaluate":
                    raise FrameError(f"unknown request {msg.kind!r}")
                if not isinstance(msg.meta.get("job"), int):
                    raise FrameError("an evaluate request needs an integer 'job'")
                jobs.put(msg)
        finally:
            jobs.put(None)
            evaluator.join()

    def _evaluate_loop(self, sock: socket.socket, jobs: queue.Queue) -> None:
        while (msg := jobs.get()) is not None:
            job, started = msg.meta["job"], time.perf_counter()
            try:
                batch = msg.meta.get("batch_size", DEFAULT_BATCH)
                dataset = msg.meta.get("dataset")
                if not isinstance(dataset, str) or not isinstance(batch, int) or batch < 1:
                    raise DosaError("an evaluate request needs a dataset spec and a positive batch_size")
                metrics = evaluate_snapshot(check_spec(msg.meta.get("model")), msg.arrays, dataset, batch)
                metrics.update(job=job, epoch=msg.meta.get("epoch"),
                               seconds=time.perf_counter() - started)
                reply = ("metrics", metrics)
            except DosaError as e:
                reply = ("failed", {"job": job, "message": str(e)})
            try:
                send_message(sock, *reply)
            except OSError:
                return  # the host went away; the reader sees it too


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}",
                   help=f"HOST:PORT to listen on (port 0 picks a free one; default 0.0.0.0:{DEFAULT_PORT})")
    _server.add_common_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads for evaluation (default 1)")
    p.add_argument("--dataset", action="append", default=[],
                   help="dataset spec whose validation split is prepared before READY (repeatable)")


def serve(args) -> int:
    _server.configure_logging()
    cpus = _server.parse_cpus(args.cpus)
    _server.pin(cpus)
    if not 1 <= args.threads <= 256:
        raise DosaError(f"--threads must be in [1, 256], not {args.threads}")
    server = ValidationServer(args.listen, threads=args.threads, preload=tuple(args.dataset))
    return _server.run(server, cpus, exit_with_parent=args.exit_with_parent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpu_fw.offload.validation",
                                description="dosa validation service (runs on the DPU's cores)")
    add_arguments(p)
    return _server.main_guard(serve, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
