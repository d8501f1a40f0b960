"""``dosa bench bigjob``: one job far larger than the DPU's aggregation pool, on a testbed with the
default DPU memory, every round checked against the exact sum.

The DPU's memory for a job is its aggregation slots (docs/dataplane.md, *Slots*): ``slots x 2``
buffers of 288 KiB, whatever numel. This brings up a testbed (``testbed.Testbed``, XDP mode,
default ``dosa ctl serve`` pool of 512 buffers = 144 MiB), runs ``--rounds`` allreduce rounds of
a ``--numel`` job (default 110M entries, BERT-base) through the control plane's join, and on every
host compares every round's result with the exact int64 sum of what every host sent (each host
derives every host's entries from (seed, round, rank)). While the hosts run, the dataplane's job
entry is read from its pinned maps: the memory the job holds is printed next to the pool's
capacity and next to what one buffer pair per partition (the layout before slots) would need.

In the same run a small job (``--small-numel``, default 2M entries, which the old layout also
fitted) runs on the same testbed, so the time per million entries of the big job can be read as a
ratio against it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from dataplane.layout import BUF_DTYPE
from dosa.errors import DosaError
from dosa.progress import progress

from benchmarks.ranks import read_rank_results

JOB_SEED = 11


def _inputs(numel: int, nnz: int, workers: int, seed: int, rnd: int, w: int):
    """Sorted unique u32 indices and int32 values of worker ``w`` in round ``rnd``."""
    from host_lib.quantize import clip_bound

    rng = np.random.default_rng([seed, rnd, w])
    idx = np.unique(rng.integers(0, numel, nnz, dtype=np.int64)).astype(np.uint32)
    lim = clip_bound(workers)
    return idx, rng.integers(-lim, lim + 1, len(idx)).astype(np.int32)


def _exact(parts) -> tuple[np.ndarray, np.ndarray]:
    """(sorted indices, int64 sums) of the non-zero sums of [(idx, q)]: the reference."""
    idx = np.concatenate([p[0] for p in parts]).astype(np.int64)
    q = np.concatenate([p[1] for p in parts]).astype(np.int64)
    u, inv = np.unique(idx, return_inverse=True)
    s = np.bincount(inv, weights=q, minlength=len(u))  # float64: exact below 2^53
    s = np.rint(s).astype(np.int64)
    nz = s != 0
    return u[nz], s[nz]


def host_main(argv=None) -> int:
    """One rank (run by the testbed in a host namespace)."""
    ap = argparse.ArgumentParser(prog="benchmarks.bigjob --host")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--density", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from host_lib.client import AggregationClient

    rank, workers = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    nnz = max(1, int(a.numel * a.density))
    rec = {"rank": rank, "round_s": [], "cpu_s": [], "exact": [], "result_entries": [],
           "entries_sent": []}
    try:
        with AggregationClient.from_env(a.numel, join={"slots": a.slots}, timeout=60.0) as c:
            rec["slots"] = c.job.slots
            rec["num_partitions"] = c.job.pmap.num_partitions
            rec["partition_size"] = c.job.partition_size
            for r in range(a.rounds):
                mine = None
                parts = []
                for w in range(workers):
                    p = _inputs(a.numel, nnz, workers, JOB_SEED, r, w)
                    parts.append(p)
                    if w == rank:
                        mine = p
                ref_i, ref_s = _exact(parts)
                t0, c0 = time.perf_counter(), time.process_time()
                got_i, got_s = c.allreduce_sparse(mine[0], mine[1], c.job.scale_exp)
                rec["round_s"].append(time.perf_counter() - t0)
                rec["cpu_s"].append(time.process_time() - c0)
                rec["exact"].append(bool(np.array_equal(got_i.astype(np.int64), ref_i)
                                         and np.array_equal(got_s.astype(np.int64), ref_s)))
                rec["result_entries"].append(int(len(got_i)))
                rec["entries_sent"].append(int(len(mine[0])))
            rec["stats"] = c.stats
    except DosaError as e:
        rec["error"] = str(e)
    with open(Path(a.out) / f"rank{rank}.json", "w") as f:
        json.dump(rec, f)
    return 0 if "error" not in rec else 1


class _JobWatch(threading.Thread):
    """Reads the dataplane's job entries from the pinned maps while the hosts run (the control
    plane may release a job when its hosts leave, so it is read during the run, not after)."""

    def __init__(self, pin_dir: str):
        super().__init__(daemon=True)
        self.pin_dir = pin_dir
        self.seen: dict[int, dict] = {}
        self.capacity: dict | None = None
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self):
        from dataplane.maps import DataplaneMaps

        try:
            with DataplaneMaps.open(self.pin_dir) as dp:
                self.capacity = dp.capacity
                while not self.stop.is_set():
                    for j in dp.jobs():
                        self.seen[j.job_id] = {
                            "numel": j.numel, "partition_size": j.partition_size,
                            "num_partitions": j.num_partitions, "num_owned": j.num_owned,
                            "slots": j.slots, "pool_buffers": j.pool_len,
                            "pool_bytes": j.pool_len * BUF_DTYPE.itemsize,
                            "pstate_entries": j.pstate_len, "wstate_entries": j.wstate_len,
                            "state_bytes": j.pstate_len * 56 + j.wstate_len * 48,
                            "per_partition_layout_pool_buffers": j.num_owned * 2}
                    self.stop.wait(0.2)
        except DosaError as e:
            self.error = str(e)


def _run_job(tb, numel: int, args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "benchmarks.bigjob", "--host", "--numel", str(numel),
            "--density", str(args.density), "--rounds", str(args.rounds), "--slots", str(args.slots),
            "--out", str(out)]
    t0 = time.monotonic()
    run = tb.run(argv, timeout=args.timeout, echo=False, log_dir=out / "logs")
    wall = time.monotonic() - t0
    if run.timed_out:
        raise DosaError(f"the {numel}-entry job did not finish in {args.timeout} s (logs in {out / 'logs'})")
    ranks = read_rank_results(out, args.hosts, f"the {numel}-entry job", out / "logs")
    per_round = np.max(np.array([r["round_s"] for r in ranks]), axis=0)
    return {"numel": numel, "wall_s": round(wall, 2),
            "rounds_checked": sum(len(r["exact"]) for r in ranks),
            "rounds_exact": sum(sum(r["exact"]) for r in ranks),
            "round_s": [round(float(x), 4) for x in per_round],
            "median_round_s": float(np.median(per_round)),
            "host_cpu_s_per_round": [round(float(np.median(r["cpu_s"])), 4) for r in ranks],
            "entries_sent_per_host": int(np.median(ranks[0]["entries_sent"])),
            "result_entries": int(np.median(ranks[0]["result_entries"])),
            "retransmissions": [r["stats"]["retransmissions"] for r in ranks],
            "slots": ranks[0]["slots"], "num_partitions": ranks[0]["num_partitions"]}


def _services(pool_buffers: int):
    """The testbed's DPU services with a pool of ``pool_buffers`` (a comparison only: the point
    of this benchmark is the default)."""
    from testbed.services import ServiceSpec, dpu_services

    def fn(ctx):
        return [ServiceSpec(s.name, [*s.argv, "--pool-buffers", str(pool_buffers)], s.ready, s.env)
                if s.name == "ctl" else s for s in dpu_services(ctx)]

    return fn


def run(args) -> dict:
    from testbed.core import Testbed

    if os.geteuid() != 0:
        raise DosaError("dosa bench bigjob needs root (it brings up a testbed)")
    kw = {} if not args.pool_buffers else {"services": _services(args.pool_buffers)}
    tb = Testbed(prefix=f"bj{uuid.uuid4().hex[:5]}", subnet="10.231.98.0/24",
                 state_dir=tempfile.mkdtemp(prefix="dosa-bigjob-state-"), **kw)
    out = Path(tempfile.mkdtemp(prefix="dosa-bigjob-"))
    bar = progress(3 if args.small_numel else 2, "dosa bench bigjob", unit="stage", every=0)
    bar.note("testbed up ...")
    tb.up(args.hosts, 1, mode="xdp")
    bar.update(1, status="testbed up")
    try:
        watch = _JobWatch(str(tb.pin_dir / "d0"))
        watch.start()
        try:
            small = None
            if args.small_numel:
                bar.note(f"job of {args.small_numel:,} entries ...")
                small = _run_job(tb, args.small_numel, args, out / "small")
                bar.update(1, status=f"{args.small_numel:,} entries")
            bar.note(f"job of {args.numel:,} entries ...")
            big = _run_job(tb, args.numel, args, out / "big")
            bar.update(1, status=f"{args.numel:,} entries")
        finally:
            watch.stop.set()
            watch.join(5)
    finally:
        bar.close()
        tb.down()
    if watch.error:
        raise DosaError(f"cannot read the dataplane's job entries: {watch.error}")
    by_numel = {v["numel"]: v for v in watch.seen.values()}
    doc = {"config": {"hosts": args.hosts, "dpus": 1, "numel": args.numel, "density": args.density,
                      "rounds": args.rounds, "slots": args.slots, "small_numel": args.small_numel,
                      "dpu_memory": f"pool of {args.pool_buffers} buffers" if args.pool_buffers
                      else "testbed default (dosa ctl serve --pool-buffers default)"},
           "pool_capacity": watch.capacity, "big": big, "small": small,
           "big_job_in_dataplane": by_numel.get(args.numel),
           "small_job_in_dataplane": by_numel.get(args.small_numel)}
    if small:
        per_m = lambda r: r["median_round_s"] / (r["numel"] / 1e6)  # noqa: E731
        doc["time_per_million_entries_ratio_big_vs_small"] = round(per_m(big) / per_m(small), 3)
    return doc


def format_table(doc: dict) -> str:
    big, dj, cap = doc["big"], doc["big_job_in_dataplane"], doc["pool_capacity"]
    lines = [f"dosa bench bigjob: {big['numel']:,} entries, {doc['config']['hosts']} hosts, 1 DPU "
             f"(XDP), density {doc['config']['density']}, {doc['config']['rounds']} rounds",
             f"  rounds exact            {big['rounds_exact']}/{big['rounds_checked']} (every host, "
             "every round, against the exact int64 sum)",
             f"  median round            {big['median_round_s'] * 1e3:.0f} ms ({big['round_s']})",
             f"  host CPU per round      {big['host_cpu_s_per_round']} s",
             f"  partitions / slots      {big['num_partitions']} partitions through {big['slots']} slots"]
    if cap:
        lines.append(f"  DPU pool                {cap['pool']:,} buffers = "
                     f"{cap['pool'] * BUF_DTYPE.itemsize / 2**20:.0f} MiB")
    if dj:
        per_part = dj["per_partition_layout_pool_buffers"]
        lines += [f"  job's DPU memory        {dj['pool_buffers']:,} pool buffers = "
                  f"{dj['pool_bytes'] / 2**20:.1f} MiB (+ {dj['state_bytes'] / 1024:.1f} KiB slot/worker state)",
                  f"  one pair per partition  {per_part:,} buffers = "
                  f"{per_part * BUF_DTYPE.itemsize / 2**20:.0f} MiB"
                  + (" (would not fit)" if cap and per_part > cap['pool'] else "")]
    s = doc.get("small")
    if s:
        lines.append(f"  small job ({s['numel']:,})    median {s['median_round_s'] * 1e3:.0f} ms, "
                     f"{s['rounds_exact']}/{s['rounds_checked']} exact; time per M entries big/small = "
                     f"{doc['time_per_million_entries_ratio_big_vs_small']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dosa.job import DEFAULT_SLOTS

    p.add_argument("--numel", type=int, default=110_000_000, help="entries of the job (default 110M)")
    p.add_argument("--small-numel", type=int, default=2_000_000,
                   help="entries of the same-run comparison job (default 2M; 0 = none)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="aggregation slots of the job")
    p.add_argument("--pool-buffers", type=int, default=0,
                   help="DPU pool size in buffers of 288 KiB (default 0: the testbed's default; for comparisons)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", metavar="FILE")


def run_cli(args) -> int:
    if not 1 <= args.numel < 2**32 or not 0 <= args.small_numel < 2**32:
        raise DosaError("--numel and --small-numel must fit a u32 index")
    if not 0 < args.density <= 1 or args.rounds < 1 or not 1 <= args.hosts <= 64:
        raise DosaError("--density must lie in (0, 1], --rounds be at least 1, --hosts in 1..64")
    doc = run(args)
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    big = doc["big"]
    return 0 if big["rounds_exact"] == big["rounds_checked"] else 1


if __name__ == "__main__":
    if "--host" in sys.argv[1:]:
        sys.exit(host_main())
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bigjob")
    add_arguments(ap)
    sys.exit(run_cli(ap.parse_args()))
