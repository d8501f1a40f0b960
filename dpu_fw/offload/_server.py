"""What the two offload servers share: CPU pinning, a threaded TCP listener, and the READY line a
parent process waits for (it carries the real port when the server was asked for port 0)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import socketserver
import sys
import threading

from dosa.errors import DosaError
from dosa.offload.protocol import ConnectionClosed, FrameError, OffloadError, parse_address, send_message

log = logging.getLogger("dosa.offload")


def parse_cpus(text: str | None) -> set[int] | None:
    """``"1"``, ``"1,3"``, ``"2-3"`` -> a CPU set; None/empty -> None (no pinning)."""
    if not text:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise DosaError(f"--cpus {text!r} must look like '1', '1,3' or '2-3'") from None
    return cpus


def pin(cpus: set[int] | None) -> None:
    """Run this process (and the threads it starts later) only on ``cpus``: the DPU's cores."""
    if not cpus:
        return
    avail = os.sched_getaffinity(0)
    if not cpus <= set(range(os.cpu_count() or 1)):
        raise DosaError(f"CPUs {sorted(cpus)} do not all exist (this machine has {sorted(avail)})")
    os.sched_setaffinity(0, cpus)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.server.serve_connection(sock)  # type: ignore[attr-defined]
        except (ConnectionClosed, ConnectionError, BrokenPipeError):
            pass  # the host went away: nothing to answer
        except (FrameError, OffloadError, DosaError) as e:
            log.warning("closing connection from %s: %s", self.client_address, e)
            try:
                send_message(sock, "error", {"message": str(e)})
            except OSError:
                pass


class Server(socketserver.ThreadingTCPServer):
    """One thread per host connection; subclasses implement ``serve_connection(sock)``."""

    daemon_threads = True
    allow_reuse_address = True
    name = "offload"

    def __init__(self, address):
        host, port = parse_address(address, default_host="0.0.0.0")
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            raise DosaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def serve_connection(self, sock: socket.socket) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def run(server: Server, cpus: set[int] | None, exit_with_parent: bool = False) -> int:
    """Pin, announce ``READY <name> <host:port>`` on stdout, serve until SIGTERM/SIGINT (or, with
    ``exit_with_parent``, until the process that started it is gone: no orphaned services)."""
    pin(cpus)
    stop = threading.Event()

    def shutdown():
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    def watch_parent(parent: int):
        while not stop.wait(1.0):
            if os.getppid() != parent:
                log.warning("parent process %d is gone: stopping", parent)
                shutdown()

    signal.signal(signal.SIGTERM, lambda signum, frame: shutdown())
    signal.signal(signal.SIGINT, lambda signum, frame: shutdown())
    if exit_with_parent:
        threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    print(f"READY {server.name} {server.address}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        stop.set()
        server.server_close()
    return 0


def add_common_arguments(p) -> None:
    p.add_argument("--cpus", default=None, help="pin to these CPUs (the DPU's cores), e.g. '1' or '2-3'")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one exits")


def configure_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main_guard(serve, args) -> int:
    """Run ``serve(args)`` as a standalone process: a DosaError is one line on stderr, exit 2."""
    try:
        return serve(args)
    except DosaError as e:
        print(f"dosa offload: {e}", file=sys.stderr, flush=True)
        return 2
