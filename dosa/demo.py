"""``dosa demo``: train a small real model with DDP twice, gradients reduced by dosa at ~1% density
and by Gloo's dense allreduce, and compare accuracy, time per step and bytes on the wire.

Two ways to run the ranks (``backend``):

* ``testbed``: a namespace testbed (``testbed.Testbed``: hosts, DPUs with the XDP dataplane, control
  plane and DPU workers) is brought up, the training runs through ``Testbed.run`` (torchrun's
  environment plus DOSA_*), and the testbed is torn down afterwards. Needs root.
* ``loopback``: no privilege; DPU workers in userspace mode (same protocol, the worker merges
  itself) on 127.0.0.1 and the ranks as local processes with torchrun's environment. Used by the tests
  and when the testbed cannot run here.

Both runs happen in ONE launch of ``examples.train_digits --comm dosa,dense`` (torch imports once
per rank; same data split, same seed, same initial weights). Everything started is stopped in a
``finally`` (also on Ctrl-C): DPU workers, ranks, the testbed.

``--offload`` adds a second launch (``dosa.demo_offload``) on the same cluster: the augmentation and
validation services (dpu_fw/offload) run on every DPU -- inside its namespace on the testbed, on
127.0.0.1 on loopback -- pinned to the DPU half of the CPUs (the testbed comes up with
``--cpu-split``; on loopback the ranks are pinned to the host half the same way). Every rank trains
on its own shard, once augmenting it itself and validating on rank 0 (``host``), once reading it
from its DPU's augmentation service and submitting snapshots to the validation service
(``offload``); the summary compares their time per epoch and checks that both trained identically.
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from dosa.errors import DosaError

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("auto", "testbed", "loopback")
TARGET_POINTS = 1.0  #: dosa's accuracy must be within this many points of dense


@dataclass
class DemoConfig:
    """What ``dosa demo`` runs. Validated on construction (a DosaError names the bad value)."""

    hosts: int = 4
    dpus: int = 1
    density: float = 0.01
    epochs: int = 20
    batch_size: int = 8
    warmup_steps: int = 0
    hidden: int = 128
    seed: int = 0
    out: str = "out/demo"
    backend: str = "auto"
    offload: bool = False
    timeout: float = 900.0
    mode: str = "sum"
    testbed_prefix: str = "dosademo"
    extra_train_args: list[str] = field(default_factory=list)
    #: --offload: the image workload (digits upsampled: at 8x8 augmentation costs nothing worth
    #: offloading), its epochs and per-host batch size
    offload_dataset: str = "digits:size=32,channels=3"
    offload_epochs: int = 5
    offload_batch_size: int = 32

    def __post_init__(self):
        if not 2 <= self.hosts <= 64:
            raise DosaError(f"--hosts must be between 2 and 64, got {self.hosts}")
        if not 1 <= self.dpus <= 16:
            raise DosaError(f"--dpus must be between 1 and 16, got {self.dpus}")
        if not (isinstance(self.density, (int, float)) and 0 < self.density <= 1):
            raise DosaError(f"--density must lie in (0, 1], got {self.density}")
        if self.epochs < 1 or self.batch_size < 1 or self.warmup_steps < 0 or self.hidden < 1:
            raise DosaError("--epochs, --batch-size and --hidden must be >= 1, --warmup-steps >= 0")
        if self.backend not in BACKENDS:
            raise DosaError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.mode not in ("sum", "gtopk"):
            raise DosaError(f"--mode must be sum or gtopk, got {self.mode!r}")
        if not self.timeout > 0:
            raise DosaError(f"--timeout must be positive, got {self.timeout}")
        if self.offload_epochs < 1 or self.offload_batch_size < 1:
            raise DosaError("--offload-epochs and --offload-batch-size must be >= 1")

    @property
    def numel(self) -> int:
        """Gradient entries of examples.train_digits.DigitsMLP(hidden): the dosa job's size."""
        h = self.hidden
        return 64 * h + h + h * h + h + h * 10 + 10

    def train_argv(self, json_path: str) -> list[str]:
        return [sys.executable, "-m", "examples.train_digits", "--comm", "dosa,dense",
                "--density", repr(float(self.density)), "--epochs", str(self.epochs),
                "--batch-size", str(self.batch_size), "--warmup-steps", str(self.warmup_steps),
                "--hidden", str(self.hidden), "--seed", str(self.seed), "--json", json_path,
                *(["--partition-size", str(self.partition_size)] if self.dpus > 1 else []),
                *(["--mode", self.mode] if self.mode != "sum" else []),
                *self.extra_train_args]

    @property
    def partition_size(self) -> int:
        """One partition per DPU: the model is small, so the default 64k partition would leave
        every DPU but the first idle."""
        return math.ceil(self.numel / self.dpus)


