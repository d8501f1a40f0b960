"""``dosa bench offload``: time per epoch with augmentation and validation on the host against the
same run with both offloaded to the services, host and "DPU" on disjoint CPUs.

Both modes train the same model on the same batches (the pipeline is deterministic, so their losses
match to the bit: the benchmark checks it), in one process pinned to the host CPU with one torch
thread; the services are pinned to the DPU CPUs. Modes alternate round by round so that background
load hits both alike; the medians give the ratio.
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time

from dosa.errors import DosaError
from dosa.progress import track

DEFAULT_DATASET = "digits:size=64,channels=3"


def _shares(dataset: str, batch_size: int, seed: int, spec: dict, epoch_cpu_seconds: float) -> dict:
    """How much of a host-only epoch's CPU time is augmentation and validation, each measured alone
    on the host. CPU time, not wall time: on a shared machine it is the figure that holds still."""
    from examples.train_offload import _local_metrics
    from host_lib.offload import LocalLoader
    from dosa.offload.models import build_model

    loader = LocalLoader(dataset, batch_size, seed, as_numpy=True)
    t0 = time.process_time()
    for _ in loader:
        pass
    aug = time.process_time() - t0
    model = build_model(spec)
    t0 = time.process_time()
    _local_metrics(model, spec, dataset)
    val = time.process_time() - t0
    return {"augment_cpu_seconds": aug, "validate_cpu_seconds": val,
            "augment_share": aug / epoch_cpu_seconds, "validate_share": val / epoch_cpu_seconds}


def _renice(pid: int, niceness: int) -> None:
    """Set the niceness of every thread of ``pid`` (on Linux, nice is per thread; threads started
    later inherit it from the thread that starts them)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        if os.path.exists(f"/proc/{pid}/autogroup"):  # with autogroups, nice only works within one
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(niceness))
    except PermissionError:
        raise DosaError("--nice below 0 needs root (CAP_SYS_NICE)") from None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a whole process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(dataset: str = DEFAULT_DATASET, epochs: int = 3, rounds: int = 5, batch_size: int = 64,
        hidden: int = 384, host_cpu: int = 0, dpu_cpus: str = "1", seed: int = 0,
        nice: int = 0) -> dict:
    import torch
    from dpu_fw.offload._server import parse_cpus
    from examples.train_offload import default_model_spec, run_training
    from host_lib.offload import OffloadServices

    dpu = parse_cpus(dpu_cpus) or set()
    avail = os.sched_getaffinity(0)
    if host_cpu in dpu or not ({host_cpu} | dpu) <= avail:
        raise DosaError(f"host CPU {host_cpu} and DPU CPUs {sorted(dpu)} must be disjoint and "
                        f"among this process's CPUs {sorted(avail)}")
    if epochs < 1 or rounds < 1:
        raise DosaError("epochs and rounds must be at least 1")
    os.sched_setaffinity(0, {host_cpu})
    torch.set_num_threads(1)
    spec = default_model_spec(dataset, hidden=(hidden,))
    times: dict[str, list[float]] = {"host": [], "offload": []}
    cpu: dict[str, list[float]] = {"host": [], "offload": []}
    dpu_cpu: list[float] = []
    load_before = os.getloadavg()[0]
    losses: dict[str, list] = {}
    with OffloadServices(cpus=dpu_cpus, datasets=[dataset], threads=1) as svc:
        if nice:  # the same priority for the host loop and the services: emulates dedicated cores
            for pid in [os.getpid(), *(p.pid for p in svc.procs.values())]:
                _renice(pid, nice)
        kw = dict(dataset=dataset, model_spec=spec, batch_size=batch_size, seed=seed, lr=0.01)
        run_training(epochs=1, **kw)  # warm-up: caches, allocator, first-touch
        run_training(epochs=1, offload=svc, **kw)
        for r in track(range(rounds), "dosa bench offload", unit="round"):
            order = ("host", "offload") if r % 2 == 0 else ("offload", "host")
            for mode in order:
                before = sum(_cpu_seconds(p.pid) for p in svc.procs.values())
                res = run_training(epochs=epochs, offload=svc if mode == "offload" else None, **kw)
                if mode == "offload":
                    after = sum(_cpu_seconds(p.pid) for p in svc.procs.values())
                    dpu_cpu.append((after - before) / epochs)
                if res["fell_back"]:
                    raise DosaError(f"the offload services failed during the benchmark: "
                                    f"{svc.log('augment')[-300:]} {svc.log('validate')[-300:]}")
                times[mode].append(res["seconds"] / epochs)
                cpu[mode].append(res["cpu_seconds"] / epochs)
                losses.setdefault(mode, [round(e["train_loss"], 12) for e in res["epochs"]])
    host, off = statistics.median(times["host"]), statistics.median(times["offload"])
    result = {
        "command": "dosa bench offload " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        if sys.argv[1:3] == ["bench", "offload"] else " ".join(sys.argv),
        "setup": "loopback TCP, services as subprocesses; host loop pinned to CPU "
                 f"{host_cpu}, services to CPU(s) {dpu_cpus}; torch.set_num_threads(1) on each side",
        "dataset": dataset, "model": spec, "batch_size": batch_size, "epochs_per_run": epochs,
        "rounds": rounds, "seconds_per_epoch": times,
        "host_median_s": host, "offload_median_s": off, "ratio": off / host,
        "reduction_pct": 100.0 * (1 - off / host),
        # each round's offloaded run against its own host-only run (they ran back to back)
        "paired_ratio_median": statistics.median(o / h for o, h in zip(times["offload"], times["host"])),
        # the fastest run of each mode: least disturbed by other processes on a shared machine
        "host_min_s": min(times["host"]), "offload_min_s": min(times["offload"]),
        "ratio_min": min(times["offload"]) / min(times["host"]),
        # CPU time of the host process per epoch: what the host saves, whatever else runs
        "host_cpu_seconds_per_epoch": cpu,
        "host_cpu_ratio": statistics.median(cpu["offload"]) / statistics.median(cpu["host"]),
        # CPU time the services used per offloaded epoch (includes preparing the next epoch ahead)
        "dpu_cpu_seconds_per_epoch": dpu_cpu,
        # with dedicated cores an epoch cannot be faster than the busier side: a model, not a measurement
        "dedicated_cores_estimate_ratio": max(statistics.median(cpu["offload"]),
                                              statistics.median(dpu_cpu))
        / statistics.median(cpu["host"]),
        "same_training_losses": losses.get("host") == losses.get("offload"),
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
        "nice": nice,
    }
    result.update(_shares(dataset, batch_size, seed, spec, statistics.median(cpu["host"])))
    return result


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DosaError("--plot needs matplotlib: pip install 'dosa[plot]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    host, off = result["host_median_s"], result["offload_median_s"]
    # split the host-only bar by the CPU-time shares of augmentation and validation
    aug, val = host * result["augment_share"], host * result["validate_share"]
    ax.bar(["host only"], [host - aug - val], label="training step (rest)", color="#4c72b0")
    ax.bar(["host only"], [aug], bottom=[host - aug - val], label="augmentation (CPU share)", color="#dd8452")
    ax.bar(["host only"], [val], bottom=[host - val], label="validation (CPU share)", color="#55a868")
    ax.bar(["augment + validate\noffloaded"], [off], color="#8172b3", label="offloaded")
    for mode, xpos in (("host", 0), ("offload", 1)):
        ts = result["seconds_per_epoch"][mode]
        ax.scatter([xpos] * len(ts), ts, color="black", s=10, zorder=3)
    ax.set_ylabel("wall seconds per epoch (median; dots: runs)")
    ax.set_title(f"{result['dataset']}, batch {result['batch_size']}: "
                 f"{result['reduction_pct']:.1f}% less time per epoch", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(r: dict) -> str:
    return (f"host only: {r['host_median_s']:.3f} s/epoch, offloaded: {r['offload_median_s']:.3f} s/epoch "
            f"-> ratio {r['ratio']:.3f} ({r['reduction_pct']:.1f}% less; fastest runs: ratio "
            f"{r['ratio_min']:.3f}, median of paired rounds: {r['paired_ratio_median']:.3f}); augmentation is "
            f"{100 * r['augment_share']:.0f}% and validation {100 * r['validate_share']:.0f}% of a "
            f"host-only epoch's CPU time; host CPU time ratio {r['host_cpu_ratio']:.3f}, DPU CPU "
            f"{statistics.median(r['dpu_cpu_seconds_per_epoch']):.3f} s/epoch (dedicated-cores "
            f"estimate: ratio {r['dedicated_cores_estimate_ratio']:.3f}); identical training "
            f"losses: {r['same_training_losses']}; load average {r['loadavg_1min_before_after']}")


def main(args) -> int:
    if not -20 <= args.nice <= 19:
        raise DosaError("--nice must be in [-20, 19]")
    r = run(args.dataset, args.epochs, args.rounds, args.batch_size, args.hidden, args.host_cpu,
            args.dpu_cpus, args.seed, args.nice)
    print(summary(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    if args.plot:
        plot(r, args.plot)
    return 0
