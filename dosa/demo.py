"""``dosa demo``: train a small real model with DDP twice, gradients reduced by dosa at ~1% density
and by Gloo's dense allreduce, and compare accuracy, time per step and bytes on the wire.

Two ways to run the ranks (``backend``):

* ``testbed``: a namespace testbed (``testbed.Testbed``: hosts, DPUs with the XDP dataplane, control
  plane and DPU workers) is brought up, the training runs through ``Testbed.run`` (torchrun's
  environment plus DOSA_*), and the testbed is torn down afterwards. Needs root.
* ``loopback``: no privilege; DPU workers in userspace mode (same protocol, the worker merges
  itself) on 127.0.0.1 and the ranks as local processes with torchrun's environment. Used by the tests
  and when the testbed cannot run here.

Both runs happen in ONE launch of ``host_lib.train_digits --comm dosa,dense`` (torch imports once
per rank; same data split, same seed, same initial weights). Everything started is stopped in a
``finally`` (also on Ctrl-C): DPU workers, ranks, the testbed.
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

    @property
    def numel(self) -> int:
        """Gradient entries of host_lib.train_digits.DigitsMLP(hidden): the dosa job's size."""
        h = self.hidden
        return 64 * h + h + h * h + h + h * 10 + 10

    def train_argv(self, json_path: str) -> list[str]:
        return [sys.executable, "-m", "host_lib.train_digits", "--comm", "dosa,dense",
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
        from host_lib.transport import JobConfig

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
                 echo: Callable[[str], None] | None = print, prefix: str = "dosademo"):
        from testbed.core import Testbed

        self.hosts, self.dpus = hosts, dpus
        self.workdir = Path(workdir)
        self.echo = echo
        self.tb = Testbed(prefix=prefix)

    def __enter__(self):
        try:
            self.tb.up(hosts=self.hosts, dpus=self.dpus)
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

        result = self.tb.run(argv, timeout=timeout, env=env, log_dir=self.workdir / "ranks", echo=echo)
        if not result.ok:
            raise DosaError(f"training on the testbed failed: {result.summary()}")

    def dpu_stats(self) -> dict:
        """Each DPU's dataplane counters (the control plane's GET /v1/stats, asked from inside the
        DPU's namespace): evidence of what XDP merged and dropped. Best effort: {} on failure."""
        st = self.tb.load_state() or {}
        out = {}
        for node in self.tb.layout(st).dpu_nodes if st else []:
            code = ("import json; from control.api import request; "
                    f"print(json.dumps(request(('{node.address}', {int(st['control_port'])}), "
                    "'GET', '/v1/stats')))")
            try:
                r = self.tb.exec_in(node.name, [sys.executable, "-c", code], timeout=20,
                                    env={"PYTHONPATH": str(REPO_ROOT)})
                out[node.name] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}
            except (subprocess.TimeoutExpired, ValueError, OSError) as e:
                out[node.name] = {"error": str(e)}
        return out


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
    if cfg.offload:
        raise DosaError("--offload is not available yet: the DPU offload services are not wired "
                        "into the demo")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    backend, why = choose_backend(cfg.backend)
    echo(f"dosa demo: {cfg.hosts} hosts, {cfg.dpus} DPU(s), density {cfg.density:g}, {cfg.mode} mode, "
         f"{cfg.epochs} epochs, MLP with {cfg.numel} parameters on scikit-learn digits; "
         f"backend {backend} ({why})")
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
            cluster = TestbedCluster(cfg.hosts, cfg.dpus, workdir, echo,
                                     prefix=cfg.testbed_prefix).__enter__()
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
        "runs": runs, "dpu_stats": dpu_stats,
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
    return "\n".join(rows)
