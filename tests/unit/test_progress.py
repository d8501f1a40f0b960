"""dosa.progress: a tqdm bar on a terminal (a real pty here), plain lines when the output is a pipe
or a file, and ``DOSA_PROGRESS`` to force either (or silence)."""
from __future__ import annotations

import fcntl
import io
import os
import struct
import subprocess
import sys
import termios

import pytest

from dosa.progress import Progress, progress, track

pytestmark = pytest.mark.timeout(60)

SCRIPT = r"""
import sys
from dosa.progress import progress
with progress(total=5, desc="rounds", unit="round") as p:
    for i in range(5):
        p.update(1, status=f"loss {i}")
    p.note("done")
print("result on stdout")
"""


def _run_on_pty(env=None):
    """The script with stderr (and stdout) on a pseudo-terminal: what a user at a terminal sees."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100x24 terminal
    try:
        p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=slave, stderr=slave,
                             env={**os.environ, **(env or {})})
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            out += chunk
        assert p.wait(timeout=30) == 0
        return out.decode(errors="replace")
    finally:
        os.close(master)


def test_on_a_terminal_it_is_a_tqdm_bar():
    out = _run_on_pty({"DOSA_PROGRESS": ""})
    assert "rounds: 100%|" in out and "5/5" in out and "\r" in out, out
    assert "done" in out and "result on stdout" in out


def test_on_a_pipe_it_is_plain_lines():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "DOSA_PROGRESS": ""})
    lines = p.stderr.splitlines()  # the first update, the last (5 quick ones), the note
    assert [ln.split(",")[0] for ln in lines[:2]] == ["rounds: 1/5 round (20%)", "rounds: 5/5 round (100%)"]
    assert lines[0].endswith("loss 0") and lines[1].endswith("loss 4") and lines[2:] == ["done"]
    assert "\r" not in p.stderr and "|" not in p.stderr
    assert p.stdout == "result on stdout\n"


def test_many_updates_give_few_lines_without_a_terminal():
    buf = io.StringIO()
    with Progress(10_000, "entries", unit="entry", stream=buf, every=3600) as p:
        for _ in range(10_000):
            p.update(1)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2  # the first update and the last
    assert lines[-1].startswith("entries: 10000/10000 entry (100%)")


def test_environment_forces_the_mode():
    assert "|" not in _run_on_pty({"DOSA_PROGRESS": "lines"}).replace("\r\n", "\n").split("done")[0] \
        .replace("result on stdout", "")
    buf = io.StringIO()
    os.environ["DOSA_PROGRESS"] = "off"
    try:
        assert list(track(range(3), "x", stream=buf)) == [0, 1, 2]
    finally:
        del os.environ["DOSA_PROGRESS"]
    assert buf.getvalue() == ""
    with pytest.raises(ValueError, match="progress mode"):
        progress(3, "x", mode="fancy")