# ------------------------------------------------------------------------------------------------
# Loopback backend: userspace DPU workers + local rank processes
# ------------------------------------------------------------------------------------------------
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
        self.workdir = Path(workdir)
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
                [sys.executable, "-m", "dosa", "dpu", "run", "--mode", "userspace",
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

    def run(self, argv: list[str], timeout: float, env: dict | None = None) -> None:
        master_port = free_port(socket.SOCK_STREAM)  # one rendezvous for all ranks
        return run_local_ranks(argv, [self.rank_env(r, master_port) for r in range(self.hosts)],
                               self.workdir, timeout, self.echo, env)

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


def run_local_ranks(argv: list[str], rank_envs: list[dict], log_dir: Path, timeout: float,
                    echo: Callable[[str], None] | None = print, env: dict | None = None) -> None:
    """Start one process per env (own session, output in ``log_dir/rank<i>.log``; rank 0's lines
    are echoed), wait; the first failure or the timeout stops the rest and raises DosaError."""
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for r, renv in enumerate(rank_envs):
            full_env = {**os.environ, **(env or {}), **renv}
            full_env["PYTHONPATH"] = os.pathsep.join(
                [str(REPO_ROOT)] + [x for x in full_env.get("PYTHONPATH", "").split(os.pathsep) if x])
            p = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, log_dir / f"rank{r}.log",
                                                     echo if r == 0 else None), daemon=True)
            t.start()
            pumps.append(t)
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                raise DosaError(f"rank {r} failed with status {codes[r]}; see {log_dir / f'rank{r}.log'}"
                                f" (last line: {_last_line(log_dir / f'rank{r}.log')})")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise DosaError(f"training did not finish within {timeout:g} s; logs in {log_dir}")
            time.sleep(0.05)
    finally:
        stop_processes(procs)
        for t in pumps:
            t.join(timeout=5)


def _noise(line: str) -> bool:
    """torch's own startup warnings (kept in the rank logs, not shown as progress)."""
    return "socket.cpp" in line or "Setting OMP_NUM_THREADS" in line


def _pump(stream, path: Path, echo) -> None:
    with open(path, "wb") as f:
        for line in iter(stream.readline, b""):
            f.write(line)
            f.flush()
            text = line.decode(errors="replace").rstrip("\n")
            if echo is not None and not _noise(text):
                echo(text)
    stream.close()


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no output"
    return lines[-1][-300:] if lines else "no output"


# ------------------------------------------------------------------------------------------------
# Testbed backend
# ------------------------------------------------------------------------------------------------
class TestbedCluster:
    """A namespace testbed for the demo: up on enter, down on exit (always)."""

    def __init__(self, hosts: int, dpus: int, workdir: str | os.PathLike,
                 echo: Callable[[str], None] | None = print, prefix: str = "dosademo",
                 cpu_split: bool = False):
        from testbed.core import Testbed

        self.hosts, self.dpus = hosts, dpus
        self.workdir = Path(workdir)
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
        def echo(line: str):
            if self.echo is not None and line.startswith("[rank 0] ") and not _noise(line):
                self.echo(line[len("[rank 0] "):])

        log_dir = self.workdir / "ranks"
        if log_dir.exists():  # a second launch on the same testbed (--offload) keeps both logs
            log_dir = self.workdir / f"ranks-{time.strftime('%H%M%S')}-{os.getpid()}-{time.monotonic_ns()}"
        result = self.tb.run(argv, timeout=timeout, env=env, log_dir=log_dir, echo=echo)
        if not result.ok:
            raise DosaError(f"training on the testbed failed: {result.summary()}")

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


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
def summarize(rank_files: list[Path]) -> dict:
    """Combine every rank's ``{"runs": [...]}`` into one entry per comm: loss per step averaged over
    ranks, accuracy (identical replicas; checked), time and bytes per step averaged over ranks."""
    per_rank = []
    for f in rank_files:
        try:
            per_rank.append(json.loads(Path(f).read_text())["runs"])
        except (OSError, ValueError, KeyError) as e:
            raise DosaError(f"cannot read the training summary {f}: {e}") from None
    out = {}
    for i, first in enumerate(per_rank[0]):
        runs = [pr[i] for pr in per_rank]
        steps = min(len(r["loss"]) for r in runs)
        loss = [sum(r["loss"][s] for r in runs) / len(runs) for s in range(steps)]
        accs = {r["test_accuracy"] for r in runs}
        mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
        out[first["comm"]] = {
            "test_accuracy": first["test_accuracy"],
            "test_accuracy_per_epoch": first["test_accuracy_per_epoch"],
            "replicas_consistent": all(r["replicas_consistent"] for r in runs) and len(accs) == 1,
            "steps": first["steps"], "epochs": first["epochs"], "params": first["params"],
            "density": first["density"], "warmup_steps": first["warmup_steps"],
            "time_per_step_s": mean("time_per_step_s"),
            "bytes_sent_per_step": mean("bytes_sent_per_step"),
            "bytes_received_per_step": mean("bytes_received_per_step"),
            "bytes_per_step": mean("bytes_per_step"), "bytes_method": first["bytes_method"],
            "loss_per_step": loss,
            "hook": [r["hook"] for r in runs] if first["hook"] else None,
        }
    return out


