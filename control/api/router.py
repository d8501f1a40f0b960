"""The HTTP side of the API: a table from (method, path) to the roles that may call it (guard.py)
and a ControlService call; the request handler that reads bodies (bounded), checks credentials and
writes JSON answers, also for the stdlib's own errors; :class:`ControlServer` around both.

A path segment written ``NUM`` in the table matches any segment and is passed on as an integer
0..2^32-1 (400 when it is not one). A request is checked in this order: its route (404; 405 for a
known path with another method, or a method the server does not know), its body's size (411, 413;
a body that does not arrive in time: 408), its credential (401, 403), its JSON (400), then the
service answers. Errors: an ApiError answers its status, any other DosaError 400, a bug 500 (logged;
the server keeps serving). An error before the body was read closes the connection (the unread
body would be taken for the next request)."""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler

from dosa.auth import SCHEME, AuthError
from dosa.errors import DosaError

from .guard import MEMBERS, OPEN, OPERATOR, PEER, Guard
from .httpd import BoundedHTTPServer
from .service import DEFAULT_CONTROL_PORT, ControlService
from .validation import ApiError, bad

NUM = object()
MAX_BODY = 1 << 20

#: (method, path under /v1, roles that may call it, call(service, request, *numbers))
ROUTES = [
    ("POST", ("join",), MEMBERS, lambda s, r: s.join(r.json(), role=r.role)),
    ("POST", ("leave",), MEMBERS, lambda s, r: s.leave(r.json(), role=r.role)),
    ("POST", ("heartbeat",), MEMBERS, lambda s, r: s.heartbeat(r.json())),
    ("POST", ("jobs",), OPERATOR, lambda s, r: s.create_job(r.json())),
    ("GET", ("jobs",), OPEN, lambda s, r: s.list_jobs()),
    ("GET", ("jobs", NUM), OPEN, lambda s, r, job_id: s.get_job(job_id)),
    ("DELETE", ("jobs", NUM), OPERATOR, lambda s, r, job_id: s.remove_job(job_id)),
    ("GET", ("stats",), OPEN, lambda s, r: s.stats()),
    ("GET", ("health",), OPEN, lambda s, r: {"ok": True}),
    ("POST", ("local", "jobs"), PEER, lambda s, r: s.local_install_job(r.json())),
    ("POST", ("local", "flows"), PEER, lambda s, r: s.local_install_flow(r.json())),
    ("DELETE", ("local", "jobs", NUM), PEER, lambda s, r, job_id: s.local_remove_job(job_id)),
    ("DELETE", ("local", "flows", NUM, NUM), PEER,
     lambda s, r, job_id, wid: s.local_remove_flow(job_id, wid)),
]
log = logging.getLogger("dosa.ctl")


def _num(x: str) -> int:
    if not (x.isascii() and x.isdigit()) or len(x) > 10 or int(x) > 2**32 - 1:
        raise bad(f"{x[:32]!r} is not a number in 0..{2**32 - 1}")
    return int(x)


