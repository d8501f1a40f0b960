"""``dosa bench train``: time to accuracy on a communication-bound job, dosa against real peers.

Brings up a namespace testbed (``--hosts`` hosts, ``--dpus`` DPUs with the XDP dataplane, links
shaped to ``--link-rate``), then trains the same ~1.1M-parameter CNN (benchmarks/train_worker.py)
once per method, one rank per host, from the same seed, split, batches and initial weights:
``dosa_sum``, ``dosa_gtopk``, ``gloo_dense``, ``gloo_sparse_allgather`` (DGC over Gloo, the same
encoder) and ``powersgd`` (PyTorch's own hook). One more short run, ``dosa_sum`` without overlap,
measures how long the hook blocks backward when it parks every bucket for one blocking round.

Why the link is slow: these hosts compute ~100x slower than a GPU, so the link is scaled down with
them until a dense allreduce is at least half of a dense step (the JSON says whether it was:
``dense_comm_fraction``), the regime in-network aggregation is for.

The target accuracy is dense's final accuracy minus 0.5 points; a method's time to target is the
training clock (evaluation excluded) at its first evaluation at or above it (null if never).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from dosa.errors import DosaError
from dosa.progress import progress

METHODS = ("dosa_sum", "dosa_gtopk", "gloo_dense", "gloo_sparse_allgather", "powersgd")
BLOCKING = "dosa_sum_blocking"
#: The configuration of the issue's targets (docs/training.md, "dosa bench train").
DEFAULTS = dict(hosts=4, dpus=1, link_rate="100mbit", epochs=12, batch_size=32, size=16, lr=0.05,
                density=0.01, momentum=0.9, warmup_steps=0, eval_every=4, blocking_steps=30,
                result_density=0.02)


def add_arguments(p) -> None:
    d = DEFAULTS
    p.add_argument("--hosts", type=int, default=d["hosts"], help=f"hosts (ranks), default {d['hosts']}")
    p.add_argument("--dpus", type=int, default=d["dpus"], help=f"DPUs, default {d['dpus']}")
    p.add_argument("--link-rate", default=d["link_rate"],
                   help=f"every link's rate (tc syntax), default {d['link_rate']}")
    p.add_argument("--epochs", type=int, default=d["epochs"], help=f"default {d['epochs']}")
    p.add_argument("--max-steps", type=int, default=0, help="stop every method after N steps (0: epochs)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="per rank")
    p.add_argument("--size", type=int, default=d["size"], help="digits upscaled to SIZE x SIZE")
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--density", type=float, default=d["density"], help="top-k fraction of the sparse methods")
    p.add_argument("--momentum", type=float, default=d["momentum"],
                   help="SGD momentum (dense, powersgd) = DGC momentum correction (sparse methods)")
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"],
                   help="dense steps before the dosa methods sparsify")
    p.add_argument("--result-density", type=float, default=d["result_density"],
                   help="the dosa jobs' density: in gtopk mode the DPU returns this fraction of each "
                        f"partition (default {d['result_density']}: 2x what a host sends; 0: --density)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="steps between test evaluations")
    p.add_argument("--blocking-steps", type=int, default=d["blocking_steps"],
                   help="steps of the no-overlap dosa_sum run (0: skip the overlap measurement)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot accuracy against wall time")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per method run")


def check(args) -> list[str]:
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise DosaError(f"--methods takes a subset of {', '.join(METHODS)}; got {args.methods!r}")
    if not 1 <= args.hosts <= 16 or args.dpus < 1:
        raise DosaError("--hosts must be in 1..16 and --dpus at least 1")
    if args.epochs < 1 or args.batch_size < 1 or args.eval_every < 1 or args.max_steps < 0:
        raise DosaError("--epochs, --batch-size and --eval-every must be at least 1, --max-steps >= 0")
    if args.size < 8 or args.size % 2:
        raise DosaError(f"--size must be an even number >= 8, got {args.size}")
    if not 0 < args.density <= 1 or not 0 <= args.momentum < 1 or args.lr <= 0:
        raise DosaError("--density must be in (0, 1], --momentum in [0, 1), --lr positive")
    return methods


def summarize(records: dict, blocking: dict | None = None) -> dict:
    """The JSON of ``--json``: target from dense's final accuracy, every method's time to it, the
    ratios of the issue's targets, and the overlap measurement."""
    if "gloo_dense" not in records:
        raise DosaError("the target accuracy is dense's final accuracy: gloo_dense must be among the methods")
    target = round(records["gloo_dense"]["final_accuracy"] - 0.5, 3)
    out = {"target_accuracy": target, "methods": {}}
    for name, r in records.items():
        hit = next((c["wall_s"] for c in r["curve"] if c["accuracy"] >= target), None)
        out["methods"][name] = {**r, "time_to_target_s": hit}
    m = out["methods"]

    def ratio(a, b):
        ta, tb = m.get(a, {}).get("time_to_target_s"), m.get(b, {}).get("time_to_target_s")
        return round(ta / tb, 3) if ta is not None and tb else None

    dense = m["gloo_dense"]
    ratios = {}
    for dosa in ("dosa_sum", "dosa_gtopk"):
        if dosa in m:
            ratios[dosa] = {"accuracy_gap_vs_dense": round(m[dosa]["final_accuracy"] - dense["final_accuracy"], 3),
                            "ttt_over_dense": ratio(dosa, "gloo_dense"),
                            "ttt_over_sparse_allgather": ratio(dosa, "gloo_sparse_allgather"),
                            "ttt_over_powersgd": ratio(dosa, "powersgd")}
    out["ratios"] = ratios
    out["dense_step_s"] = dense["step_seconds_median"]
    if blocking is not None and "dosa_sum" in m and m["dosa_sum"].get("hook"):
        over = m["dosa_sum"]["hook"]["hook_block_s_per_step"]
        block = blocking["hook"]["hook_block_s_per_step"]
        out["overlap"] = {"hook_block_s_per_step_overlap": over, "hook_block_s_per_step_blocking": block,
                          "ratio": round(over / block, 3) if over is not None and block else None,
                          "step_s_overlap": m["dosa_sum"]["step_seconds_median"],
                          "step_s_blocking": blocking["step_seconds_median"]}
    return out