def plot_losses(runs: dict, path: Path, title: str) -> bool:
    """Loss per step of each run (raw, faint, and a moving average) into a PNG. False when
    matplotlib is not installed (the `plot` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = {"dosa": "tab:red", "dense": "tab:blue"}
    for comm, r in runs.items():
        y = np.asarray(r["loss_per_step"])
        w = max(1, len(y) // 50)
        smooth = np.convolve(y, np.ones(w) / w, mode="valid")
        c = colors.get(comm)
        ax.plot(y, color=c, alpha=0.2, lw=0.7)
        label = (f"{comm}: {r['test_accuracy'] * 100:.1f}% test acc, "
                 f"{r['bytes_per_step'] / 1e3:.1f} kB/step/host")
        ax.plot(np.arange(len(smooth)) + (w - 1), smooth, color=c, lw=1.8, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# --offload: augmentation and validation on the DPUs against the same training on the hosts
# ------------------------------------------------------------------------------------------------
def split_cpus() -> tuple[str | None, str | None]:
    """(host CPUs, DPU CPUs): the first and second half of the CPUs we may use, like the testbed's
    --cpu-split; (None, None) with a single CPU (nothing to split)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def write_shards(dataset: str, hosts: int, seed: int, directory: Path) -> str:
    """One npz per host: an equal-sized, disjoint, seeded part of ``dataset``'s training split, and
    the whole validation split. Returns the dataset spec with ``{rank}`` for the host's index.

    Why files: a service streams whole epochs of a dataset; giving each host its own shard as a
    dataset makes the DPU compute only that host's batches (no new protocol), and both sides load
    it the same way (the DPU reads the shared disk, as it would read its own)."""
    import numpy as np

    from host_lib.offload.datasets import load_dataset

    ds = load_dataset(dataset)
    n = len(ds.train) // hosts
    if n < 1:
        raise DosaError(f"{dataset} has {len(ds.train)} training samples, too few for {hosts} hosts")
    directory.mkdir(parents=True, exist_ok=True)
    perm = np.random.default_rng(seed).permutation(len(ds.train))
    for r in range(hosts):
        idx = np.sort(perm[r::hosts][:n])
        np.savez(directory / f"shard{r}.npz", x=ds.train.x[idx], y=ds.train.y[idx],
                 x_val=ds.val.x, y_val=ds.val.y)
    return f"npz:{directory.resolve()}/shard{{rank}}.npz"


