"""``dosa bench host``: the host's per-round CPU costs, each next to its baseline in the same run.

Measures, on one synthetic gradient (layers of different scales, heavy tails, a dead layer):
exact top-k (``np.argpartition``, the baseline), fast top-k (sampled threshold + one Cython pass),
the fused encoder step (``r += g``, select, quantize), quantize, packetize and parse of the selected
entries. Reports medians over ``repeat`` runs and the targets: fast >= 10x faster than exact,
packetize + parse < 10 ms.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from dosa import wire
from dosa.progress import track
from host_lib.compress import topk_exact, topk_fast, target_k
from host_lib.encoder import RoundEncoder
from dosa.packetizer import packetize, parse_batch
from host_lib.quantize import choose_scale_exp, quantize


def synthetic_gradient(n: int, seed: int = 0) -> np.ndarray:
    """A gradient that looks real enough for selection: 16 layers with scales 1e-5..1e-1, Student-t
    (nu=2.5) or Gaussian-with-5%-outliers entries, one layer of exact zeros."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(n, rng.dirichlet(np.ones(16)))
    out = np.empty(n, np.float32)
    pos = 0
    for i, m in enumerate(sizes):
        scale = 10.0 ** rng.uniform(-5, -1)
        if i == 3:
            out[pos:pos + m] = 0
        elif i % 2:
            out[pos:pos + m] = rng.standard_t(2.5, m) * scale
        else:
            out[pos:pos + m] = rng.standard_normal(m) * np.where(rng.random(m) < 0.05, 20, 1) * scale
        pos += m
    return out


_CPU_MS: dict[str, float] = {}


def _median_ms(fn, repeat: int, label: str):
    """Median wall-clock ms of ``fn`` (returned) and median CPU ms (kept in _CPU_MS[label]): on a
    shared machine CPU time is the steadier of the two, so both are reported."""
    times, cpu, result = [], [], None
    for i in track(range(repeat), f"  {label}", unit="run"):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    _CPU_MS[label] = float(np.median(cpu))
    return float(np.median(times)), result


def run(numel: int, density: float, *, workers: int = 4, num_dpus: int = 2, repeat: int = 5,
        exact_repeat: int = 3, seed: int = 0) -> dict:
    print(f"dosa bench host: generating a {numel}-entry gradient", file=sys.stderr, flush=True)
    _CPU_MS.clear()
    g = synthetic_gradient(numel, seed)
    k = target_k(numel, density)
    rng = np.random.default_rng(seed + 1)
    exact_ms, exact_idx = _median_ms(lambda: topk_exact(g, k), exact_repeat, "exact top-k (argpartition)")
    fast_ms, (idx, vals) = _median_ms(lambda: topk_fast(g, k, rng=rng), repeat, "fast top-k")
    s = choose_scale_exp(float(np.abs(vals).max()) if len(vals) else 0.0, workers)
    quantize_ms, (q, _) = _median_ms(lambda: quantize(vals, s, workers), repeat, "quantize")
    pmap = wire.PartitionMap(max(numel, 1), num_dpus=num_dpus,
                             partition_size=max(wire.DEFAULT_PARTITION_SIZE,
                                                -(-max(numel, 1) // (wire.MAX_PARTITIONS - 1))))
    packetize_ms, batch = _median_ms(
        lambda: packetize(idx, q, pmap, job_id=1, worker_id=0, round=0, scale_exp=s), repeat, "packetize")
    parse_ms, parsed = _median_ms(lambda: parse_batch(batch), repeat, "parse")
    if not (np.array_equal(parsed.indices, idx) and np.array_equal(parsed.values, q)):
        raise RuntimeError("parse(packetize(x)) != x: the benchmark's round trip is broken")
    enc = RoundEncoder(numel, density, workers, method="fast", seed=seed)
    encode_ms, _ = _median_ms(lambda: enc.encode(g, s), repeat, "encode (r += g, fast select, quantize)")
    # accuracy of the fast selection: overlap with the exact top-k by magnitude mass
    exact_mass = float(np.abs(g[exact_idx]).astype(np.float64).sum()) if k else 0.0
    fast_mass = float(np.abs(vals).astype(np.float64).sum())
    ratio = exact_ms / fast_ms if fast_ms > 0 else float("inf")
    cpu = dict(zip(["exact_ms", "fast_ms", "quantize_ms", "packetize_ms", "parse_ms", "encode_ms"],
                   _CPU_MS.values()))
    cpu_ratio = cpu["exact_ms"] / cpu["fast_ms"] if cpu["fast_ms"] > 0 else float("inf")
    return {
        "numel": numel, "density": density, "k": k, "workers": workers,
        "exact_ms": exact_ms, "fast_ms": fast_ms, "ratio_exact_over_fast": ratio,
        "fast_selected": int(len(idx)), "fast_selected_over_k": len(idx) / k if k else None,
        "fast_mass_over_exact_mass": fast_mass / exact_mass if exact_mass else None,
        "fast_recall_of_exact_topk": float(np.isin(exact_idx, idx, assume_unique=True).mean()) if k else None,
        "quantize_ms": quantize_ms, "scale_exp": s,
        "packets": len(batch), "packetize_ms": packetize_ms, "parse_ms": parse_ms,
        "packetize_plus_parse_ms": packetize_ms + parse_ms, "encode_ms": encode_ms,
        "repeat": repeat, "exact_repeat": exact_repeat,
        "cpu": cpu, "ratio_exact_over_fast_cpu": cpu_ratio,
        "targets": {
            "fast_at_least_10x_faster_than_exact": ratio >= 10.0,
            "fast_at_least_10x_faster_than_exact_cpu_time": cpu_ratio >= 10.0,
            "fast_selected_within_20pct_of_k": bool(k == 0 or 0.8 * k <= len(idx) <= 1.2 * k),
            "packetize_plus_parse_under_10ms": packetize_ms + parse_ms < 10.0,
        },
    }


def format_table(r: dict) -> str:
    rows = [
        ("exact top-k (np.argpartition)", "exact_ms", f"k={r['k']}"),
        ("fast top-k (sample + 1 pass)", "fast_ms",
         f"selected={r['fast_selected']} ({(r['fast_selected_over_k'] or 0):.3f} k)"),
        ("quantize", "quantize_ms", f"scale_exp={r['scale_exp']}"),
        ("packetize", "packetize_ms", f"{r['packets']} packets"),
        ("parse", "parse_ms", ""),
        ("encode (fused r+=g, select, quantize)", "encode_ms", ""),
    ]
    lines = [f"numel={r['numel']} density={r['density']} (median ms: wall / cpu)"]
    lines += [f"  {name:<40} {r[key]:9.2f} / {r['cpu'][key]:8.2f}  {note}" for name, key, note in rows]
    lines.append(f"  ratio exact/fast: {r['ratio_exact_over_fast']:.1f}x wall, "
                 f"{r['ratio_exact_over_fast_cpu']:.1f}x cpu   "
                 f"packetize+parse: {r['packetize_plus_parse_ms']:.2f} ms")
    lines += [f"  target {name}: {'met' if ok else 'NOT met'}" for name, ok in r["targets"].items()]
    return "\n".join(lines)


def write_json(r: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=2)
        f.write("\n")