def route(method: str, path: str):
    """The table row (roles, call) and its numeric arguments for ``method path``: 404 when no row
    has the path, 405 (with ``allow``) when rows have it for other methods."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:1] != ["v1"]:
        raise ApiError(404, f"no endpoint {path[:200]}")
    p = parts[1:]
    allow = []
    for m, pattern, roles, call in ROUTES:
        if len(pattern) == len(p) and all(x is NUM or x == y for x, y in zip(pattern, p)):
            if m == method:
                return roles, call, [_num(y) for x, y in zip(pattern, p) if x is NUM]
            allow.append(m)
    if allow:
        e = ApiError(405, f"{method} is not allowed on {path[:200]} (allowed: {', '.join(allow)})")
        e.allow = ", ".join(allow)
        raise e
    raise ApiError(404, f"no endpoint {method} {path[:200]}")


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


class _Request:
    """What a route's call gets: the caller's role (None on an open route) and the body."""

    def __init__(self, data: bytes, role: str | None):
        self.data, self.role = data, role

    def json(self) -> dict:
        try:
            body = json.loads(self.data or b"{}", parse_constant=_no_constants)
        except (ValueError, RecursionError):
            raise bad("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad("request body must be a JSON object")
        return body


class _Handler(BaseHTTPRequestHandler):
    service: ControlService  # set on the subclass the server makes
    protocol_version = "HTTP/1.1"
    server_version = "dosa-control"
    sys_version = ""

    def log_message(self, fmt, *args):  # quiet: the DPU log is for events, not every request
        pass

    def setup(self):
        self.timeout = self.server.request_s + 5  # each read: a backstop, the watchdog bounds the whole
        super().setup()

    def handle(self):
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:
            self.server.arm(self.server.request_s)
            self.handle_one_request()

    def _reply(self, status: int, body: dict, close: bool = False, headers=()) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error(self, code, message=None, explain=None):
        """The stdlib's own errors (a malformed request line, headers too large, a method it has no
        handler for: 501 there, a JSON 405 here) as JSON; the connection is closed."""
        headers = ()
        if self.request_version == "HTTP/0.9":  # garbage on the request line: still a status line
            self.request_version = "HTTP/1.0"
        if code == 501:
            code, message = 405, f"method {str(self.command)[:20]!r} is not allowed"
            headers = (("Allow", "GET, POST, DELETE"),)
        try:
            phrase = self.responses[code][0]
        except KeyError:
            phrase = "error"
        try:
            self._reply(code, {"error": message or phrase}, close=True, headers=headers)
        except OSError:
            self.close_connection = True

    def _body(self) -> bytes:
        """The request's body, at most MAX_BODY bytes, as its Content-Length says."""
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(411, "a request body needs a Content-Length (no Transfer-Encoding)")
        lengths = set(self.headers.get_all("Content-Length") or [])
        if len(lengths) > 1:
            raise bad("the request has more than one Content-Length")
        raw = (lengths.pop() if lengths else "0").strip()
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
            raise bad(f"Content-Length {raw[:20]!r} is not a number of bytes")
        n = int(raw)
        if n > MAX_BODY:
            raise ApiError(413, f"request body of {n} bytes is larger than {MAX_BODY} bytes")
        data = self.rfile.read(n) if n else b""
        if len(data) < n:
            if self.server.expired():
                raise TimeoutError
            raise ConnectionError("the client closed the connection before the body ended")
        return data

    def _metrics(self) -> None:
        """GET /metrics: the Prometheus text format (control/metrics.py), not JSON."""
        from control import metrics

        data, ctype = metrics.render(self.service, getattr(self.service, "worker_stats", None),
                                     self.server.guard)
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str):
        if self.server.expired():  # the request's line and headers were cut at the deadline
            return self.send_error(408, self._late())
        read = False
        try:
            if method == "GET" and self.path.split("?")[0] == "/metrics":
                self._body()
                read = True
                return self._metrics()
            roles, call, args = route(method, self.path)
            data = self._body()
            read = True
            role = self.server.guard.check(roles, self.headers.get("Authorization"), method, self.path, data)
            self.server.arm(None)  # the service may take its time (a join waits for the others)
            self._reply(200, call(self.service, _Request(data, role), *args))
        except AuthError as e:
            body = {"error": str(e), "reason": e.reason}
            if e.reason == "stale":
                body["server_time"] = self.server.guard.now()  # the client signs again with it
            self._reply(e.status, body, close=not read,
                        headers=(("WWW-Authenticate", SCHEME),) if e.status == 401 else ())
        except ApiError as e:
            if e.status == 403:
                self.server.guard.refused(getattr(e, "reason", None) or "not_allowed")
            allow = getattr(e, "allow", None)
            self._reply(e.status, {"error": str(e)}, close=not read,
                        headers=(("Allow", allow),) if allow else ())
        except DosaError as e:
            self._reply(400, {"error": str(e)}, close=not read)
        except TimeoutError:
            self._reply(408, {"error": self._late()}, close=True)
        except (ConnectionError, OSError):
            self.close_connection = True  # the client is gone
        except Exception as e:  # a bug: say so, keep serving
            log.exception("%s %s failed", method, self.path[:200])
            self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"}, close=not read)

    def _late(self) -> str:
        return f"the request did not arrive within {self.server.request_s:g} s"

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


class ControlServer:
    """HTTP(S) server around a ControlService; ``start()`` serves on a daemon thread,
    ``serve_forever`` in the caller's thread. ``port=0`` picks a free port (see ``.port``).

    The service's ``secret`` (dosa.auth) makes every mutating route need a signed request of the
    route's roles, addressed to ``host:port`` or to the service's own ``address:port``; ``tls`` is
    an ``ssl.SSLContext`` (httpd.server_tls); ``limits``: httpd.BoundedHTTPServer's bounds."""

    def __init__(self, service: ControlService, host: str = "127.0.0.1", port: int = DEFAULT_CONTROL_PORT,
                 tls=None, **limits):
        handler = type("Handler", (_Handler,), {"service": service})
        self.guard = Guard()  # replaced below, once the port is known
        try:
            self.httpd = BoundedHTTPServer((host, port), handler, tls=tls,
                                           on_drop=lambda why: self.guard.dropped(why), **limits)
        except OSError as e:
            raise DosaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.service = service
        self.host, self.port = self.httpd.server_address[:2]
        self.guard = Guard(getattr(service, "secret", None),
                           {f"{self.host}:{self.port}", f"{service.address}:{self.port}"})
        self.httpd.guard = self.guard
        self.tls = tls is not None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "ControlServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dosa-ctl-api", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.service.close()
        if self._thread:
            self._thread.join(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
