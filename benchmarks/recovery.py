"""``dosa bench recovery``: how fast dosa recovers from loss, duplication, reordering and a dead host.

One testbed per scenario (4 hosts, 1 DPU in XDP mode by default), built and torn down by this run:
``clean`` is the baseline every other scenario is divided by, then the impaired links (the testbed's
tc BPF program: per-direction loss / dup / reorder). Each rank runs ``--rounds`` allreduce rounds of
``--numel`` entries at ``--density`` through ``AggregationClient.allreduce_sparse`` and checks every
sum exactly against the sum it computes itself from every worker's (seeded) input: a recovery that
changed a sum is reported as a mismatch, not a time. The figure is the median round time (and the
90th percentile) of each scenario and its ratio to ``clean`` measured in the same run; CPU time per
round (the rank's thread, user + sys) too.

``kill``: on a clean testbed, after a few rounds one rank's dosa process is SIGKILLed (by its own
parent, so the testbed's runner sees the rank exit 0 and lets the others run); the others start the
next round and report how long after the kill their error named the dead worker, and whether it did.

Run a rank by hand: ``python -m benchmarks.recovery --rank --out F [...]`` under ``dosa testbed run``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dosa.job import DPU_MODES

from benchmarks.ranks import read_rank_results

SCENARIOS = {
    "clean": {},
    "loss5_dup1_reorder5": {"loss": "5", "dup": "1", "reorder": "5"},
    "loss1": {"loss": "1"},
}


# ---------------------------------------------------------------------------- one rank
def _inputs(numel: int, nnz: int, workers: int, seed: int, rnd: int, w: int):
    from host_lib.quantize import clip_bound

    rng = np.random.default_rng([seed, rnd, w])
    idx = np.sort(rng.choice(numel, nnz, replace=False)).astype(np.uint32)
    q = rng.integers(-clip_bound(workers), clip_bound(workers) + 1, nnz).astype(np.int32)
    return idx, q


def _expected(numel, nnz, workers, seed, rnd):
    total = np.zeros(numel, np.int64)
    for w in range(workers):
        idx, q = _inputs(numel, nnz, workers, seed, rnd, w)
        np.add.at(total, idx.astype(np.int64), q.astype(np.int64))
    nz = np.flatnonzero(total)
    return nz, total[nz]


def _rank(a) -> dict:
    """The rank's side: join, run the rounds, check them; in ``--kill-at`` mode rank ``--victim``
    runs the rounds in a child process that its parent SIGKILLs before round ``--kill-at``."""
    from dosa.errors import DosaError
    from host_lib.client import AggregationClient, MissingWorkersError

    rank = int(os.environ["RANK"])
    workers = int(os.environ["WORLD_SIZE"])
    nnz = max(1, int(round(a.numel * a.density)))
    res = {"rank": rank, "round_s": [], "cpu_s": [], "ok": 0, "mismatches": 0}
    if a.kill_at >= 0 and rank == a.victim and not a.child:
        return _victim_parent(a, res)
    try:
        with AggregationClient.from_env(numel=a.numel, timeout=a.timeout) as c:
            for r in range(a.rounds):
                if a.child and r == a.kill_at:
                    print("READY", flush=True)  # the parent kills this process now
                    time.sleep(60)
                idx, q = _inputs(a.numel, nnz, workers, a.seed, r, rank)
                if r == a.kill_at:
                    res["round_started"] = time.monotonic()
                t0, c0 = time.perf_counter(), time.thread_time()
                gi, gs = c.allreduce_sparse(idx, q, c.job.scale_exp)
                res["round_s"].append(time.perf_counter() - t0)
                res["cpu_s"].append(time.thread_time() - c0)
                ei, es = _expected(a.numel, nnz, workers, a.seed, r)
                if np.array_equal(gi.astype(np.int64), ei) and np.array_equal(gs.astype(np.int64), es):
                    res["ok"] += 1
                else:
                    res["mismatches"] += 1
            res["stats"] = c.stats
            rtt = getattr(c, "rtt", None)  # (a client before host_lib/rto.py has none)
            if rtt is not None:
                res["rto_ms"] = 1e3 * rtt.rto
                res["srtt_ms"] = None if rtt.srtt is None else 1e3 * rtt.srtt
    except MissingWorkersError as e:
        res.update(error=str(e), missing=e.missing, error_at=time.monotonic())
    except DosaError as e:
        res.update(error=str(e), missing=None, error_at=time.monotonic())
    return res


def _victim_parent(a, res: dict) -> dict:
    argv = [sys.executable, "-m", "benchmarks.recovery", "--rank", "--child", "--out", a.out + ".child",
            *_pass_args(a)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    res["killed_at"] = time.monotonic()
    p.send_signal(signal.SIGKILL)
    p.wait()
    res["victim"] = True
    res["child_ready"] = line.strip() == "READY"
    return res


def _pass_args(a) -> list[str]:
    return ["--numel", str(a.numel), "--density", str(a.density), "--rounds", str(a.rounds),
            "--seed", str(a.seed), "--timeout", str(a.timeout), "--kill-at", str(a.kill_at),
            "--victim", str(a.victim)]


def rank_main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", action="store_true", required=True)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--numel", type=int, default=200_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--victim", type=int, default=-1)
    a = ap.parse_args(argv)
    res = _rank(a)
    Path(a.out.replace("RANK", os.environ.get("RANK", "x"))).write_text(json.dumps(res))
    return 0


# ---------------------------------------------------------------------------- the driver
def _scenario(name: str, shaping: dict, hosts: int, numel: int, density: float, rounds: int,
              timeout: float, kill_at: int = -1, mode: str = "xdp") -> dict:
    from testbed.testing import scratch_testbed

    with tempfile.TemporaryDirectory(prefix="dosa-recovery-") as tmp, \
            scratch_testbed(hosts=hosts, dpus=1, mode=mode, **shaping) as tb:
        out = f"{tmp}/rankRANK.json"
        argv = [sys.executable, "-m", "benchmarks.recovery", "--rank", "--out", out,
                "--numel", str(numel), "--density", str(density), "--rounds", str(rounds),
                "--timeout", str(timeout), "--kill-at", str(kill_at), "--victim", str(hosts - 1)]
        run = tb.run(argv, timeout=rounds * 10 + 60, echo=False, log_dir=f"{tmp}/logs")
        ranks = read_rank_results(tmp, hosts)  # out's RANK is each rank's number
        if len(ranks) != hosts:
            err = "; ".join(Path(f"{tmp}/logs/rank{r}.err").read_text()[-300:] for r in range(hosts)
                            if Path(f"{tmp}/logs/rank{r}.err").exists())
            raise RuntimeError(f"scenario {name}: {run.summary()}: {err}")
    return _summarise(name, shaping, ranks, kill_at)


def _summarise(name, shaping, ranks, kill_at) -> dict:
    live = [r for r in ranks if not r.get("victim")]
    # a round's time is the slowest host's: the round is done when every host has its sum
    per_round = [max(r["round_s"][i] for r in live) for i in range(min(len(r["round_s"]) for r in live))]
    cpu = [statistics.median(r["cpu_s"]) for r in live if r["cpu_s"]]
    out = {"scenario": name, "shaping": shaping, "rounds": len(per_round),
           "rounds_exact": min(r["ok"] for r in live), "mismatches": sum(r["mismatches"] for r in live),
           "errors": [r["error"] for r in live if r.get("error")] if kill_at < 0 else [],
           "retransmissions": sum(r.get("stats", {}).get("retransmissions", 0) for r in live),
           "rto_ms": [round(r["rto_ms"], 2) for r in live if r.get("rto_ms")],
           "srtt_ms": [round(r["srtt_ms"], 2) for r in live if r.get("srtt_ms")]}
    if per_round:
        warm = per_round[1:] if len(per_round) > 2 else per_round  # round 0 includes warm-up
        out.update(median_ms=1e3 * statistics.median(warm),
                   p90_ms=1e3 * float(np.percentile(warm, 90)),
                   cpu_ms_per_round=1e3 * statistics.median(cpu) if cpu else None)
    if kill_at >= 0:
        victim = next(r for r in ranks if r.get("victim"))
        named = [r for r in live if r.get("missing") and victim["rank"] in r["missing"]]
        out.update(victim=victim["rank"],
                   detect_s=[round(r["error_at"] - victim["killed_at"], 3) for r in live if "error_at" in r],
                   named_by=len(named), hosts_left=len(live),
                   errors=[r.get("error") for r in live])
    return out


def run(hosts: int = 4, numel: int = 200_000, density: float = 0.01, rounds: int = 30,
        scenarios=None, kill: bool = True, timeout: float = 10.0, mode: str = "xdp") -> dict:
    from dosa.progress import progress

    names = list(scenarios or SCENARIOS)
    res = {"hosts": hosts, "numel": numel, "density": density, "mode": mode, "scenarios": []}
    bar = progress(len(names) + bool(kill), "dosa bench recovery", unit="scenario", every=0)
    for n in names:
        bar.note(f"scenario {n} ...")
        res["scenarios"].append(_scenario(n, SCENARIOS[n], hosts, numel, density, rounds, timeout,
                                          mode=mode))
        bar.update(1, status=n)
    base = next((s for s in res["scenarios"] if s["scenario"] == "clean"), None)
    for s in res["scenarios"]:
        if base and s.get("median_ms") and base.get("median_ms"):
            s["ratio_to_clean"] = s["median_ms"] / base["median_ms"]
    if kill:
        bar.note("scenario kill (a host killed mid-run) ...")
        res["kill"] = _scenario("kill", {}, hosts, numel, density, 4, timeout, kill_at=3, mode=mode)
        bar.update(1, status="kill")
    bar.close()
    return res


def add_arguments(p) -> None:
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--numel", type=int, default=200_000, help="entries per round (default 200k)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, of {', '.join(SCENARIOS)} (clean is the baseline)")
    p.add_argument("--no-kill", action="store_true", help="skip the killed-host scenario")
    p.add_argument("--mode", choices=DPU_MODES, default="xdp", help="DPU dataplane")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def run_cli(args) -> int:
    from dosa.errors import DosaError

    names = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        raise DosaError(f"unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    if not 2 <= args.hosts <= 64 or args.rounds < 2 or not 0 < args.density <= 1:
        raise DosaError("--hosts must be 2..64, --rounds at least 2 and --density in (0, 1]")
    r = run(args.hosts, args.numel, args.density, args.rounds, names, kill=not args.no_kill,
            mode=args.mode)
    print(format_table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
        print(f"wrote {args.json}")
    bad_runs = [s["scenario"] for s in r["scenarios"] if s["mismatches"] or s["errors"]]
    if bad_runs:
        raise DosaError(f"scenario(s) {bad_runs} had wrong sums or errors (see the table)")
    return 0


def format_table(r: dict) -> str:
    lines = [f"recovery: {r['hosts']} hosts, {r['numel']} entries at density {r['density']:g}, "
             f"DPU mode {r['mode']}",
             f"{'scenario':24} {'median ms':>10} {'p90 ms':>8} {'x clean':>8} {'cpu ms':>7} "
             f"{'exact':>7} {'retx':>6}"]
    for s in r["scenarios"]:
        lines.append(f"{s['scenario']:24} {s.get('median_ms', float('nan')):10.2f} "
                     f"{s.get('p90_ms', float('nan')):8.2f} {s.get('ratio_to_clean', float('nan')):8.2f} "
                     f"{(s.get('cpu_ms_per_round') or float('nan')):7.2f} "
                     f"{s['rounds_exact']:>3}/{s['rounds']:<3} {s['retransmissions']:6d}"
                     + (f"  MISMATCHES {s['mismatches']}" if s["mismatches"] else "")
                     + (f"  ERRORS {s['errors'][:1]}" if s["errors"] else ""))
    k = r.get("kill")
    if k:
        lines.append(f"killed host {k['victim']}: named by {k['named_by']}/{k['hosts_left']} hosts "
                     f"after {k['detect_s']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(rank_main())
