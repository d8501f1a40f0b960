"""The demo's results: every rank's summary combined (summarize), the loss plot, the printed table."""
from __future__ import annotations

import json
from pathlib import Path

from dosa.errors import DosaError

from .offload import offload_report


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
        rows.append(f"dosa hook per step: {per('hook_seconds'):.2f} ms blocking backward "
                    f"({hooks[0]['overlapped_rounds']} of {hooks[0]['dosa_rounds']} rounds overlapped); "
                    f"mean density {hooks[0]['mean_density']:.4f}, "
                    f"{sum(h['retransmissions'] for h in hooks)} retransmissions (all hosts)")
    d = s["runs"]["dosa"]
    rows.append(f"bytes: dosa = {d['bytes_method']}; dense = {s['runs']['dense']['bytes_method']}")
    if s.get("offload"):
        rows.extend(offload_report(s["offload"]))
    if s.get("time_to_accuracy"):
        from benchmarks.train import format_table

        rows.append("time to accuracy, CNN on a communication-bound link (dosa bench train at demo size):")
        rows.extend("  " + line for line in format_table(s["time_to_accuracy"]).splitlines())
    return "\n".join(rows)
