"""``dosa plan --validate``: the model against the testbed (root).

For each link rate, ``dosa bench allreduce`` runs as a command (``--testbed``, both host counts in
one invocation, the XDP path; once in sum mode with the ring and the DGC-style allgather beside it,
once in gtopk mode), ``--repeat`` times, the link rates alternated; the measured round of each
method is the median of the invocations' medians. The model predicts the same rounds from the host
costs measured here, the DPU's costs, and the testbed's own path (benchmarks.plan.testbed_path):
every host on the testbed's host cores (its cpu split), one DPU core, the DPU's link not shaped, the
workload's measured top-k overlap. The model is kept only while every prediction is within
``TOLERANCE`` of its measurement. The host's costs are measured again before every bench run and
their median taken, so that they see the machine's load the bench saw (on a shared machine a
measurement an hour apart moves by 20 % and more, docs/performance.md *Noise*).

What is compared with what: ``dosa_sum`` and ``dosa_gtopk`` with ``dosa_xdp`` and
``dosa_xdp_gtopk`` end to end (dense gradient in, error feedback, dense sum out);
``ring_allreduce`` with ``gloo_dense``; ``sparse_allgather`` with ``dgc_allgather`` end to end
(the same encoder pass as dosa's, then Gloo's allgather and the local sum).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dosa.errors import DosaError
from dosa.progress import progress

from benchmarks.plan.model import Cluster, Workload, predict

TOLERANCE = 0.25
#: model method -> (mode of the bench run, the bench's method, which of its medians)
MEASURED_AS = {
    "dosa_sum": ("sum", "dosa_xdp", "end_to_end"),
    "ring_allreduce": ("sum", "gloo_dense", None),
    "sparse_allgather": ("sum", "dgc_allgather", "end_to_end"),
    "dosa_gtopk": ("gtopk", "dosa_xdp_gtopk", "end_to_end"),
}


@dataclass(frozen=True)
class ValidationSetup:
    link_rates: tuple[str, ...] = ("1gbit", "10gbit")
    hosts: tuple[int, ...] = (2, 4)
    numel: int = 10_000_000
    density: float = 0.01
    rounds: int = 5
    repeat: int = 3
    methods: tuple[str, ...] = tuple(MEASURED_AS)


def rate_gbps(rate: str) -> float:
    """``1gbit`` / ``10gbit`` / ``500mbit`` -> Gbit/s."""
    r = rate.strip().lower()
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if r.endswith(unit):
            try:
                return float(r[:-len(unit)]) * scale
            except ValueError:
                break
    raise DosaError(f"a link rate is a number and gbit, mbit or kbit (e.g. 1gbit), not {rate!r}")


def _bench_argv(setup: ValidationSetup, rate: str, mode: str, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "dosa", "bench", "allreduce", "--hosts", ",".join(map(str, setup.hosts)),
            "--dpus", "1", "--numel", str(setup.numel), "--density", str(setup.density), "--rounds",
            str(setup.rounds), "--testbed", "--link-rate", rate, "--paths", "xdp", "--mode", mode,
            "--packet-rate-seconds", "0", "--json", str(out)]
    base = [MEASURED_AS[m][1] for m in setup.methods if MEASURED_AS[m][0] == mode and not MEASURED_AS[m][1].startswith("dosa")]
    return argv + ["--baselines", ",".join(base)]


def _median_of(doc: dict, hosts: int, method: str, which: str | None) -> float | None:
    for run in doc.get("runs", []):
        if run.get("hosts") == hosts:
            rec = run.get("methods", {}).get(method)
            if rec is None:
                return None
            if which:
                rec = rec.get(which) or {}
            v = rec.get("median_s")
            return float(v) if v is not None else None
    return None


def _overlap(doc: dict, hosts: int) -> float | None:
    for run in doc.get("runs", []):
        if run.get("hosts") == hosts:
            return (run.get("overlap") or {}).get("union_over_total")
    return None


def run_benches(setup: ValidationSetup, out_dir: Path, say, before_each=None) -> tuple[dict, list[str]]:
    """Every bench invocation (link rates alternated within each repeat); returns
    ``({(rate, mode): [json doc, ...]}, [a sentence for each invocation that failed])``: a failed
    run is reported and left out (its settings' medians come from the other runs; a setting with no
    run left is a failed check), not a reason to throw the others away.
    ``before_each()`` runs before every invocation (the host costs are measured again there: the
    machine's load moves them as it moves the bench)."""
    modes = sorted({MEASURED_AS[m][0] for m in setup.methods}, key=("sum", "gtopk").index)
    jobs = [(i, rate, mode) for i in range(setup.repeat) for rate in setup.link_rates for mode in modes]
    docs: dict = {}
    failed: list[str] = []
    env = dict(os.environ, DOSA_PROGRESS="off")
    with progress(len(jobs), "dosa plan --validate", unit="bench") as p:
        for i, rate, mode in jobs:
            out = out_dir / f"bench-{rate}-{mode}-{i}.json"
            log = out_dir / f"bench-{rate}-{mode}-{i}.log"
            if before_each is not None:
                before_each()
            p.note(f"dosa bench allreduce --link-rate {rate} --mode {mode} (hosts {setup.hosts}), run {i + 1}/{setup.repeat}")
            with open(log, "w") as f:
                r = subprocess.run(_bench_argv(setup, rate, mode, out), stdout=f, stderr=subprocess.STDOUT,
                                   env=env)
            if r.returncode != 0 or not out.exists():
                last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("dosa:")]
                failed.append(f"dosa bench allreduce --link-rate {rate} --mode {mode} (run {i + 1}) failed "
                              f"(exit status {r.returncode}): {last[-1] if last else 'see'} {log}")
                p.note(failed[-1])
            else:
                docs.setdefault((rate, mode), []).append(json.loads(out.read_text()))
            p.update(1)
    return docs, failed