def run_offload_comparison(cluster, cfg: DemoConfig, workdir: Path,
                           echo: Callable[[str], None]) -> dict:
    """Start the offload services on every DPU, train ``host`` then ``offload`` in one launch of
    dosa.demo_offload, stop the services; return summarize_offload(...) plus where things ran."""
    import contextlib

    shard_spec = write_shards(cfg.offload_dataset, cfg.hosts, cfg.seed, workdir / "offload-data")
    specs = [shard_spec.replace("{rank}", str(r)) for r in range(cfg.hosts)]
    per_dpu = [[s for r, s in enumerate(specs) if r % cfg.dpus == j] for j in range(cfg.dpus)]
    host_cpus, dpu_cpus = cluster.cpu_sets()
    json_tmpl = str(workdir / "offload-rank{rank}.json")
    argv = [sys.executable, "-m", "dosa.demo_offload", "--shard-spec", shard_spec,
            "--epochs", str(cfg.offload_epochs), "--batch-size", str(cfg.offload_batch_size),
            "--hidden", str(cfg.hidden), "--seed", str(cfg.seed), "--json", json_tmpl]
    with contextlib.ExitStack() as stack:
        echo(f"offload: starting the augmentation and validation services on {cfg.dpus} DPU(s)"
             f" (CPUs {dpu_cpus or 'all'}; hosts on CPUs {host_cpus or 'all'})")
        services = [stack.enter_context(svc) for svc in cluster.offload_services(per_dpu)]
        argv += ["--augment", ",".join(s.augment_address for s in services),
                 "--validate", ",".join(s.validate_address for s in services)]
        echo(f"offload: training {cfg.offload_epochs} epochs of {cfg.offload_dataset} with "
             "augmentation + validation on the hosts, then on the DPUs")
        cluster.run_pinned(argv, timeout=cfg.timeout)
        addresses = [{"augment": s.augment_address, "validate": s.validate_address,
                      "netns": s.netns, "processes": [_where(p.pid, s.netns) for p in s.procs.values()]}
                     for s in services]
    out = summarize_offload([Path(json_tmpl.replace("{rank}", str(r))) for r in range(cfg.hosts)])
    out.update(dataset=cfg.offload_dataset, shards=shard_spec, batch_size_per_host=cfg.offload_batch_size,
               epochs=cfg.offload_epochs, host_cpus=host_cpus, dpu_cpus=dpu_cpus, services=addresses,
               gradients="dense Gloo allreduce in both modes (only the data path differs)")
    return out


def _where(pid: int, netns: str | None) -> dict:
    """Evidence of where a service process runs: its CPU affinity, and whether its network namespace
    is ``netns`` (the DPU's) -- read from /proc while it runs, not assumed from how it was started."""
    try:
        cpus = sorted(os.sched_getaffinity(pid))
        own = os.stat(f"/proc/{pid}/ns/net").st_ino
        ns_ok = (own == os.stat(f"/run/netns/{netns}").st_ino) if netns else \
            own == os.stat("/proc/self/ns/net").st_ino
    except OSError as e:
        return {"pid": pid, "error": str(e)}
    return {"pid": pid, "cpus": cpus, "in_netns": ns_ok}


def _epoch_time(seconds: list[float]) -> float:
    """Median epoch time, leaving out the first epoch when there are more (connections, lazy
    set-up and the services' first batches are a one-off cost in both modes)."""
    import statistics

    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def summarize_offload(rank_files: list[Path]) -> dict:
    """Both modes over all ranks: time per epoch (_epoch_time, mean over ranks), rank 0's
    validation metrics, batches served by the DPUs vs computed on the hosts, and whether both modes
    trained identically (they see the same batches from the same initial weights)."""
    per_rank = []
    for f in rank_files:
        try:
            per_rank.append(json.loads(Path(f).read_text())["runs"])
        except (OSError, ValueError, KeyError) as e:
            raise DosaError(f"cannot read the offload training summary {f}: {e}") from None
    modes = {}
    for i, first in enumerate(per_rank[0]):
        runs = [pr[i] for pr in per_rank]
        modes[first["mode"]] = {
            "seconds_per_epoch": sum(_epoch_time(r["epoch_seconds"]) for r in runs) / len(runs),
            "epoch_seconds_rank0": first["epoch_seconds"],
            "total_seconds": max(r["total_seconds"] for r in runs),
            "val_accuracy": first["val_accuracy_per_epoch"][-1] if first["val_accuracy_per_epoch"] else None,
            "val_accuracy_per_epoch": first["val_accuracy_per_epoch"],
            "val_loss_per_epoch": first["val_loss_per_epoch"],
            "train_loss_last_epoch": (sum(sum(r["loss"][-r["steps_per_epoch"]:]) / r["steps_per_epoch"]
                                          for r in runs) / len(runs)),
            "steps_per_epoch": first["steps_per_epoch"],
            "batches": sum(r["steps_per_epoch"] * r["epochs"] for r in runs),
            "remote_batches": sum(r["remote_batches"] for r in runs),
            "local_batches": sum(r["local_batches"] for r in runs),
            "fell_back": any(r["loader_fell_back"] or r["validator_fell_back"] for r in runs),
            "validated_on_dpu": first["validated_on_dpu"],
            "warnings": sorted({w for r in runs for w in r["warnings"]}),
        }
    out: dict = {"modes": modes}
    if "host" in modes and "offload" in modes:
        host, off = modes["host"], modes["offload"]
        ratio = off["seconds_per_epoch"] / host["seconds_per_epoch"]
        out.update(ratio_offload_over_host=ratio, time_saved_pct=(1 - ratio) * 100,
                   identical_training=all(pr[0]["loss"] == pr[1]["loss"] for pr in per_rank)
                   and host["val_accuracy_per_epoch"] == off["val_accuracy_per_epoch"])
    return out


