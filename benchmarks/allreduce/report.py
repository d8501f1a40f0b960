"""Results of ``dosa bench allreduce`` for machines (JSON), people (a table of ratios) and both (PNG).

Every method's record is ``{"transport": stats, "end_to_end": stats | absent, "median_s", ...}`` with
stats = ``{"median_s", "min_s", "max_s", "rounds_s"}``; a record that has only a top-level
``median_s`` (such as ``limit``) is read as its transport time. Ratios are method / ``dosa_xdp``:
above 1 means slower than dosa_xdp. The whole document::

    {"schema": "dosa-bench-allreduce/1", "config": {...}, "machine": {...},
     "runs": [{"hosts": W, "overlap": {...}, "methods": {name: record}}, ...],
     "methods": <the methods of the last run>}
"""
from __future__ import annotations

import json
import math
from pathlib import Path

SCHEMA = "dosa-bench-allreduce/1"
REFERENCE = "dosa_xdp"
PHASES = ("transport", "end_to_end")
#: Order of methods in tables and plots; others follow alphabetically.
ORDER = ("dosa_xdp", "dosa_xdp_gtopk", "dosa_userspace", "gloo_dense", "gloo_sparse_allgather", "dgc_allgather", "limit")


def stat(rec: dict, phase: str = "transport", key: str = "median_s") -> float | None:
    """``rec[phase][key]``, falling back to ``rec[key]`` for the transport phase; None if absent."""
    sub = rec.get(phase)
    if isinstance(sub, dict) and sub.get(key) is not None:
        return float(sub[key])
    if phase == "transport" and rec.get(key) is not None:
        return float(rec[key])
    return None


def ordered(methods: dict) -> list[str]:
    known = [m for m in ORDER if m in methods]
    return known + sorted(m for m in methods if m not in ORDER)


def add_ratios(methods: dict, reference: str = REFERENCE) -> None:
    """Write ``ratio_to_<reference>`` = {phase: method median / reference median} into every record."""
    ref = methods.get(reference)
    if not ref:
        return
    for rec in methods.values():
        r = {}
        for ph in PHASES:
            a, b = stat(rec, ph), stat(ref, ph)
            if a is not None and b:
                r[ph] = a / b
        rec[f"ratio_to_{reference}"] = r


def document(config: dict, runs: list[dict], machine: dict | None = None) -> dict:
    for run in runs:
        add_ratios(run["methods"])
    return {"schema": SCHEMA, "config": config, "machine": machine or {}, "runs": runs,
            "methods": runs[-1]["methods"] if runs else {}}


