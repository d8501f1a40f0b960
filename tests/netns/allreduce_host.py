"""One host of the allreduce namespace tests (run inside a host namespace by allreduce_lab.Lab).

Every host derives EVERY worker's input of every round from (seed, round, worker), so each host
computes the exact expected result itself, independently of the code under test (plain numpy:
np.add.at for the sum, a lexsort for gtopk's k largest |sum| per partition, ties to the smaller
index) and compares it with what the DPU returned. Writes a JSON summary to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dosa.errors import DosaError  # noqa: E402
from host_lib.client import AggregationClient, MissingWorkersError  # noqa: E402
from host_lib.quantize import clip_bound  # noqa: E402
from dosa.job import JobConfig  # noqa: E402


def inputs(job: JobConfig, seed: int, rnd: int, w: int, nnz: int):
    rng = np.random.default_rng([seed, rnd, w])
    idx = np.sort(rng.choice(job.numel, nnz, replace=False)).astype(np.uint32)
    # magnitudes up to the clip bound: exercises the s32 headroom rule, not only small numbers
    lim = clip_bound(job.workers) if rnd % 3 == 0 else 5000
    q = rng.integers(-lim, lim + 1, nnz).astype(np.int32)
    if rnd % 2 == 1 and w == 0:
        # a partition where two workers cancel exactly: zero sums must be omitted
        q[: min(8, nnz)] = 7
    return idx, q


def expected(job: JobConfig, seed: int, rnd: int, nnz: int):
    total = np.zeros(job.numel, np.int64)
    for w in range(job.workers):
        idx, q = inputs(job, seed, rnd, w, nnz)
        np.add.at(total, idx.astype(np.int64), q.astype(np.int64))
    nz = np.flatnonzero(total)
    if job.mode == "sum":
        return nz, total[nz]
    keep = []
    ps = job.partition_size
    for p in range(math.ceil(job.numel / ps)):
        lo, hi = p * ps, min((p + 1) * ps, job.numel)
        sel = nz[(nz >= lo) & (nz < hi)]
        k = max(1, math.ceil(job.density * (hi - lo)))
        order = np.lexsort((sel, -np.abs(total[sel])))
        keep.append(np.sort(sel[order[:k]]))
    ix = np.concatenate(keep)
    return ix, total[ix]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job-config")
    ap.add_argument("--control", help="ADDR:PORT of a control plane to join through")
    ap.add_argument("--job-id", type=int, default=1)
    ap.add_argument("--shape", default="{}", help="JSON job shape given when joining")
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nnz", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--exit-before-round", type=int, default=-1,
                    help="simulate a host that dies: exit without a word before this round")
    ap.add_argument("--shuffle", action="store_true",
                    help="send every batch in random order (reordering: this kernel has no netem)")
    ap.add_argument("--round-gap", type=float, default=0.0, help="sleep between rounds")
    ap.add_argument("--float-check", action="store_true",
                    help="also run float allreduce rounds (density 1) and check the quantization bound")
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    res = {"worker": a.worker_id, "rounds_ok": 0, "mismatches": []}
    t0 = time.monotonic()
    try:
        if a.job_config:
            kw = {"job": JobConfig.load(a.job_config)}
        else:
            host, _, port = a.control.rpartition(":")
            kw = {"control": (host, int(port)), "join": dict(json.loads(a.shape), job_id=a.job_id)}
        with AggregationClient(worker_id=a.worker_id, timeout=a.timeout, shuffle_sends=a.shuffle,
                               **kw) as c:
            job = c.job
            for r in range(a.rounds):
                if r == a.exit_before_round:
                    os._exit(0)
                idx, q = inputs(job, a.seed, r, a.worker_id, a.nnz)
                got_i, got_s = c.allreduce_sparse(idx, q, job.scale_exp)
                exp_i, exp_s = expected(job, a.seed, r, a.nnz)
                if not (np.array_equal(got_i.astype(np.int64), exp_i)
                        and np.array_equal(got_s.astype(np.int64), exp_s)):
                    res["mismatches"].append({"round": r, "got": len(got_i), "expected": len(exp_i)})
                else:
                    res["rounds_ok"] += 1
                if a.round_gap:
                    time.sleep(a.round_gap)
            if a.float_check:
                c.density = 1.0
                for r in range(2):
                    rng = np.random.default_rng([a.seed, 1000 + r])
                    xs = rng.standard_normal((job.workers, job.numel)).astype(np.float32)
                    s = c.scale_exp
                    out = c.allreduce(xs[a.worker_id])
                    if r == 0:  # no residual yet: the error is W * half a quantization step
                        err = float(np.abs(out.astype(np.float64) - xs.astype(np.float64).sum(0)).max())
                        res["float_err"], res["float_bound"] = err, job.workers * 2.0 ** (-s - 1)
            res["stats"] = c.stats
    except MissingWorkersError as e:
        res.update(error=str(e), missing=e.missing, elapsed=time.monotonic() - t0)
    except DosaError as e:
        res.update(error=str(e), missing=None, elapsed=time.monotonic() - t0)
    res["elapsed"] = res.get("elapsed", time.monotonic() - t0)
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
