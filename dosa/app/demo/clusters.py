"""Where the demo's ranks run: ``LoopbackCluster`` (userspace DPU workers on 127.0.0.1, ranks on this
machine) or ``TestbedCluster`` (a namespace testbed). Both launch the ranks through
testbed.runner.run_ranks, the one rank launcher (the loopback ranks in this machine's namespace),
and stop everything they started on exit."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from dosa.errors import DosaError
from dosa.job import DpuMode

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGTERM each process group, SIGKILL what is left after ``grace`` seconds, reap all."""
    for p in procs:
        if p.poll() is None:
            _killpg(p, signal.SIGTERM)
    end = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.02)
    for p in procs:
        _killpg(p, signal.SIGKILL)  # also stragglers left in the group
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass



def rank_log_dir(workdir: Path) -> Path:
    """``workdir/ranks``, or a fresh sibling for a second launch (--offload keeps both logs)."""
    log_dir = Path(workdir) / "ranks"
    if log_dir.exists():
        log_dir = Path(workdir) / f"ranks-{time.strftime('%H%M%S')}-{os.getpid()}-{time.monotonic_ns()}"
    return log_dir


def rank_base_env(env: dict | None) -> dict:
    """This process's environment plus ``env``, with the repository on PYTHONPATH."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [x for x in full.get("PYTHONPATH", "").split(os.pathsep) if x])
    return full


def _noise(line: str) -> bool:
    """torch's own startup warnings (kept in the rank logs, not shown as progress)."""
    return "socket.cpp" in line or "Setting OMP_NUM_THREADS" in line



def rank0_echo(echo: Callable[[str], None] | None):
    """The run_ranks echo that shows rank 0's lines (stdout and stderr, without the prefix and
    torch's startup noise) through ``echo``; the other ranks' lines stay in their logs."""
    def show(line: str):
        if echo is not None and line.startswith("[rank 0] ") and not _noise(line):
            echo(line[len("[rank 0] "):])
    return show


def raise_on_failure(result, what: str) -> None:
    """A DosaError naming the failed ranks and the last line of the first one's stderr."""
    if result.ok:
        return
    last = ""
    failed = result.first_failed or result.failed_ranks
    if failed:
        r = next(x for x in result.ranks if x.rank == failed[0])
        last = f" (last line of rank {r.rank}'s stderr: {_last_line(Path(r.stderr_path))})"
    raise DosaError(f"{what} failed: {result.summary()}{last}")


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no output"
    return lines[-1][-300:] if lines else "no output"



def split_cpus() -> tuple[str | None, str | None]:
    """(host CPUs, DPU CPUs): the first and second half of the CPUs we may use, like the testbed's
    --cpu-split; (None, None) with a single CPU (nothing to split)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))



class LoopbackCluster:
    """DPU workers (userspace mode) on 127.0.0.1 for one job, and a launcher for the ranks.

    Use as a context manager; ``run`` starts ``world`` processes with torchrun's variables and
    ``DOSA_JOB_CONFIG``, returns when all exited 0 and raises a DosaError naming the failed rank
    (after stopping the others) otherwise."""

    def __init__(self, hosts: int, dpus: int, numel: int, workdir: str | os.PathLike,
                 density: float = 0.01, job_id: int = 1, echo: Callable[[str], None] | None = print,
                 partition_size: int | None = None, mode: str = "sum"):
        from dosa.job import JobConfig

        self.hosts, self.dpus = hosts, dpus
        self.workdir = Path(workdir).resolve()  # the workers run in another directory
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        extra = {"partition_size": partition_size} if partition_size else {}
        self.job = JobConfig(job_id=job_id, numel=numel, density=density, mode=mode, **extra,
                             hosts=[("127.0.0.1", free_port()) for _ in range(hosts)],
                             dpus=[("127.0.0.1", free_port()) for _ in range(dpus)])
        self.job_path = self.workdir / "job.json"
        self.job_path.write_text(json.dumps(self.job.to_dict()))
        self.workers: list[subprocess.Popen] = []

    def __enter__(self):
        try:
            self.start_workers()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start_workers(self, ready_timeout: float = 60.0) -> None:
        pid_files = []
        for j in range(self.dpus):
            pid_file = self.workdir / f"dpu{j}.ready"
            pid_file.unlink(missing_ok=True)
            log = open(self.workdir / f"dpu{j}.log", "wb")
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "dosa", "dpu", "run", "--mode", DpuMode.USERSPACE.value,
                 "--job-config", str(self.job_path), "--dpu-index", str(j),
                 "--addr", self.job.dpus[j][0], "--port", str(self.job.dpus[j][1]),
                 "--pid-file", str(pid_file)],
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            log.close()
            pid_files.append(pid_file)
        end = time.monotonic() + ready_timeout
        for j, (p, f) in enumerate(zip(self.workers, pid_files)):
            while not f.exists():
                if p.poll() is not None:
                    raise DosaError(f"DPU worker {j} exited with status {p.returncode} before it was "
                                    f"ready; see {self.workdir / f'dpu{j}.log'}")
                if time.monotonic() > end:
                    raise DosaError(f"DPU worker {j} not ready after {ready_timeout:g} s")
                time.sleep(0.05)

    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(self.hosts), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.hosts), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port), "DOSA_JOB_CONFIG": str(self.job_path),
                "OMP_NUM_THREADS": "1"}

    def rank_specs(self, master_port: int) -> list:
        """One testbed.runner.RankSpec per rank: this machine's namespace, torchrun's variables."""
        from testbed.runner import RankSpec

        return [RankSpec(r, None, self.rank_env(r, master_port)) for r in range(self.hosts)]

    def run(self, argv: list[str], timeout: float, env: dict | None = None) -> None:
        """All ranks through testbed.runner.run_ranks (the one rank launcher), on this machine."""
        from testbed.runner import run_ranks

        specs = self.rank_specs(free_port(socket.SOCK_STREAM))  # one rendezvous for all ranks
        result = run_ranks(specs, argv, rank_log_dir(self.workdir), timeout=timeout,
                           echo=rank0_echo(self.echo), base_env=rank_base_env(env))
        raise_on_failure(result, "training")

    def dpu_stats(self) -> dict:
        return {}  # userspace workers keep their counters to themselves (printed with -v)

    def cpu_sets(self) -> tuple[str | None, str | None]:
        """(host CPUs, DPU CPUs) as taskset lists: the testbed's --cpu-split halves."""
        return split_cpus()

    def offload_services(self, datasets_per_dpu: list[list[str]]) -> list:
        """One (not yet started) OffloadServices per DPU, on 127.0.0.1, pinned to the DPU CPUs."""
        from host_lib.offload.launcher import OffloadServices

        return [OffloadServices(host="127.0.0.1", cpus=self.cpu_sets()[1], datasets=ds,
                                startup_timeout=120.0) for ds in datasets_per_dpu]

    def run_pinned(self, argv: list[str], timeout: float) -> None:
        """``run`` with every rank pinned to the host CPUs (the testbed's --cpu-split, here)."""
        host_cpus = self.cpu_sets()[0]
        self.run((["taskset", "-c", host_cpus] if host_cpus else []) + argv, timeout)

    def close(self) -> None:
        stop_processes(self.workers)
        self.workers = []