def validate(doc: dict) -> None:
    """Raise ValueError unless ``doc`` has the shape above (what the tests and readers rely on)."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r}")
    for key in ("config", "runs", "methods"):
        if key not in doc:
            raise ValueError(f"missing key {key!r}")
    if not isinstance(doc["runs"], list) or not doc["runs"]:
        raise ValueError("runs must be a non-empty list")
    for run in doc["runs"]:
        if not isinstance(run.get("hosts"), int) or not isinstance(run.get("methods"), dict):
            raise ValueError("every run needs an integer 'hosts' and a 'methods' object")
        for name, rec in run["methods"].items():
            t = stat(rec, "transport")
            if t is None or not math.isfinite(t) or t < 0:
                raise ValueError(f"method {name!r} at {run['hosts']} hosts has no valid transport median_s")
            for ph in PHASES:
                sub = rec.get(ph)
                if isinstance(sub, dict) and not (sub["min_s"] <= sub["median_s"] <= sub["max_s"]):
                    raise ValueError(f"method {name!r} {ph}: min <= median <= max does not hold")


def write_json(doc: dict, path) -> Path:
    p = Path(path)
    p.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    return p


def _jsonable(o):
    try:
        import numpy as np

        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def _fmt_b(x) -> str:
    if x is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= f:
            return f"{x / f:.2f} {unit}"
    return f"{x} B"


def _check_str(rec: dict) -> str:
    cs = [rec[k] for k in ("check", "check_end_to_end") if isinstance(rec.get(k), dict)]
    if not cs:
        return "-"
    return "ok" if all(c.get("ok") for c in cs) else "WRONG"


def _cpu(rec: dict, key: str) -> str:
    """Mean over ranks of a per-rank CPU list (seconds per round), in ms; '-' if absent."""
    v = rec.get(key)
    if not isinstance(v, list) or not v:
        return "-"
    return f"{sum(v) / len(v) * 1e3:.1f} ms"


def table(doc: dict) -> str:
    """A plain-text table per host count: times, ratios to dosa_xdp, bytes per host, check."""
    lines = []
    for run in doc["runs"]:
        ms = run["methods"]
        ov = run.get("overlap") or {}
        head = f"{run['hosts']} hosts"
        if ov:
            head += (f"; top-k overlap: mean pairwise Jaccard {ov['mean_pairwise_jaccard']:.3f}, "
                     f"union/(W*k) {ov['union_over_total']:.3f}")
        lines.append(head)
        cols = ["method", "transport median", "[min, max]", "x dosa_xdp", "end-to-end median",
                "x dosa_xdp", "host CPU/round", "e2e host CPU", "DPU CPU/round", "sent/host",
                "recv/host", "check"]
        rows = []
        for name in ordered(ms):
            rec = ms[name]
            ratio = rec.get(f"ratio_to_{REFERENCE}", {})
            bph = rec.get("bytes_per_host") or {}
            rows.append([
                name, _fmt_s(stat(rec, "transport")),
                f"[{_fmt_s(stat(rec, 'transport', 'min_s'))}, {_fmt_s(stat(rec, 'transport', 'max_s'))}]",
                f"{ratio['transport']:.2f}" if "transport" in ratio else "-",
                _fmt_s(stat(rec, "end_to_end")),
                f"{ratio['end_to_end']:.2f}" if "end_to_end" in ratio else "-",
                _cpu(rec, "host_cpu_s_per_round"), _cpu(rec, "host_cpu_s_per_round_end_to_end"),
                _cpu(rec, "dpu_cpu_s_per_round"), _fmt_b(bph.get("sent")), _fmt_b(bph.get("received")), _check_str(rec)])
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        for name in ordered(ms):
            ph = ms[name].get("phases_cpu_s_per_round")
            if isinstance(ph, dict) and ph:
                lines.append(f"{name} host CPU per round by phase (mean over ranks): " + ", ".join(
                    f"{k} {v * 1e3:.1f} ms" for k, v in ph.items()))
        lim = ms.get("limit")
        if isinstance(lim, dict) and "link_s" in lim:
            pps = lim.get("packet_rate_pps")
            lines.append(
                f"limit = max(link {_fmt_s(lim['link_s'])} on {lim.get('busiest_link') or 'no shaped link'}, "
                f"packets {_fmt_s(lim['packets_s'])}: {lim['busiest_sender']} sends "
                f"{lim['busiest_sender_packets']} at " + (f"{pps:.0f} packets/s measured)" if pps else "an unmeasured rate)"))
        lines.append("")
    if len(doc["runs"]) > 1:
        names = ordered({m: 1 for run in doc["runs"] for m in run["methods"]})
        lines.append("transport median against hosts:")
        lines.append("hosts  " + "  ".join(f"{n:>22}" for n in names))
        for run in doc["runs"]:
            lines.append(f"{run['hosts']:>5}  " + "  ".join(
                f"{_fmt_s(stat(run['methods'][n], 'transport')) if n in run['methods'] else '-':>22}"
                for n in names))
        lines.append("")
    return "\n".join(lines)


def plot(doc: dict, path) -> Path:
    """PNG: time per method (median bars, min-max whiskers, transport and end to end) for the last
    run; with several host counts a second panel of transport median against hosts (log-log)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    multi = len(runs) > 1
    fig, axes = plt.subplots(1, 2 if multi else 1, figsize=(13 if multi else 8, 5), squeeze=False)
    ax = axes[0][0]
    run = runs[-1]
    names = ordered(run["methods"])
    width = 0.38
    for j, ph in enumerate(PHASES):
        xs, ys, lo, hi = [], [], [], []
        for i, n in enumerate(names):
            rec = run["methods"][n]
            m = stat(rec, ph)
            if m is None:
                continue
            xs.append(i + (j - 0.5) * width)
            ys.append(m)
            lo.append(m - (stat(rec, ph, "min_s") or m))
            hi.append((stat(rec, ph, "max_s") or m) - m)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=ph.replace("_", " "))
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("seconds per allreduce (median, min-max)")
    cfg = doc.get("config", {})
    ax.set_title(f"{run['hosts']} hosts, {cfg.get('numel', '?')} floats, density {cfg.get('density', '?')}, "
                 f"link {cfg.get('link_rate') or 'unshaped'}", fontsize=10)
    ax.legend()
    ax.grid(axis="y", which="both", alpha=0.3)
    if multi:
        ax2 = axes[0][1]
        for n in ordered({m: 1 for r in runs for m in r["methods"]}):
            pts = [(r["hosts"], stat(r["methods"][n], "transport")) for r in runs if n in r["methods"]]
            pts = [(h, t) for h, t in pts if t]
            if pts:
                ax2.plot(*zip(*pts), marker="o", label=n)
        ax2.set_xscale("log", base=2)
        hs = sorted({r["hosts"] for r in runs})
        ax2.set_xticks(hs)
        ax2.set_xticklabels([str(h) for h in hs])
        ax2.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax2.set_yscale("log")
        ax2.set_xlabel("hosts")
        ax2.set_ylabel("transport median (s)")
        ax2.set_title("time against hosts", fontsize=10)
        ax2.grid(which="both", alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
