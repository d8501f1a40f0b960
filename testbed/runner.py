"""Run one command per rank, concurrently, each in its own namespace (what ``dosa testbed run`` does).

Each rank's stdout/stderr are saved to ``<log_dir>/rank<i>.out`` / ``.err`` and echoed live with a
``[rank i]`` prefix. The first rank that exits non-zero (or the timeout) ends the run: every other
rank's process group gets SIGTERM, then SIGKILL after a grace period, so a failed rank never leaves
the others blocked in a collective forever.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dosa.errors import DosaError

from testbed.ns import netns_cmd

KILL_GRACE_S = 3.0


@dataclass
class RankSpec:
    rank: int
    namespace: str | None  #: None: this machine's own namespace
    env: dict
    cpus: list[int] | None = None
    argv: list[str] | None = None  #: this rank's own command (e.g. its torchrun agent); default: run_ranks'


@dataclass
class RankResult:
    rank: int
    namespace: str
    returncode: int | None  # None: never finished (should not happen after run() returns)
    killed: bool  # ended by us (another rank failed, or timeout)
    stdout_path: str
    stderr_path: str

    @property
    def status(self) -> str:
        rc = self.returncode
        if rc is None:
            return "not finished"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"killed by {name}" + (" (stopped by the testbed)" if self.killed else "")
        return f"exit status {rc}"


@dataclass
class RunResult:
    ranks: list[RankResult]
    timed_out: bool
    log_dir: str
    elapsed_s: float
    first_failed: list[int] = field(default_factory=list)  # the ranks that failed on their own

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    @property
    def failed_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if r.returncode != 0]

    def summary(self) -> str:
        if self.ok:
            return f"all {len(self.ranks)} ranks exited 0 in {self.elapsed_s:.2f}s"
        by_rank = {r.rank: r for r in self.ranks}
        if self.timed_out:
            head = f"timed out after {self.elapsed_s:.1f}s"
        else:
            own = self.first_failed or self.failed_ranks
            head = ", ".join(f"rank {i} failed ({by_rank[i].status})" for i in own)
        stopped = [r.rank for r in self.ranks if r.killed]
        tail = f"; stopped rank(s) {', '.join(map(str, stopped))}" if stopped else ""
        return f"{head}{tail}; logs in {self.log_dir}"

    def check(self) -> "RunResult":
        """Raise RankFailure (a DosaError) unless every rank exited 0."""
        if not self.ok:
            raise RankFailure(self)
        return self


class RankFailure(DosaError):
    def __init__(self, result: RunResult):
        super().__init__(result.summary())
        self.result = result


def _pump(stream, path: Path, prefix: str, echo, lock: threading.Lock, out) -> None:
    with open(path, "wb") as f:
        for line in iter(stream.readline, b""):
            f.write(line)
            f.flush()
            if echo:
                text = line.decode(errors="replace").rstrip("\n")
                with lock:
                    if callable(echo):
                        echo(prefix + text)
                    else:
                        print(prefix + text, file=out, flush=True)
    stream.close()


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun_argv(argv: list[str], *, nnodes: int, rdzv_endpoint: str, rdzv_id: int,
                  local_addr: str, is_host: bool, nproc_per_node: int = 1) -> list[str]:
    """One node's real ``torchrun`` agent (``nproc_per_node`` worker processes) joining a c10d rendezvous
    at ``rdzv_endpoint`` (the first host's fabric address): what each machine of a cluster runs.

    A namespace shares the machine's hostname, so the agent is told its own fabric address
    (``--local-addr``, which becomes MASTER_ADDR for rank 0's node) and whether it hosts the
    rendezvous store (``is_host``: the hostname cannot tell). ``argv`` is ``SCRIPT ARGS`` (a
    ``python`` in front is dropped: torchrun starts the script with its own interpreter), or
    ``-m MODULE ARGS`` (torchrun's own ``-m``)."""
    if not argv:
        raise DosaError("no script given to torchrun (put it after `--`)")
    if Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
    exe = Path(sys.executable).with_name("torchrun")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return head + [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
                   f"--rdzv-conf=is_host={int(is_host)}", f"--local-addr={local_addr}", *argv]


def run_ranks(specs: list[RankSpec], argv: list[str], log_dir: Path, timeout: float | None = None,
              echo=True, base_env: dict | None = None) -> RunResult:
    """Start ``argv`` once per spec and wait. ``echo``: True (print to our stdout/stderr), False, or
    a callable taking each prefixed line."""
    if not argv:
        raise DosaError("no command given to run (put it after `--`)")
    if timeout is not None and timeout <= 0:
        raise DosaError(f"--timeout must be positive, not {timeout}")
    log_dir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    results: list[RankResult] = []
    t0 = time.monotonic()
    try:
        for s in specs:
            # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints every
            # thread's Python stack in its log instead of dying silently
            env = {"PYTHONFAULTHANDLER": "1", **(os.environ if base_env is None else base_env), **s.env}
            try:
                p = subprocess.Popen(netns_cmd(s.namespace, s.argv or argv, s.cpus), env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
            except OSError as e:
                raise DosaError(f"cannot start rank {s.rank}: {e}") from None
            procs.append(p)
            res = RankResult(s.rank, s.namespace, None, False,
                             str(log_dir / f"rank{s.rank}.out"), str(log_dir / f"rank{s.rank}.err"))
            results.append(res)
            for stream, path, out in ((p.stdout, res.stdout_path, sys.stdout),
                                      (p.stderr, res.stderr_path, sys.stderr)):
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(stream, Path(path), f"[rank {s.rank}] ", echo, lock, out))
                t.start()
                pumps.append(t)

        deadline = None if timeout is None else t0 + timeout
        timed_out = False
        first_failed: list[int] = []
        while True:
            pending = False
            for p, res in zip(procs, results):
                if res.returncode is None:
                    rc = p.poll()
                    if rc is None:
                        pending = True
                    else:
                        res.returncode = rc
                        if rc != 0:
                            first_failed.append(res.rank)
            if not pending or first_failed:
                break
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        # stop whatever still runs (failure, timeout, or an exception / Ctrl-C in this process)
        still = [(p, r) for p, r in zip(procs, results) if p.poll() is None]
        for p, r in still:
            r.killed = True
            _killpg(p, signal.SIGTERM)
        end = time.monotonic() + KILL_GRACE_S
        while any(p.poll() is None for p, _ in still) and time.monotonic() < end:
            time.sleep(0.02)
        for p, _ in still:
            if p.poll() is None:
                _killpg(p, signal.SIGKILL)
        for p, r in zip(procs, results):
            r.returncode = p.wait()
            _killpg(p, signal.SIGKILL)  # stragglers the rank left in its process group
        for t in pumps:
            t.join(timeout=5)
    return RunResult(results, timed_out, str(log_dir), time.monotonic() - t0, first_failed)