def offload_report(o: dict) -> list[str]:
    """The --offload lines of the report."""
    host, off = o["modes"]["host"], o["modes"]["offload"]
    acc = lambda a: "n/a" if a is None else f"{a * 100:.2f}%"  # noqa: E731
    rows = [f"offload ({o['dataset']}, {o['epochs']} epochs, batch {o['batch_size_per_host']}/host; "
            f"hosts on CPUs {o['host_cpus'] or 'all'}, DPU services on CPUs {o['dpu_cpus'] or 'all'}):",
            f"  augmentation + validation on the hosts: {host['seconds_per_epoch']:.3f} s/epoch, "
            f"val acc {acc(host['val_accuracy'])}",
            f"  augmentation + validation on the DPUs:  {off['seconds_per_epoch']:.3f} s/epoch, "
            f"val acc {acc(off['val_accuracy'])}",
            f"  offloaded/host time per epoch {o['ratio_offload_over_host']:.3f} "
            f"({abs(o['time_saved_pct']):.1f}% {'less' if o['time_saved_pct'] >= 0 else 'more'} time); "
            f"identical training in both modes: "
            f"{o['identical_training']}",
            f"  {off['remote_batches']}/{off['batches']} batches served by the DPU augmentation "
            f"service(s), {off['local_batches']} computed on the hosts; {off['validated_on_dpu']}/"
            f"{o['epochs']} validations on the DPU" + ("; FELL BACK to the host" if off["fell_back"] else "")]
    for svc in o.get("services") or []:
        procs = svc.get("processes") or []
        rows.append(f"  services at {svc['augment']} (augment), {svc['validate']} (validate): "
                    f"{'namespace ' + svc['netns'] if svc.get('netns') else 'loopback'}; "
                    f"pinned to CPUs {sorted({c for p in procs for c in p.get('cpus', [])})}, "
                    f"in that namespace: {all(p.get('in_netns') for p in procs)} (read from /proc)")
    return rows


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend, why). ``auto`` takes the testbed when it can run here, loopback otherwise."""
    if requested != "auto":
        return requested, "requested"
    if os.geteuid() != 0:
        return "loopback", "not root: namespaces need root"
    try:
        import testbed.core  # noqa: F401
    except ImportError as e:
        return "loopback", f"the testbed is not installed ({e})"
    return "testbed", "root"


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print) -> dict:
    """Run the demo; returns (and writes to ``cfg.out``/demo.json) the summary."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    backend, why = choose_backend(cfg.backend)
    echo(f"dosa demo: {cfg.hosts} hosts, {cfg.dpus} DPU(s), density {cfg.density:g}, {cfg.mode} mode, "
         f"{cfg.epochs} epochs, MLP with {cfg.numel} parameters on scikit-learn digits; "
         f"backend {backend} ({why})" + ("; with --offload" if cfg.offload else ""))
    for stale in ("demo.json", "loss.png"):  # never leave a previous run's results looking current
        (out / stale).unlink(missing_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="dosa-demo-", dir=out))
    echo(f"logs in {workdir}")
    json_tmpl = str(workdir / "rank{rank}.json")
    t0 = time.monotonic()
    testbed_error = None
    if backend == "testbed":
        echo("bringing up the testbed")
        try:
            cluster = TestbedCluster(cfg.hosts, cfg.dpus, workdir, echo, prefix=cfg.testbed_prefix,
                                     cpu_split=cfg.offload).__enter__()
        except DosaError as e:
            if cfg.backend != "auto":
                raise
            testbed_error = str(e)
            backend = "loopback"
            echo(f"the testbed could not come up ({e}); running on loopback instead")
    if backend == "loopback":
        echo("starting userspace DPU worker(s) on loopback")
        cluster = LoopbackCluster(cfg.hosts, cfg.dpus, cfg.numel, workdir, cfg.density, echo=echo,
                                  partition_size=cfg.partition_size, mode=cfg.mode).__enter__()
    try:
        echo("training: dosa run first, then dense Gloo (same seed, data, initial weights)")
        cluster.run(cfg.train_argv(json_tmpl), timeout=cfg.timeout)
        dpu_stats = cluster.dpu_stats()
        offload = run_offload_comparison(cluster, cfg, workdir, echo) if cfg.offload else None
        echo("tearing down")
    finally:
        cluster.__exit__(None, None, None)
    echo("torn down")
    runs = summarize([Path(json_tmpl.replace("{rank}", str(r))) for r in range(cfg.hosts)])
    dosa, dense = runs["dosa"], runs["dense"]
    gap = (dense["test_accuracy"] - dosa["test_accuracy"]) * 100
    summary = {
        "config": asdict(cfg),
        "backend": backend, "testbed_error": testbed_error, "elapsed_s": time.monotonic() - t0,
        "accuracy_gap_points": gap, "target_points": TARGET_POINTS, "within_target": gap <= TARGET_POINTS,
        "bytes_ratio_dense_over_dosa": (dense["bytes_per_step"] / dosa["bytes_per_step"]
                                        if dosa["bytes_per_step"] else math.inf),
        "runs": runs, "dpu_stats": dpu_stats, "offload": offload,
    }
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    plotted = plot_losses(runs, out / "loss.png",
                          f"DDP on digits, {cfg.hosts} hosts: dosa at density {cfg.density:g} vs dense Gloo")
    summary["plot"] = str(out / "loss.png") if plotted else None
    return summary


