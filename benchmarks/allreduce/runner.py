"""One ``dosa bench allreduce`` run: gradients -> every method over the same inputs -> JSON, table, PNG.

This module owns the options and the loop over host counts; the dosa methods themselves are run by
a callback (``extra_methods``) that the dosa side passes in, so the baselines and dosa always see the
same files (:func:`benchmarks.allreduce.baselines.prepare_workdir`) in the same invocation::

    from benchmarks.allreduce import runner
    runner.add_arguments(parser)            # adds only options the parser does not have yet
    doc = runner.run_bench(args, extra_methods=fn)   # fn(hosts, workdir, testbed) -> {name: record}

``python -m benchmarks.allreduce`` runs the baselines and the limit alone (:func:`main`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from dosa import wire
from dosa.errors import DosaError
from dosa.job import ResultMode
from dosa.progress import progress as progress_bar
from testbed.config import DEFAULT_MTU as TESTBED_MTU
from benchmarks.allreduce import baselines as B
from benchmarks.allreduce import gradients as G
from benchmarks.allreduce import limit as L
from benchmarks.allreduce import report as R


def _hosts_list(text) -> list[int]:
    if isinstance(text, int):
        return [text]
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hosts must be a number or a comma list like 2,4,8, not {text!r}")
    if not vals or any(v < 1 or v > 64 for v in vals):
        raise argparse.ArgumentTypeError("--hosts values must lie in 1..64")
    return vals


def _methods(text) -> list[str]:
    return [m.strip() for m in str(text).split(",") if m.strip()]


#: (flags, kwargs) of every option; ``add_arguments`` skips those the parser already has.
OPTIONS = [
    (("--hosts",), dict(type=_hosts_list, default=[4], help="host count, or a comma list (2,4,8) for a "
                                                              "time-against-hosts plot (default 4)")),
    (("--dpus",), dict(type=int, default=1, help="DPUs (default 1)")),
    (("--numel",), dict(type=int, default=25_000_000, help="float32 entries per gradient (default 25M)")),
    (("--density",), dict(type=float, default=0.01, help="top-k fraction (default 0.01)")),
    (("--link-rate",), dict(default=None, help="per-link rate, e.g. 1gbit (default: unshaped)")),
    (("--correlation",), dict(type=float, default=0.5, help="correlation between hosts' gradients, "
                                                           "0..1 (default 0.5)")),
    (("--rounds",), dict(type=int, default=5, help="timed rounds per method (default 5)")),
    (("--warmup",), dict(type=int, default=1, help="untimed rounds first (default 1)")),
    (("--seed",), dict(type=int, default=0, help="gradient seed (default 0)")),
    (("--gradients",), dict(default=None, metavar="FILE", help="per-host gradients saved from a model "
                                                               "(.npz or torch.save list) instead of synthetic ones")),
    (("--real-model",), dict(type=int, default=0, metavar="STEPS",
                             help="gradients of a real MLP on sklearn digits after STEPS data-parallel "
                                  "steps, its size chosen close to --numel (default 0: synthetic)")),
    (("--baselines",), dict(type=_methods, default=list(B.METHODS) + ["limit"],
                            help="baseline methods to run (default gloo_dense,gloo_sparse_allgather,limit)")),
    (("--testbed",), dict(action="store_true", help="run the baselines in the host namespaces of a "
                                                    "testbed brought up per host count (root); default: loopback")),
    (("--testbed-prefix",), dict(default="bench", help="prefix of that testbed (default bench)")),
    (("--shape-dpus",), dict(action="store_true", help="DPU links are shaped too (counts in `limit`)")),
    (("--mtu",), dict(type=int, default=None, help="MTU of every testbed link and of dosa's job "
                                                   "(default: the testbed's, the largest frame native "
                                                   "XDP takes on a veth, 3500)")),
    (("--packet-rate-seconds",), dict(type=float, default=1.0, help="how long to measure the raw UDP "
                                                                   "packet rate (default 1 s; 0 = skip)")),
    (("--timeout",), dict(type=float, default=900.0, help="bound on each baseline run (default 900 s)")),
    (("--json",), dict(default=None, metavar="FILE", help="write the results as JSON")),
    (("--plot",), dict(default=None, metavar="PNG", help="write a PNG plot")),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    have = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public lookup
    for flags, kw in OPTIONS:
        if not any(f in have for f in flags):
            parser.add_argument(*flags, **kw)


def _opt(args, name, default=None):
    v = getattr(args, name, default)
    return default if v is None and default is not None else v


def _check_args(args) -> None:
    if not 1 <= args.numel <= 2**32:
        raise DosaError(f"--numel must lie in 1..2^32, not {args.numel}")
    if not 0 < args.density <= 1:
        raise DosaError(f"--density must lie in (0, 1], not {args.density}")
    if not 0 <= args.correlation <= 1:
        raise DosaError(f"--correlation must lie in [0, 1], not {args.correlation}")
    if args.rounds < 1 or args.warmup < 0:
        raise DosaError("--rounds must be at least 1 and --warmup at least 0")
    bad = [m for m in args.baselines if m not in (*B.METHODS, "limit")]
    if bad:
        raise DosaError(f"unknown baseline {bad[0]!r} (known: {', '.join((*B.METHODS, 'limit'))})")
    try:
        L._parse_rate(args.link_rate)
    except ValueError as e:
        raise DosaError(str(e)) from None


def _gradients_for(args, world: int, loaded) -> list[np.ndarray]:
    if args.real_model:
        return G.real_model_gradients(world, args.real_model, args.seed, G.hidden_for_numel(args.numel))
    if loaded is not None:
        if len(loaded) < world:
            raise DosaError(f"{args.gradients} holds gradients of {len(loaded)} hosts; {world} needed")
        return loaded[:world]
    return G.make_gradients(world, args.numel, args.correlation, args.seed)


def run_bench(args, extra_methods=None, progress=None) -> dict:
    """Run every method for every host count in ``args.hosts``; return the JSON document (see
    :mod:`benchmarks.allreduce.report`), also written to ``args.json`` / ``args.plot`` when given.

    ``extra_methods(hosts, workdir, testbed)`` -> ``{name: record}`` runs dosa's methods over the
    same inputs (``testbed`` is the one the baselines ran on, or None on loopback).
    """
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    for name, kw in ((f[0].lstrip("-").replace("-", "_"), k) for f, k in OPTIONS):
        if not hasattr(args, name):
            setattr(args, name, kw.get("default", False if kw.get("action") == "store_true" else None))
    if isinstance(args.hosts, (int, str)):
        args.hosts = _hosts_list(args.hosts)
    if isinstance(args.baselines, str):
        args.baselines = _methods(args.baselines)
    _check_args(args)
    loaded = None
    if args.gradients:
        try:
            loaded = G.load_gradients(args.gradients)
        except ValueError as e:
            raise DosaError(str(e)) from None
        args.numel = len(loaded[0])
        say(f"gradients from {args.gradients}: {len(loaded)} hosts x {args.numel} entries")
    if args.real_model:
        if args.gradients:
            raise DosaError("give --gradients or --real-model, not both")
        args.numel = G.mlp_numel(G.hidden_for_numel(args.numel))
        say(f"gradients of a real MLP (digits, {args.real_model} steps): {args.numel} entries")
    machine = {"cpus": len(os.sched_getaffinity(0)), "load_avg": list(os.getloadavg()), "packet_rate": []}
    if "limit" in args.baselines and args.packet_rate_seconds > 0 and os.geteuid() != 0:
        say("not root: the packet rate is not measured (limit counts the link only)")
    runs = []
    # one stage per host count and block of methods (the Gloo baselines, the link limit, dosa's paths)
    blocks = bool([m for m in args.baselines if m in B.METHODS]) + ("limit" in args.baselines) \
        + (extra_methods is not None)
    bar = progress_bar(max(1, blocks) * len(args.hosts), "dosa bench allreduce", unit="stage")
    if progress is None and bar.mode == "bar":
        say = bar.note  # lines above the bar instead of through it
    # the job's MTU: --mtu, else the testbed's links' default (dosa's jobs there take it) or wire's
    job_mtu = args.mtu or (TESTBED_MTU if args.testbed else wire.DEFAULT_MTU)
    for world in args.hosts:
        t0 = time.monotonic()
        pr = None
        if "limit" in args.baselines and args.packet_rate_seconds > 0 and os.geteuid() == 0:
            # measured again for every host count: on a shared machine the rate moves with the load
            say(f"measuring the raw UDP packet rate ({args.packet_rate_seconds:g} s, veth pair)...")
            pr = L.measure_packet_rate(args.packet_rate_seconds, mtu=job_mtu)
            say(f"  {pr['pps']:.0f} packets/s delivered ({pr['gbit_s']:.2f} Gbit/s of "
                f"{pr['payload_bytes']}-byte datagrams)")
            machine["packet_rate"].append({"hosts": world, **pr})
        say(f"== {world} hosts: generating gradients ({args.numel} entries, correlation {args.correlation})")
        grads = _gradients_for(args, world, loaded)
        wd = B.prepare_workdir(grads, args.density)
        del grads
        meta = B.load_meta(wd)
        ov = meta["overlap"]
        say(f"  top-k overlap: mean pairwise Jaccard {ov['mean_pairwise_jaccard']:.3f}, "
            f"union {ov['union']} = {ov['union_over_total']:.3f} x W*k")
        tb = None
        try:
            if args.testbed:
                from testbed.core import Testbed

                bed = Testbed(prefix=args.testbed_prefix)
                say(f"  testbed {args.testbed_prefix!r} up: {world} hosts, {args.dpus} DPUs, link {args.link_rate}")
                # `tb` is set only once up() succeeded: a refused up (that prefix is already up, e.g.
                # another benchmark's) must not tear the other run's testbed down in `finally`;
                # a failed up cleans up after itself.
                bed.up(hosts=world, dpus=args.dpus, link_rate=args.link_rate, cpu_split=True,
                       services=False, shape_dpus=args.shape_dpus, mtu=args.mtu)
                tb = bed
            methods = {}
            gl = [m for m in args.baselines if m in B.METHODS]
            if gl:
                methods.update(B.run_baselines(wd, gl, rounds=args.rounds, warmup=args.warmup,
                                               testbed=tb, timeout=args.timeout, progress=say))
                bar.update(1, status=f"{world} hosts: baselines")
            if "limit" in args.baselines:
                idx = [np.load(wd / f"idx{r}.npy") for r in range(world)]
                mode = getattr(args, "mode", None) or "sum"  # dpu_fw's --mode: the result dosa sends
                traffic = L.dosa_traffic(idx, args.numel, dpus=max(1, args.dpus), mode=mode,
                                         density=args.density, mtu=job_mtu,
                                         multicast=os.environ.get("DOSA_MULTICAST", "1") != "0")
                traffic["mode"] = mode
                methods["limit"] = L.link_limit(traffic, args.link_rate, shape_dpus=args.shape_dpus,
                                                packet_rate=pr["pps"] if pr else None)
                bar.update(1, status=f"{world} hosts: limit")
            if extra_methods is not None:
                methods.update(extra_methods(world, wd, tb))
                bar.update(1, status=f"{world} hosts: dosa")
        except RuntimeError as e:
            raise DosaError(str(e)) from None
        finally:
            if tb is not None:
                tb.down()
            B._rm_workdir(wd)
        for name, rec in methods.items():
            for ck in ("check", "check_end_to_end"):
                if isinstance(rec.get(ck), dict) and not rec[ck].get("ok"):
                    say(f"  WARNING: {name} {ck}: result differs from the reference sum")
        runs.append({"hosts": world, "overlap": ov, "k": meta["k"], "methods": methods,
                     "elapsed_s": time.monotonic() - t0})
    bar.close()
    config = {"hosts": args.hosts, "dpus": args.dpus, "numel": args.numel, "density": args.density,
              "correlation": None if loaded is not None or args.real_model else args.correlation,
              "gradients": args.gradients or (f"real MLP on digits, {args.real_model} steps"
                                              if args.real_model else "synthetic"), "link_rate": args.link_rate,
              "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed, "mtu": args.mtu,
              "where": f"testbed {args.testbed_prefix}" if args.testbed else "loopback",
              "command": " ".join(shlex.quote(a) for a in sys.argv)}
    doc = R.document(config, runs, machine)
    R.validate(doc)
    if args.json:
        R.write_json(doc, args.json)
        say(f"wrote {args.json}")
    if args.plot:
        R.plot(doc, args.plot)
        say(f"wrote {args.plot}")
    return doc


def dpu_fw_methods(args):
    """An ``extra_methods`` callback running dosa's paths with benchmarks.allreduce.dosa_paths (engineer D's runner),
    its records converted to this schema. Each path gets its own testbed (benchmarks.allreduce.dosa_paths brings it
    up in the path's mode); ``args.paths`` / ``args.mode`` are dpu_fw's options.

    Every dosa host reads the work folder's idx{r}/val{r}.npy (the baselines' inputs) and its testbed
    is shaped by ``--link-rate`` with the same cpu split.
    """
    import copy
    import statistics

    from benchmarks.allreduce import dosa_paths as dosa_bench

    paths = [x.strip() for x in str(getattr(args, "paths", "xdp,userspace") or "").split(",") if x.strip()]
    for p in paths:
        if p not in ("xdp", "userspace"):
            raise DosaError(f"unknown path {p!r}: use xdp and/or userspace")
    if paths and os.geteuid() != 0:
        from dosa.errors import NeedsRoot

        raise NeedsRoot("dosa bench allreduce (the dosa paths run on a namespace testbed)")

    def run(world: int, workdir, testbed) -> dict:
        a = copy.copy(args)
        a.hosts = world
        a.paths = getattr(args, "paths", "xdp,userspace")
        a.mode = getattr(args, "mode", "sum")
        a.timeout = getattr(args, "timeout", None) or 900
        out_dir = Path(workdir) / "dosa"
        out = {}
        for p in paths:
            print(f"  dosa_{p}: {world} hosts, own testbed in {p} mode...", file=sys.stderr, flush=True)
            m = dosa_bench._run_path(p, a, out_dir, workdir)
            rs = m["round_s"]
            st = {"median_s": m["median_round_s"], "min_s": min(rs), "max_s": max(rs), "rounds_s": rs}
            name = f"dosa_{p}" + ("_gtopk" if a.mode == ResultMode.GTOPK else "")
            out[name] = {
                **m, "transport": st, "median_s": st["median_s"],
                "bytes_per_host": {"sent": int(statistics.median(m["bytes_sent_per_host"])),
                                   "received": int(statistics.median(m["bytes_received_per_host"])),
                                   "model": "counted by the host's socket (UDP payload)"},
                "check": {"ok": bool(m["verified_all_rounds"]), "tolerance": "exact (fixed point)",
                          "max_err_over_tol": 0.0 if m["verified_all_rounds"] else float("inf"),
                          "ranks_checked": world, "rounds_checked": m["rounds_checked"]},
                "notes": "the work folder's top-k inputs, quantized; its own testbed, shaped by "
                         "--link-rate, cpu split like the baselines'; every round checked on every host",
            }
            import shutil

            shutil.rmtree(out_dir, ignore_errors=True)
        return out

    return run


def cli_run(args, extra_methods=None) -> int:
    """What a CLI handler returns: run, print the table on stdout; 1 if any result was wrong."""
    doc = run_bench(args, extra_methods=extra_methods)
    print(R.table(doc))
    wrong = [f"{name} ({run['hosts']} hosts)" for run in doc["runs"] for name, rec in run["methods"].items()
             for ck in ("check", "check_end_to_end")
             if isinstance(rec.get(ck), dict) and not rec[ck].get("ok")]
    if wrong:
        print(f"dosa bench: WRONG results from {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    """``python -m benchmarks.allreduce``: the baselines and the limit alone, table on stdout."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.allreduce",
                                 description="Gloo baselines and the link limit of dosa, over correlated gradients.")
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return cli_run(args)
    except DosaError as e:
        print(f"dosa bench: {e}", file=sys.stderr)
        return 2
