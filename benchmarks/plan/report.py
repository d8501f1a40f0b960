"""What ``dosa plan`` prints and writes: the predictions' table, the JSON document, the plot of round
time over link rate."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from benchmarks.plan.model import METHODS, Cluster, Workload, predict

#: the plot's link rates, Gbit/s (1-200, log spaced)
PLOT_RATES = tuple(float(x) for x in np.unique(np.round(np.logspace(0, np.log10(200), 40), 2)))


def predictions(models: list[Workload], rates: list[float], cluster: Cluster, costs) -> list[dict]:
    """One record a (model, link rate, method): the JSON's ``predictions``."""
    out = []
    for wl in models:
        for rate in rates:
            c = replace(cluster, link_gbps=rate)
            for m in METHODS:
                p = predict(m, c, wl, costs)
                out.append({"model": wl.model, "numel": wl.numel, "link_gbps": rate,
                            "nodes": c.nodes, "ranks_per_node": c.ranks_per_node, "method": m,
                            "round_s": p.round_s, "bound": p.bound, "parts": p.parts})
    return out


def format_table(preds: list[dict]) -> str:
    """Rows of (model, link): each method's round and what bounds it; the fastest marked."""
    lines = [f"{'model':12} {'numel':>7} {'link':>8}  " + "  ".join(f"{m:>22}" for m in METHODS)]
    keys = sorted({(p["model"], p["numel"], p["link_gbps"]) for p in preds},
                  key=lambda k: ([p["model"] for p in preds].index(k[0]), k[2]))
    for model, numel, rate in keys:
        row = {p["method"]: p for p in preds if (p["model"], p["numel"], p["link_gbps"]) == (model, numel, rate)}
        best = min(row.values(), key=lambda p: p["round_s"])["method"]
        cells = [f"{row[m]['round_s'] * 1e3:8.1f} ms {row[m]['bound']:>9}{'*' if m == best else ' '}"
                 for m in METHODS]
        lines.append(f"{model:12} {numel / 1e6:6.1f}M {rate:6g}G  " + "  ".join(f"{c:>22}" for c in cells))
    lines.append("(round time, what bounds it; * the fastest)")
    return "\n".join(lines)


def plot(path: str, models: list[Workload], cluster: Cluster, costs, title: str) -> None:
    """Round time against link rate, one panel a model, one line a method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    styles = {"dosa_sum": ("C0", "-"), "dosa_gtopk": ("C0", "--"), "ring_allreduce": ("C3", "-"),
              "sparse_allgather": ("C2", "-")}
    for ax, wl in zip(axes[0], models):
        for m in METHODS:
            ys = [predict(m, replace(cluster, link_gbps=r), wl, costs).round_s * 1e3 for r in PLOT_RATES]
            color, ls = styles[m]
            ax.plot(PLOT_RATES, ys, color=color, ls=ls, label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel("predicted round (ms)")
        ax.set_title(f"{wl.model} ({wl.numel / 1e6:.1f}M, density {wl.density:g})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=float)