def compare(setup: ValidationSetup, docs: dict, costs_for_rate, shared_host_cores: int) -> list[dict]:
    """The checks: each (link rate, host count, method)'s prediction against the median of its
    measurements. ``costs_for_rate(rate)``: the Costs over the testbed's path at that rate."""
    checks = []
    for rate in setup.link_rates:
        costs = costs_for_rate(rate)
        for hosts in setup.hosts:
            for method in setup.methods:
                mode, bench_name, which = MEASURED_AS[method]
                runs = docs.get((rate, mode), [])
                vals = [v for v in (_median_of(d, hosts, bench_name, which) for d in runs) if v is not None]
                overlaps = [v for v in (_overlap(d, hosts) for d in runs) if v is not None]
                cluster = Cluster(nodes=hosts, link_gbps=rate_gbps(rate), dpu_cores=1, dpus=1,
                                  dpu_link_gbps=math.inf, shared_host_cores=shared_host_cores)
                wl = Workload("validation", setup.numel, setup.density,
                              union_fraction=statistics.median(overlaps) if overlaps else None)
                pred = predict(method, cluster, wl, costs)
                measured = statistics.median(vals) if vals else None
                ratio = pred.round_s / measured if measured else None
                checks.append({"link": rate, "hosts": hosts, "method": method,
                               "predicted_s": pred.round_s, "measured_s": measured,
                               "measured_as": f"{bench_name}" + (f" {which}" if which else ""),
                               "measurements_s": vals, "ratio": ratio, "bound": pred.bound,
                               "ok": ratio is not None and abs(ratio - 1) <= TOLERANCE,
                               "parts": pred.parts})
    return checks


def format_checks(checks: list[dict]) -> str:
    lines = [f"{'link':8} {'hosts':>5}  {'method':17} {'predicted':>10} {'measured':>10} {'pred/meas':>9}  bound      within ±{TOLERANCE:.0%}"]
    for c in checks:
        meas = f"{c['measured_s'] * 1e3:8.1f}ms" if c["measured_s"] else "      n/a "
        ratio = f"{c['ratio']:9.2f}" if c["ratio"] else "      n/a"
        lines.append(f"{c['link']:8} {c['hosts']:5d}  {c['method']:17} {c['predicted_s'] * 1e3:8.1f}ms "
                     f"{meas} {ratio}  {c['bound']:10} {'yes' if c['ok'] else 'NO'}")
    kept = all(c["ok"] for c in checks)
    lines.append(f"model {'kept' if kept else 'NOT kept'}: {sum(c['ok'] for c in checks)}/{len(checks)} "
                 f"predictions within ±{TOLERANCE:.0%} of the testbed")
    return "\n".join(lines)