def format_report(s: dict) -> str:
    """The table `dosa demo` prints at the end."""
    rows = []
    if s.get("testbed_error"):
        rows.append(f"NOTE: ran on loopback (userspace DPU workers), the testbed failed: {s['testbed_error']}")
    rows.append(f"{'':8} {'test acc':>9} {'ms/step':>9} {'bytes/step/host':>16}  (sent + received)")
    for comm in ("dosa", "dense"):
        r = s["runs"][comm]
        rows.append(f"{comm:8} {r['test_accuracy'] * 100:8.2f}% {r['time_per_step_s'] * 1e3:9.2f} "
                    f"{r['bytes_per_step']:16,.0f}")
    verdict = "within" if s["within_target"] else "NOT within"
    rows.append(f"accuracy gap: {s['accuracy_gap_points']:+.2f} points (dense - dosa), {verdict} the "
                f"{s['target_points']:g}-point target; dense moves "
                f"{s['bytes_ratio_dense_over_dosa']:.1f}x the bytes of dosa per step")
    for name, st in (s.get("dpu_stats") or {}).items():
        if "outcomes" in st:
            busy = {k: v for k, v in st["outcomes"].items() if v}
            rows.append(f"DPU {name} dataplane ({len(st.get('attachments') or [])} XDP attachment(s)): "
                        f"{busy}; drops {st.get('drops_total', 0)}")
        elif st:
            rows.append(f"DPU {name}: counters unavailable ({str(st.get('error', st))[:120]})")
    hooks = [h for h in (s["runs"]["dosa"].get("hook") or []) if h and h.get("dosa_rounds")]
    if hooks:
        per = lambda key: sum(h[key] / h["dosa_rounds"] for h in hooks) / len(hooks) * 1e3  # noqa: E731
        rows.append(f"dosa hook per step: {per('dosa_seconds'):.2f} ms, of which {per('allreduce_seconds'):.2f} ms "
                    f"in the network round; mean density {hooks[0]['mean_density']:.4f}, "
                    f"{sum(h['retransmissions'] for h in hooks)} retransmissions (all hosts)")
    d = s["runs"]["dosa"]
    rows.append(f"bytes: dosa = {d['bytes_method']}; dense = {s['runs']['dense']['bytes_method']}")
    if s.get("offload"):
        rows.extend(offload_report(s["offload"]))
    return "\n".join(rows)
