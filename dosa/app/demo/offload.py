"""``dosa demo --offload``: augmentation and validation on the DPUs against the same training on the
hosts (one launch of dosa.app.demo.offload_rank on the demo's cluster), and its summary."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

from dosa.errors import DosaError

from .config import DemoConfig


def write_shards(dataset: str, hosts: int, seed: int, directory: Path) -> str:
    """One npz per host: an equal-sized, disjoint, seeded part of ``dataset``'s training split, and
    the whole validation split. Returns the dataset spec with ``{rank}`` for the host's index.

    Why files: a service streams whole epochs of a dataset; giving each host its own shard as a
    dataset makes the DPU compute only that host's batches (no new protocol), and both sides load
    it the same way (the DPU reads the shared disk, as it would read its own)."""
    import numpy as np

    from dosa.offload.datasets import load_dataset

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
    dosa.app.demo.offload_rank, stop the services; return summarize_offload(...) plus where things ran."""
    import contextlib

    shard_spec = write_shards(cfg.offload_dataset, cfg.hosts, cfg.seed, workdir / "offload-data")
    specs = [shard_spec.replace("{rank}", str(r)) for r in range(cfg.hosts)]
    per_dpu = [[s for r, s in enumerate(specs) if r % cfg.dpus == j] for j in range(cfg.dpus)]
    host_cpus, dpu_cpus = cluster.cpu_sets()
    json_tmpl = str(workdir / "offload-rank{rank}.json")
    argv = [sys.executable, "-m", "dosa.app.demo.offload_rank", "--shard-spec", shard_spec,
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
