"""Start the offload services as subprocesses: the DPU side, pinned to its cores and optionally
inside its network namespace (the services are dpu_fw/offload, started by module name, so
nothing here imports the DPU side). Used by tests, the benchmark and the demo."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dosa.offload.protocol import OffloadError

_REPO_ROOT = Path(__file__).resolve().parent.parent.parent


class OffloadServices:
    """Start the augmentation and validation services as subprocesses (the DPU side), pinned to
    ``cpus`` and optionally inside network namespace ``netns``; stop them on exit.

    Port 0 (the default) lets each service pick a free port; the real addresses are in
    ``augment_address`` / ``validate_address`` once started."""

    def __init__(self, host: str = "127.0.0.1", augment_port: int = 0, validate_port: int = 0,
                 cpus: str | None = None, datasets=(), netns: str | None = None,
                 prefetch: int = 8, threads: int = 1, startup_timeout: float = 60.0,
                 augment: bool = True, validate: bool = True, workers: int | None = None):
        self.host, self.cpus, self.netns = host, cpus, netns
        self.datasets = list(datasets)
        self.startup_timeout = startup_timeout
        self._plan = []
        if augment:
            self._plan.append(("augment", "dpu_fw.offload.service", augment_port,
                               ["--prefetch", str(prefetch)]
                               + (["--workers", str(workers)] if workers else [])))
        if validate:
            self._plan.append(("validate", "dpu_fw.offload.validation", validate_port,
                               ["--threads", str(threads)]))
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, tempfile._TemporaryFileWrapper] = {}
        self.addresses: dict[str, str] = {}

    @property
    def augment_address(self) -> str:
        return self.addresses["augment"]

    @property
    def validate_address(self) -> str:
        return self.addresses["validate"]

    def start(self) -> "OffloadServices":
        try:
            for name, module, port, extra in self._plan:
                cmd = [sys.executable, "-m", module, "--listen", f"{self.host}:{port}",
                       "--exit-with-parent", *extra]
                if self.cpus:
                    cmd += ["--cpus", str(self.cpus)]
                for spec in self.datasets:
                    cmd += ["--dataset", spec]
                if self.netns:
                    cmd = ["ip", "netns", "exec", self.netns, *cmd]
                self._logs[name] = tempfile.TemporaryFile(prefix=f"dosa-offload-{name}-")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])))
                # A session of their own: like a DPU's processes they are not the host's (no
                # terminal signals), and with the kernel's autogroup scheduling they get their own
                # CPU share instead of splitting the host process's share between two CPUs.
                self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                                    stderr=self._logs[name], env=env, bufsize=0,
                                                    start_new_session=True)
            for name in self.procs:  # both start (import, load data) in parallel
                self.addresses[name] = self._wait_ready(name)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, name: str) -> str:
        proc, buf = self.procs[name], b""
        deadline = time.monotonic() + self.startup_timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OffloadError(f"the {name} service did not start within {self.startup_timeout} s")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    raise OffloadError(f"the {name} service exited at start: {self.log(name) or '?'}")
                buf += chunk
        words = buf.split(b"\n", 1)[0].decode(errors="replace").split()
        if len(words) != 3 or words[:2] != ["READY", name]:
            raise OffloadError(f"the {name} service said {buf!r} instead of READY")
        host, _, port = words[2].rpartition(":")
        return f"{self.host if host in ('0.0.0.0', '') else host}:{port}"

    def log(self, name: str) -> str:
        """What the service wrote on stderr so far (last 2000 characters)."""
        f = self._logs.get(name)
        if f is None:
            return ""
        f.seek(0)
        return f.read().decode(errors="replace").strip()[-2000:]

    def kill(self, name: str) -> None:
        """SIGKILL one service (tests use it to simulate a dying DPU)."""
        self.procs[name].kill()
        self.procs[name].wait(10)

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            if proc.stdout:
                proc.stdout.close()
        for f in self._logs.values():
            f.close()
        self.procs.clear()
        self._logs.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
