"""A join refused with 503 (the job's aggregation slots fit once other jobs end) is retried within
its ``wait``, with one log line; a 507 (can never fit) fails at once (dosa.join.join_raw)."""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dosa.errors import DosaError
from dosa.join import join_raw

pytestmark = pytest.mark.timeout(60)


def serve(answers):
    """An HTTP server on 127.0.0.1 answering POSTs with ``answers`` in turn: (status, body)."""
    calls = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            calls.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers[min(len(calls), len(answers)) - 1]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, calls


BUSY = (503, {"error": "job 5 needs 2 aggregation slots on this DPU: ...; it fits once one of them ends"})


def test_a_busy_dataplane_is_waited_for(caplog):
    srv, calls = serve([BUSY, BUSY, (200, {"job_id": 5})])
    try:
        with caplog.at_level(logging.WARNING, "dosa.host"):
            got = join_raw(("127.0.0.1", srv.server_port), 5, "127.0.0.1", wait=20)
    finally:
        srv.shutdown()
    assert got == {"job_id": 5} and len(calls) == 3
    assert calls[1]["wait"] < calls[0]["wait"]  # the server's wait shrinks with the time spent
    warned = [r for r in caplog.records if "fits once one of them ends" in r.getMessage()]
    assert len(warned) == 1 and "waiting up to" in warned[0].getMessage()


def test_the_wait_runs_out_with_the_dpus_sentence():
    srv, calls = serve([BUSY])
    try:
        with pytest.raises(DosaError, match="fits once one of them ends"):
            join_raw(("127.0.0.1", srv.server_port), 5, "127.0.0.1", wait=2.5)
    finally:
        srv.shutdown()
    assert 2 <= len(calls) <= 4


def test_a_job_that_can_never_fit_fails_at_once():
    srv, calls = serve([(507, {"error": "job 5 ... so it can never fit: ask for at most 4 slots"})])
    try:
        with pytest.raises(DosaError, match="can never fit"):
            join_raw(("127.0.0.1", srv.server_port), 5, "127.0.0.1", wait=30)
    finally:
        srv.shutdown()
    assert len(calls) == 1
