"""The HTTP server under the join API: bounded threads, a deadline on every request, optional TLS.

Why not the stdlib's ThreadingHTTPServer as it is: it starts a thread for every connection without
limit and waits for a request as long as the client likes, so a few hundred idle or half-sent
connections hold as many threads, and a slow sender holds one for ever. Here:

* at most ``max_connections`` connections at once and ``max_per_client`` from one address (each
  connection is one thread); one more is answered 429 and closed at once, and counted
  (``on_drop``; /metrics serves it);
* each request (its line, headers and body) must arrive within ``request_s`` of the connection's
  start or of the previous answer: a watchdog thread shuts down the reading side of the
  connections that miss it (idle kept-alive connections and slow senders alike; the handler can
  still answer 408, :meth:`BoundedHTTPServer.expired`), and counts them. Each read also has a
  timeout, a little longer, as a backstop. While the service works on a request (a join waits up
  to its ``wait`` for the other workers) no deadline runs (:meth:`BoundedHTTPServer.arm`);
* with ``tls`` (an ``ssl.SSLContext``), the handshake runs on the connection's own thread, under
  the same deadline, so a client that never finishes it holds no one else up.
"""
from __future__ import annotations

import collections
import json
import socket
import threading
import time
from http.server import HTTPServer

MAX_CONNECTIONS = 512
#: from one address: every rank on one machine (up to wire.MAX_WORKERS) keeps one heartbeat
#: connection and may wait in a join at the same time
MAX_PER_CLIENT = 160
REQUEST_S = 10.0
_WATCH_S = 0.25


class _Slot:
    __slots__ = ("sock", "deadline", "expired")

    def __init__(self, sock, deadline):
        self.sock = sock
        self.deadline = deadline
        self.expired = False


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer with one thread per connection, bounded, and deadlines (the module doc)."""

    request_queue_size = 1024  # a burst of connections waits to be accepted (or refused) at once

    def __init__(self, address, handler, *, tls=None, max_connections: int = MAX_CONNECTIONS,
                 max_per_client: int = MAX_PER_CLIENT, request_s: float = REQUEST_S, on_drop=None):
        self.tls = tls
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.request_s = float(request_s)
        self.on_drop = on_drop or (lambda reason: None)
        self._lock = threading.Lock()
        self._slots: set[_Slot] = set()
        self._per_client: collections.Counter = collections.Counter()
        self._local = threading.local()
        self._closing = threading.Event()
        super().__init__(address, handler)
        self._watchdog = threading.Thread(target=self._watch, name="dosa-ctl-deadlines", daemon=True)
        self._watchdog.start()

    # ----------------------------------------------------------------------------- admission
    def process_request(self, request, client_address):
        ip = client_address[0]
        with self._lock:
            if len(self._slots) >= self.max_connections:
                why = f"the control plane has {len(self._slots)} connections open, its most"
            elif self._per_client[ip] >= self.max_per_client:
                why = f"{ip} has {self._per_client[ip]} connections open to the control plane, its most"
            else:
                why = None
                slot = _Slot(request, time.monotonic() + self.request_s)
                self._slots.add(slot)
                self._per_client[ip] += 1
        if why is not None:
            self.on_drop("too_many_connections")
            self._refuse(request, why)
            return
        try:
            t = threading.Thread(target=self.process_request_thread, args=(request, client_address, slot),
                                 daemon=True)
            t.start()
        except RuntimeError:  # no thread to be had: refuse rather than fail the accept loop
            self._release(slot, ip)
            self.on_drop("no_thread")
            self._refuse(request, "the control plane cannot start another thread")

    def _refuse(self, sock, why: str) -> None:
        """A 429 in one non-blocking write (plain HTTP only), then close."""
        if self.tls is None:
            body = json.dumps({"error": f"{why}; try again later"}).encode()
            head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            try:
                sock.setblocking(False)
                sock.send(head + body)
            except OSError:
                pass
        self.shutdown_request(sock)

    def _release(self, slot: _Slot, ip: str) -> None:
        with self._lock:
            self._slots.discard(slot)
            self._per_client[ip] -= 1
            if self._per_client[ip] <= 0:
                del self._per_client[ip]

    def process_request_thread(self, request, client_address, slot: _Slot):
        self._local.slot = slot
        try:
            if self.tls is not None:
                request.settimeout(self.request_s)
                request = self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                slot.sock = request
                request.do_handshake()
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a failed handshake or a reset: this connection only
            pass
        finally:
            self.shutdown_request(request)
            self._release(slot, client_address[0])

    def handle_error(self, request, client_address):
        """Quiet: a client that resets or times out is not the DPU log's business."""

    # ----------------------------------------------------------------------------- deadlines
    def arm(self, seconds: float | None) -> None:
        """The calling connection's next deadline: ``seconds`` from now, or None while the service
        works on its request."""
        slot = getattr(self._local, "slot", None)
        if slot is not None:
            slot.deadline = None if seconds is None else time.monotonic() + seconds
            slot.expired = False

    def expired(self) -> bool:
        """The calling connection missed its deadline (its reading side is shut)."""
        slot = getattr(self._local, "slot", None)
        return slot is not None and slot.expired

    def _watch(self) -> None:
        while not self._closing.wait(_WATCH_S):
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._slots if s.deadline is not None and s.deadline < now]
            for s in late:
                s.deadline, s.expired = None, True
                self.on_drop("request_timeout")
                try:  # the base class's: an SSLSocket's own shutdown would drop its TLS state
                    socket.socket.shutdown(s.sock, socket.SHUT_RD)
                except OSError:
                    pass

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._slots)

    def server_close(self):
        self._closing.set()
        super().server_close()


def server_tls(cert: str, key: str):
    """The server side of TLS from a certificate chain and its key (PEM files), TLS 1.2 at least."""
    import ssl

    from dosa.errors import DosaError

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise DosaError(f"cannot load the TLS certificate {cert} with key {key}: {e}") from None
    return ctx
