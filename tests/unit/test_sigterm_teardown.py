"""A SIGTERM to pytest (a CI timeout, a killed job) still runs the teardown of the test in progress
(tests/conftest.py turns it into KeyboardInterrupt), so namespaces, pins and processes go too."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

INNER = '''
import time, pytest
@pytest.fixture
def resource():
    yield
    open({mark!r}, "w").write("torn down")
def test_in_progress(resource):
    open({started!r}, "w").write("started")
    time.sleep(60)
'''


@pytest.mark.timeout(60)
def test_sigterm_runs_the_teardown_of_the_test_in_progress(tmp_path):
    mark, started = tmp_path / "teardown", tmp_path / "started"
    (tmp_path / "test_inner.py").write_text(INNER.format(mark=str(mark), started=str(started)))
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 30
        while not started.exists():
            assert p.poll() is None and time.monotonic() < end, p.communicate()[0] if p.poll() is not None else "not started"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert mark.read_text() == "torn down", out
    assert "SIGTERM" in out
