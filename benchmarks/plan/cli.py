"""``dosa plan``: predicted round times of dosa (sum, gtopk), a ring allreduce and a sparse allgather,
what bounds each, over link rates; ``--validate`` checks the model against the testbed (root).
docs/performance.md (*Where dosa wins*) describes the model and its assumptions."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from dosa import wire
from dosa.errors import DosaError

#: the models the docs' table carries
DEFAULT_MODELS = ("resnet50:25.6e6", "bert-base:110e6", "gpt2-small:124e6")


def _model(text: str) -> tuple[str, int]:
    name, sep, numel = text.rpartition(":")
    try:
        n = int(float(numel))
    except ValueError:
        n = 0
    if not sep or not name or not 1 <= n < 2**32:
        raise argparse.ArgumentTypeError(f"a model is NAME:ENTRIES with 1 <= ENTRIES < 2^32 (e.g. "
                                         f"resnet50:25.6e6), not {text!r}")
    return name, n


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"give positive numbers, comma-separated (e.g. 25,100), not {text!r}")
    return vals


def register(sub) -> None:
    p = sub.add_parser("plan", help="predicted round times: dosa vs ring allreduce vs sparse allgather "
                                    "over link rates (--validate: against the testbed, root)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", type=_model, metavar="NAME:ENTRIES",
                   help=f"a model and its gradient size (repeatable; default {', '.join(DEFAULT_MODELS)})")
    p.add_argument("--density", type=float, default=0.01, help="fraction of entries a node sends (default 0.01)")
    p.add_argument("--nodes", type=int, default=16, help="nodes (DPU workers; default 16)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks (GPUs) a node (default 8)")
    p.add_argument("--link-gbps", type=_floats, default=[25.0, 100.0],
                   help="link rates of the table, Gbit/s (default 25,100; the plot spans 1-200)")
    p.add_argument("--dpu-cores", type=int, default=8, help="cores a DPU (default 8: a BlueField-2)")
    p.add_argument("--dpus", type=int, default=None,
                   help="DPUs the partitions spread over (default: one a node, each node's NIC a DPU)")
    p.add_argument("--dpu-workers", type=int, default=None,
                   help="cores running the completion path (default: every DPU core, as `dosa dpu run "
                        "--workers N` shards it; 1: one worker process)")
    p.add_argument("--dpu-slowdown", type=float, default=2.5,
                   help="a DPU core's time for the DPU's work over this machine's core's (default 2.5: "
                        "an assumption for BlueField-2's Cortex-A72, docs/performance.md)")
    p.add_argument("--dpu-link-gbps", type=float, default=None, help="the DPU's link (default: the nodes')")
    p.add_argument("--mtu", type=int, default=wire.MAX_MTU, help=f"MTU (default {wire.MAX_MTU}, dosa's largest)")
    p.add_argument("--union", type=float, default=None,
                   help="|union of the nodes' top-k| / (nodes x k) (default nodes^-0.3, the bench's gradients)")
    p.add_argument("--host-device", choices=("cuda", "cpu"), default="cuda",
                   help="where the encoder pass runs (default cuda: the H200 figure of PLATFORM.md; cpu: measured here)")
    p.add_argument("--intra-gbps", type=float, default=2400.0,
                   help="a node's interconnect per rank, Gbit/s (default 2400: NVLink, ~300 GB/s)")
    p.add_argument("--costs", metavar="FILE", default=None,
                   help="the DPU's costs: `dosa bench dpu --json` output (default docs/performance_dpu.json "
                        "when present, else the documented fallback figures)")
    p.add_argument("--host-costs", metavar="FILE", default=None,
                   help="reuse the host and path costs of an earlier `dosa plan --json` instead of measuring")
    p.add_argument("--json", metavar="FILE", help="write the predictions (and checks) as JSON")
    p.add_argument("--plot", metavar="PNG", help="write round time against link rate (1-200 Gbit/s)")
    v = p.add_argument_group("validation (root: brings up testbeds)")
    v.add_argument("--validate", action="store_true",
                   help="run `dosa bench allreduce` on the testbed and compare with the model")
    v.add_argument("--validate-links", default="1gbit,10gbit", help="link rates (default 1gbit,10gbit)")
    v.add_argument("--validate-hosts", default="2,4", help="host counts (default 2,4)")
    v.add_argument("--validate-numel", type=int, default=10_000_000, help="gradient entries (default 10M)")
    v.add_argument("--validate-rounds", type=int, default=5, help="timed rounds a bench run (default 5)")
    v.add_argument("--repeat", type=int, default=3,
                   help="bench runs per setting, alternated; the median counts (default 3)")
    v.add_argument("--validate-dir", default=None, help="where the bench runs' JSON and logs go (default: a temp dir)")
    p.set_defaults(func=cmd_plan)


def _check(args) -> None:
    if not 0 < args.density <= 1:
        raise DosaError(f"--density must be in (0, 1], not {args.density}")
    if args.dpus is None:
        args.dpus = args.nodes
    if args.dpu_workers is None:
        args.dpu_workers = args.dpu_cores
    if args.nodes < 1 or args.ranks_per_node < 1 or args.dpu_cores < 1 or args.dpus < 1 or args.dpu_workers < 1:
        raise DosaError("--nodes, --ranks-per-node, --dpu-cores, --dpus and --dpu-workers must be at least 1")
    if args.nodes > wire.MAX_WORKERS:
        raise DosaError(f"--nodes {args.nodes}: a dosa job holds at most {wire.MAX_WORKERS} workers "
                        f"(nodes, with the node-aware hook); docs/performance.md says what more would take")
    if args.dpu_slowdown <= 0 or args.intra_gbps <= 0:
        raise DosaError("--dpu-slowdown and --intra-gbps must be positive")
    if args.union is not None and not 0 < args.union <= 1:
        raise DosaError(f"--union must be in (0, 1], not {args.union}")
    wire.check_mtu(args.mtu)


def _costs(args, say):
    from benchmarks.plan import costs as C

    dpu = C.load_dpu(args.costs)
    if args.host_costs:
        try:
            d = json.loads(Path(args.host_costs).read_text())["costs"]
        except (OSError, ValueError, KeyError) as e:
            raise DosaError(f"cannot read host costs from {args.host_costs}: {e}") from None
        return C.Costs(C.HostCosts(**d["host"]), dpu, C.PathCosts(**d["path"]))
    say("dosa plan: measuring the host's costs (a few seconds)")
    host = C.measure_host(mtu=args.mtu, say=lambda m: say(f"  {m}"))
    return C.Costs(host, dpu, C.measure_loopback_path(args.mtu, say=lambda m: say(f"  {m}")))


def cmd_plan(args) -> int:
    from benchmarks.plan import report
    from benchmarks.plan.model import Cluster, Workload

    _check(args)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    costs = _costs(args, say)
    models = [Workload(name, n, args.density, args.union) for name, n in
              (args.model or [_model(m) for m in DEFAULT_MODELS])]
    cluster = Cluster(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link_gbps=args.link_gbps[0],
                      dpu_cores=args.dpu_cores, dpus=args.dpus, mtu=args.mtu,
                      dpu_link_gbps=args.dpu_link_gbps, dpu_slowdown=args.dpu_slowdown,
                      dpu_workers=args.dpu_workers, host_device=args.host_device,
                      intra_gbps=args.intra_gbps)
    preds = report.predictions(models, args.link_gbps, cluster, costs)
    if costs.dpu.source == "fallback":
        print("DPU costs: FALLBACK figures from the docs (dosa bench dpu has not measured them): "
              + ", ".join(f"{k} {getattr(costs.dpu, k):g}" for k in costs.dpu.notes))
    else:
        print(f"DPU costs: {costs.dpu.source}")
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.dpus} DPU(s) of {args.dpu_cores} cores "
          f"({args.dpu_workers} completion worker(s), {args.dpu_slowdown:g}x this machine's core), MTU {args.mtu}, "
          f"encoder on {args.host_device}")
    print(report.format_table(preds))
    doc = {"schema": "dosa-plan/1", "predictions": preds, "costs": costs.as_dict(),
           "cluster": asdict(cluster), "density": args.density,
           "assumptions": _assumptions(args, costs)}
    if args.plot:
        report.plot(args.plot, models, cluster, costs,
                    f"{args.nodes} nodes x {args.ranks_per_node} ranks, DPU {args.dpu_cores} cores x "
                    f"{args.dpu_slowdown:g} slower, encoder on {args.host_device}, DPU costs: "
                    f"{'fallback' if costs.dpu.source == 'fallback' else 'bench dpu'}")
        print(f"wrote {args.plot}")
    rc = 0
    if args.validate:
        doc["checks"], doc["validation"] = _validate(args, costs, say)
        doc["model_kept"] = all(c["ok"] for c in doc["checks"])
        rc = 0 if doc["model_kept"] else 1
    if args.json:
        report.write_json(args.json, doc)
        print(f"wrote {args.json}")
    return rc


def _validate(args, costs, say):
    from benchmarks.plan import costs as C, testbed_path, validate as V
    from testbed.core import split_cpus

    setup = V.ValidationSetup(link_rates=tuple(r.strip() for r in args.validate_links.split(",") if r.strip()),
                              hosts=tuple(int(h) for h in args.validate_hosts.split(",") if h.strip()),
                              numel=args.validate_numel, density=args.density,
                              rounds=args.validate_rounds, repeat=args.repeat)
    if len(setup.link_rates) < 1 or len(setup.hosts) < 1 or args.repeat < 1:
        raise DosaError("--validate needs at least one link rate, one host count and --repeat >= 1")
    for r in setup.link_rates:
        V.rate_gbps(r)
    out = Path(args.validate_dir or tempfile.mkdtemp(prefix="dosa-plan-"))
    out.mkdir(parents=True, exist_ok=True)
    say("dosa plan --validate: measuring the testbed's path (TCP per byte, UDP per packet)")
    paths = testbed_path.measure(list(setup.link_rates), mtu=args.mtu, say=lambda m: say(f"  {m}"))
    hosts = [costs.host]

    def measure_again():
        hosts.append(C.measure_host(mtu=args.mtu))

    docs, failed = V.run_benches(setup, out, say, measure_again)
    tb_costs = C.Costs(C.median_host(hosts), costs.dpu, costs.path)
    checks = V.compare(setup, docs, lambda rate: tb_costs.on(paths[rate]), len(split_cpus()[0]))
    print(f"\nvalidation on the testbed ({setup.numel / 1e6:g}M entries, density {setup.density:g}, "
          f"median of {setup.repeat} bench run(s) each; bench JSON and logs in {out}):")
    print(V.format_checks(checks))
    for f in failed:
        print(f"left out: {f}")
    info = {"setup": asdict(setup), "paths": {r: asdict(p) for r, p in paths.items()}, "dir": str(out),
            "host": asdict(tb_costs.host), "host_runs": [asdict(h) for h in hosts],
            "tolerance": V.TOLERANCE, "shared_host_cores": len(split_cpus()[0]), "failed_runs": failed}
    return checks, info


def _assumptions(args, costs) -> dict:
    from benchmarks.plan import model as M

    return {
        "dpu_costs": costs.dpu.source if costs.dpu.source != "fallback" else
        {"fallback": {k: f"{getattr(costs.dpu, k):g} ns: {why}" for k, why in costs.dpu.notes.items()}},
        "dpu_slowdown": f"{args.dpu_slowdown:g}x this machine's core (assumed for BlueField-2's Cortex-A72; "
                        f"not measured: no BlueField here)",
        "dpu_workers": f"{args.dpu_workers} core(s) run the completion path (dosa dpu run --workers N shards it)",
        "encoder": (f"{M.GPU_ENCODE_NS_PER_ENTRY:.3f} ns an entry on a GPU (25M in 3.15 ms on a lent H200, PLATFORM.md)"
                    if args.host_device == "cuda" else "the CPU figure measured here"),
        "union": "nodes^-0.3 of nodes x k (the bench's synthetic gradients at correlation 0.5)"
        if args.union is None else f"{args.union:g} of nodes x k (given)",
        "path": costs.path.source,
        "intra_node": f"{args.intra_gbps:g} Gbit/s a rank for the node's reduce-scatter and all-gather",
        "ring": "NCCL's ring at line rate; its reduction on the GPU" if args.host_device == "cuda"
        else "Gloo's ring: TCP per byte and float adds on the host CPU",
        "allgather": "hierarchical (the node's sum first), DGC's encoder pass, (N-1) x 8k bytes a node each way",
    }
