"""``run_demo``: bring up a cluster (the testbed, or loopback), train dosa then dense in one launch,
tear down, summarize, write demo.json and loss.png."""
from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from dosa.errors import DosaError
from dosa.progress import progress

from .clusters import LoopbackCluster, TestbedCluster
from .config import TARGET_POINTS, DemoConfig, choose_backend
from .offload import run_offload_comparison
from .report import plot_losses, summarize


def run_time_to_accuracy(cfg: DemoConfig, out: Path, echo: Callable[[str], None]) -> dict:
    """The same story on a communication-bound job: ``dosa bench train`` (benchmarks/train.py) at
    demo size on its own testbed; writes time_to_accuracy.png."""
    import argparse

    from benchmarks import train

    args = argparse.Namespace(**{**train.DEFAULTS, "hosts": cfg.hosts, "dpus": 1, "max_steps": 0,
                                 "epochs": cfg.tta_epochs, "methods": cfg.tta_methods, "blocking_steps": 0,
                                 "timeout": cfg.timeout, "seed": cfg.seed})
    echo(f"time to accuracy on a communication-bound job: dosa bench train at demo size "
         f"({cfg.tta_methods}, {cfg.tta_epochs} epochs)")
    result = train.run(args)
    png = out / "time_to_accuracy.png"
    train.plot(result, str(png))
    result["plot"] = str(png)
    return result


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print) -> dict:
    """Run the demo; returns (and writes to ``cfg.out``/demo.json) the summary."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    backend, why = choose_backend(cfg.backend)
    # stages: cluster up, training, [offload], tear down, [time to accuracy]
    bar = progress(3 + bool(cfg.offload) + bool(backend == "testbed" and cfg.tta_methods), "dosa demo",
                   unit="stage")
    if echo is print and bar.mode == "bar":
        echo = bar.note  # lines above the bar instead of through it
    echo(f"dosa demo: {cfg.hosts} hosts, {cfg.dpus} DPU(s), density {cfg.density:g}, {cfg.mode} mode, "
         f"{cfg.epochs} epochs, MLP with {cfg.numel} parameters on scikit-learn digits; "
         f"backend {backend} ({why})" + ("; with --offload" if cfg.offload else ""))
    for stale in ("demo.json", "loss.png", "time_to_accuracy.png"):  # never leave a previous run's results looking current
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
    bar.update(1, status="cluster up")
    try:
        echo("training: dosa run first, then dense Gloo (same seed, data, initial weights)")
        cluster.run(cfg.train_argv(json_tmpl), timeout=cfg.timeout)
        bar.update(1, status="trained")
        dpu_stats = cluster.dpu_stats()
        offload = run_offload_comparison(cluster, cfg, workdir, echo) if cfg.offload else None
        if cfg.offload:
            bar.update(1, status="offload compared")
        echo("tearing down")
    finally:
        cluster.__exit__(None, None, None)
    bar.update(1, status="torn down")
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
    if backend == "testbed" and cfg.tta_methods:
        summary["time_to_accuracy"] = run_time_to_accuracy(cfg, out, echo)
        bar.update(1, status="time to accuracy")
    bar.close()
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    plotted = plot_losses(runs, out / "loss.png",
                          f"DDP on digits, {cfg.hosts} hosts: dosa at density {cfg.density:g} vs dense Gloo")
    summary["plot"] = str(out / "loss.png") if plotted else None
    return summary