def dense_comm_fraction(result: dict, link_bps: int, hosts: int) -> float | None:
    """Share of a dense step that the ring allreduce's bytes need on the link alone."""
    d = result["methods"].get("gloo_dense")
    if not d or not link_bps or hosts < 2:
        return None
    wire_s = 2 * (hosts - 1) / hosts * 4 * d["numel"] * 8 / link_bps
    return round(wire_s / d["step_seconds_median"], 3)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in result["methods"].items():
        t = [c["wall_s"] for c in r["curve"]]
        a = [c["accuracy"] for c in r["curve"]]
        ttt = r["time_to_target_s"]
        ax.plot(t, a, label=f"{name} (target at {ttt:.0f} s)" if ttt is not None else f"{name} (target not reached)")
    ax.axhline(result["target_accuracy"], color="gray", ls="--", lw=1, label=f"target {result['target_accuracy']:.1f}%")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    lo = min(c["accuracy"] for r in result["methods"].values() for c in r["curve"])
    ax.set_ylim(max(lo, result["target_accuracy"] - 30), 100)
    ax.set_title(f"dosa bench train: {result.get('config', {}).get('hosts', '?')} hosts, "
                 f"{result.get('config', {}).get('link_rate', '?')} links, CNN "
                 f"{next(iter(result['methods'].values()))['numel'] / 1e6:.2f}M parameters")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _worker_argv(args, method: str, out: Path, max_steps: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.train_worker", "--method", method, "--out", str(out),
            "--epochs", str(args.epochs), "--max-steps", str(max_steps), "--batch-size", str(args.batch_size),
            "--size", str(args.size), "--lr", str(args.lr), "--density", str(args.density),
            "--momentum", str(args.momentum), "--warmup-steps", str(args.warmup_steps),
            "--result-density", str(args.result_density),
            "--eval-every", str(args.eval_every)]


