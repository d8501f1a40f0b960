"""The HTTP side of the API: a table from (method, path) to a ControlService call, the request
handler that reads JSON bodies and writes JSON answers, and :class:`ControlServer` around both.

A path segment written ``NUM`` in the table matches any segment and is passed on as an integer
(400 when it is not one). Errors: an ApiError answers its status, any other DosaError 400, a bug
500 (the server keeps serving)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dosa.errors import DosaError

from .service import DEFAULT_CONTROL_PORT, ControlService
from .validation import ApiError, bad

NUM = object()

#: (method, path under /v1, call(service, handler, *numbers))
ROUTES = [
    ("POST", ("join",), lambda s, h: s.join(h.body())),
    ("POST", ("leave",), lambda s, h: s.leave(h.body())),
    ("POST", ("heartbeat",), lambda s, h: s.heartbeat(h.body())),
    ("POST", ("jobs",), lambda s, h: s.create_job(h.body())),
    ("GET", ("jobs",), lambda s, h: s.list_jobs()),
    ("GET", ("jobs", NUM), lambda s, h, job_id: s.get_job(job_id)),
    ("DELETE", ("jobs", NUM), lambda s, h, job_id: s.remove_job(job_id)),
    ("GET", ("stats",), lambda s, h: s.stats()),
    ("GET", ("health",), lambda s, h: {"ok": True}),
    ("POST", ("local", "jobs"), lambda s, h: s.local_install_job(h.body())),
    ("POST", ("local", "flows"), lambda s, h: s.local_install_flow(h.body())),
    ("DELETE", ("local", "jobs", NUM), lambda s, h, job_id: s.local_remove_job(job_id)),
    ("DELETE", ("local", "flows", NUM, NUM), lambda s, h, job_id, wid: s.local_remove_flow(job_id, wid)),
]


def _num(x: str) -> int:
    try:
        return int(x)
    except ValueError:
        raise bad(f"{x!r} is not a number") from None


def route(method: str, path: str):
    """The table row's call and its numeric arguments for ``method path`` (404 when none)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:1] != ["v1"]:
        raise ApiError(404, f"no endpoint {path}")
    p = parts[1:]
    for m, pattern, call in ROUTES:
        if m == method and len(pattern) == len(p) and \
                all(x is NUM or x == y for x, y in zip(pattern, p)):
            return call, [_num(y) for x, y in zip(pattern, p) if x is NUM]
    raise ApiError(404, f"no endpoint {method} {path}")


class _Handler(BaseHTTPRequestHandler):
    service: ControlService  # set on the subclass the server makes
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: the DPU log is for events, not every request
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > 1 << 20:
            raise bad("request body larger than 1 MiB")
        raw = self.rfile.read(n) if n else b"{}"
        try:
            body = json.loads(raw)
        except ValueError:
            raise bad("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad("request body must be a JSON object")
        return body

    def _metrics(self) -> None:
        """GET /metrics: the Prometheus text format (control/metrics.py), not JSON."""
        from control import metrics

        data, ctype = metrics.render(self.service, getattr(self.service, "worker_stats", None))
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str):
        try:
            if method == "GET" and self.path.split("?")[0] == "/metrics":
                return self._metrics()
            call, args = route(method, self.path)
            self._reply(200, call(self.service, self, *args))
        except ApiError as e:
            self._reply(e.status, {"error": str(e)})
        except DosaError as e:
            self._reply(400, {"error": str(e)})
        except Exception as e:  # a bug: say so, keep serving
            self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


class ControlServer:
    """HTTP server around a ControlService; ``start()`` serves on a daemon thread, ``serve_forever``
    in the caller's thread. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, service: ControlService, host: str = "127.0.0.1", port: int = DEFAULT_CONTROL_PORT):
        handler = type("Handler", (_Handler,), {"service": service})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise DosaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.httpd.daemon_threads = True
        self.service = service
        self.host, self.port = self.httpd.server_address[:2]
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