class TestbedCluster:
    """A namespace testbed for the demo: up on enter, down on exit (always)."""

    def __init__(self, hosts: int, dpus: int, workdir: str | os.PathLike,
                 echo: Callable[[str], None] | None = print, prefix: str = "dosademo",
                 cpu_split: bool = False):
        from testbed.core import Testbed

        self.hosts, self.dpus = hosts, dpus
        self.workdir = Path(workdir).resolve()  # the workers run in another directory
        self.echo = echo
        self.cpu_split = cpu_split
        self.tb = Testbed(prefix=prefix)

    def __enter__(self):
        try:
            self.tb.up(hosts=self.hosts, dpus=self.dpus, cpu_split=self.cpu_split)
        except BaseException:
            self.tb.down()
            raise
        return self

    def __exit__(self, *exc):
        self.tb.down()

    def run(self, argv: list[str], timeout: float, env: dict | None = None) -> None:
        result = self.tb.run(argv, timeout=timeout, env=env, log_dir=rank_log_dir(self.workdir),
                             echo=rank0_echo(self.echo))
        raise_on_failure(result, "training on the testbed")

    def dpu_stats(self) -> dict:
        """Each DPU's dataplane counters (the control plane's GET /v1/stats, asked from inside the
        DPU's namespace): evidence of what XDP merged and dropped. Best effort: {} on failure."""
        st = self.tb.load_state() or {}
        out = {}
        for node in self.tb.layout(st).dpu_nodes if st else []:
            code = ("import json; from dosa.join import request; "
                    f"print(json.dumps(request(('{node.address}', {int(st['control_port'])}), "
                    "'GET', '/v1/stats')))")
            try:
                r = self.tb.exec_in(node.name, [sys.executable, "-c", code], timeout=20,
                                    env={"PYTHONPATH": str(REPO_ROOT)})
                out[node.name] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}
            except (subprocess.TimeoutExpired, ValueError, OSError) as e:
                out[node.name] = {"error": str(e)}
        return out

    def cpu_sets(self) -> tuple[str | None, str | None]:
        st = self.tb.load_state() or {}
        fmt = lambda cpus: ",".join(map(str, cpus)) if cpus else None  # noqa: E731
        return fmt(st.get("host_cpus")), fmt(st.get("dpu_cpus"))

    def offload_services(self, datasets_per_dpu: list[list[str]]) -> list:
        """One (not yet started) OffloadServices per DPU: inside the DPU's namespace, listening on
        its fabric address, pinned to the testbed's DPU CPUs."""
        from host_lib.offload.launcher import OffloadServices

        st = self.tb.load_state() or {}
        nodes = self.tb.layout(st).dpu_nodes
        return [OffloadServices(host=node.address, cpus=self.cpu_sets()[1], datasets=ds,
                                netns=node.namespace, startup_timeout=120.0)
                for node, ds in zip(nodes, datasets_per_dpu)]

    def run_pinned(self, argv: list[str], timeout: float) -> None:
        self.run(argv, timeout)  # `testbed run` pins the ranks to the host CPUs itself