def run(args) -> dict:
    from testbed.shaping import parse_rate
    from testbed.testing import scratch_testbed, unique_prefix

    methods = check(args)
    link_bps = parse_rate(args.link_rate) if args.link_rate else 0
    runs = [(m, args.max_steps) for m in methods]
    if args.blocking_steps and "dosa_sum" in methods:
        runs.append((BLOCKING, min(args.blocking_steps, args.max_steps or args.blocking_steps)))
    records, t0 = {}, time.monotonic()
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="dosa-bench-train-") as tmp:
        print(f"dosa bench train: testbed of {args.hosts} hosts, {args.dpus} DPU(s), links {args.link_rate}; "
              f"methods {', '.join(m for m, _ in runs)}", flush=True)
        with scratch_testbed(args.hosts, args.dpus, prefix=unique_prefix("tr"), link_rate=args.link_rate) as tb:
            bar = progress(len(runs), "dosa bench train", unit="run")
            for i, (method, max_steps) in enumerate(runs):
                out = Path(tmp) / f"{method}.json"
                print(f"[{i + 1}/{len(runs)}] {method} ...", flush=True)
                res = tb.run(_worker_argv(args, method, out, max_steps), timeout=args.timeout,
                             log_dir=Path(tmp) / f"{method}-logs", echo=_progress,
                             env={"PYTHONPATH": str(repo)})
                if not res.ok:
                    raise DosaError(f"bench train: {method} failed: {res.summary()}: "
                                    + _tail(Path(res.ranks[0].stderr_path)))
                records[method] = json.loads(out.read_text())
                r = records[method]
                print(f"    {method}: final accuracy {r['final_accuracy']:.2f}% after {r['steps']} steps, "
                      f"{r['train_seconds']:.1f} s training, {r['step_seconds_median'] * 1e3:.0f} ms/step, "
                      f"{r['bytes_per_step'] / 1e3:.0f} kB/step on rank 0's link", flush=True)
                bar.update(1, status=method)
            bar.close()
    blocking = records.pop(BLOCKING, None)
    result = summarize(records, blocking)
    result["config"] = {k: getattr(args, k) for k in ("hosts", "dpus", "link_rate", "epochs", "max_steps",
                                                       "batch_size", "size", "lr", "density", "momentum",
                                                       "warmup_steps", "result_density", "eval_every")}
    result["dense_comm_fraction"] = dense_comm_fraction(result, link_bps, args.hosts)
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result


def _progress(line: str) -> None:
    """Echo the ranks' progress lines (rank 0 prints them) and errors; drop the rest."""
    if any(line.startswith(f"[rank 0] [{m}") for m in METHODS) or "Error" in line or "Traceback" in line:
        print("    " + line, flush=True)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return "(no log)"


def format_table(result: dict) -> str:
    m = result["methods"]
    rows = [f"target accuracy {result['target_accuracy']:.2f}% (dense final - 0.5)",
            f"{'method':24s} {'final %':>8s} {'t->target s':>12s} {'ms/step':>8s} {'kB/step':>9s}"]
    for name, r in m.items():
        t = r["time_to_target_s"]
        rows.append(f"{name:24s} {r['final_accuracy']:8.2f} {('%.1f' % t) if t is not None else 'never':>12s} "
                    f"{r['step_seconds_median'] * 1e3:8.0f} {r['bytes_per_step'] / 1e3:9.0f}")
    for dosa, q in result.get("ratios", {}).items():
        rows.append(f"{dosa}: accuracy vs dense {q['accuracy_gap_vs_dense']:+.2f} points; time to target / dense "
                    f"{q['ttt_over_dense']}, / sparse allgather {q['ttt_over_sparse_allgather']}, / powersgd "
                    f"{q['ttt_over_powersgd']}")
    ov = result.get("overlap")
    if ov:
        rows.append(f"hook blocks backward {ov['hook_block_s_per_step_overlap'] * 1e3:.1f} ms/step with overlap, "
                    f"{ov['hook_block_s_per_step_blocking'] * 1e3:.1f} ms without: ratio {ov['ratio']}")
    if result.get("dense_comm_fraction") is not None:
        rows.append(f"dense allreduce on the link alone: {result['dense_comm_fraction']:.2f} of a dense step")
    return "\n".join(rows)


def run_cli(args) -> int:
    result = run(args)
    print(format_table(result))
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))
        except OSError as e:
            raise DosaError(f"cannot write {args.json}: {e.strerror}") from None
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0

