"""``dosa bench host | dataplane | allreduce | offload | bigjob | recovery | afxdp | train``: every benchmark's command line, in one place.

Each benchmark module is imported only when its command runs, so ``dosa --help`` stays fast and a
benchmark's heavy dependencies (torch, bcc) are not needed to list them."""
from __future__ import annotations

import argparse
import importlib
import json

from dosa import wire
from dosa.errors import DosaError
from dosa.job import RESULT_MODES, ResultMode


def register_bench(bench_sub) -> None:
    _register_host(bench_sub)
    _register_dataplane(bench_sub)
    _register_allreduce(bench_sub)
    _register_offload(bench_sub)
    _register_module(bench_sub, "dpu",
                     "the DPU side alone on one core: XDP merge, completion path, settle, userspace "
                     "merge, ns per entry (root)")
    _register_module(bench_sub, "bigjob",
                     "a 110M-entry job on the testbed's default DPU memory, every round exact (root)")
    _register_module(bench_sub, "recovery",
                     "round time under loss/dup/reorder vs clean, and time to name a killed host (root)")
    _register_module(bench_sub, "afxdp",
                     "AF_XDP copy-mode sends against dosa's UDP GSO sends on a veth: rate, CPU a packet (root)")
    _register_module(bench_sub, "train",
                     "time to accuracy: dosa vs dense Gloo, DGC allgather and PowerSGD (testbed, root)")


# --- dosa bench bigjob | recovery | train ------------------------------------------------------

def _register_module(bench_sub, name: str, help_line: str) -> None:
    """``dosa bench NAME`` for a benchmark module that carries its own command line:
    ``add_arguments(parser)``, ``run_cli(args)``, and its docstring's first paragraph as the
    description. Importing the module is light (numpy only; torch is imported by train's ranks)."""
    mod = importlib.import_module(f"benchmarks.{name}")
    p = bench_sub.add_parser(name, help=help_line, description=mod.__doc__.split("\n\n")[0])
    mod.add_arguments(p)
    p.set_defaults(func=mod.run_cli)


# --- dosa bench host ---------------------------------------------------------------------------

def _register_host(bench_sub) -> None:
    p = bench_sub.add_parser(
        "host", help="host CPU cost per round: exact vs fast top-k, quantize, packetize, parse",
        description="Median milliseconds of each host step on a synthetic heavy-tailed gradient, "
                    "with exact top-k (np.argpartition) as the baseline of the fast selection.")
    p.add_argument("--numel", type=int, default=25_000_000, help="gradient entries (default 25M)")
    p.add_argument("--density", type=float, default=0.01, help="fraction selected (default 0.01)")
    p.add_argument("--workers", type=int, default=4, help="workers summed (sets the clip bound)")
    p.add_argument("--dpus", type=int, default=2, help="DPUs the partitions are spread over")
    p.add_argument("--repeat", type=int, default=5, help="runs per step (median reported)")
    p.add_argument("--exact-repeat", type=int, default=3, help="runs of the slow exact baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=_bench_host)


def _bench_host(args: argparse.Namespace) -> int:
    from benchmarks import host as bench_host

    if not 1 <= args.numel < 2**32:
        raise DosaError(f"--numel must be in 1..2^32-1, got {args.numel}")
    if not 0.0 <= args.density <= 1.0:
        raise DosaError(f"--density must be in [0, 1], got {args.density}")
    if args.repeat < 1 or args.exact_repeat < 1:
        raise DosaError("--repeat and --exact-repeat must be at least 1")
    if not 1 <= args.workers <= 64 or args.dpus < 1:
        raise DosaError("--workers must be in 1..64 and --dpus at least 1")
    try:
        r = bench_host.run(args.numel, args.density, workers=args.workers, num_dpus=args.dpus,
                           repeat=args.repeat, exact_repeat=args.exact_repeat, seed=args.seed)
    except (ValueError, MemoryError) as e:
        raise DosaError(f"bench host failed: {e}") from None
    print(bench_host.format_table(r))
    if args.json:
        try:
            bench_host.write_json(r, args.json)
        except OSError as e:
            raise DosaError(f"cannot write {args.json}: {e.strerror}") from None
        print(f"wrote {args.json}")
    return 0


# --- dosa bench dataplane ----------------------------------------------------------------------

def _register_dataplane(bench_sub) -> None:
    b = bench_sub.add_parser("dataplane", help="XDP merge rate on a veth under a batched sender, vs "
                                               "np.add.at")
    b.add_argument("--json", metavar="FILE", help="write the results as JSON")
    b.add_argument("--workers", type=int, default=8)
    b.add_argument("--numel", type=int, default=1 << 22)
    b.add_argument("--density", type=float, default=0.05)
    b.add_argument("--rounds", type=int, default=8)
    b.add_argument("--partition-size", type=int, default=wire.DEFAULT_PARTITION_SIZE)
    b.add_argument("--senders", type=int, default=2, help="sender threads (sendmmsg without the GIL)")
    b.add_argument("--xdp-mode", choices=("native", "skb", "auto"), default="native")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-qdisc", action="store_true",
                   help="leave the sender's veth without a qdisc (bursts beyond the XDP ring drop)")
    b.add_argument("--no-link-baseline", action="store_true",
                   help="skip the same-traffic run against an XDP program that only drops")
    b.set_defaults(func=_bench_dataplane)


def _bench_dataplane(args) -> int:
    from benchmarks.dataplane import run, summary

    res = run(workers=args.workers, numel=args.numel, density=args.density, rounds=args.rounds,
              partition_size=args.partition_size, senders=args.senders, seed=args.seed,
              xdp_mode=args.xdp_mode, qdisc=not args.no_qdisc, link_baseline=not args.no_link_baseline)
    print(summary(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["xdp"]["corrupt_partition_sums"] == 0 else 1


# --- dosa bench allreduce ----------------------------------------------------------------------

def _register_allreduce(bench_sub) -> None:
    b = bench_sub.add_parser("allreduce", help="time dosa allreduce through the DPU (XDP and userspace paths)")
    from benchmarks.allreduce.runner import _hosts_list, add_arguments as add_bench_options

    b.add_argument("--hosts", type=_hosts_list, default=[4], help="host count, or a comma list (2,4,8)")
    b.add_argument("--dpus", type=int, default=1)
    b.add_argument("--numel", type=int, default=25_000_000)
    b.add_argument("--density", type=float, default=0.01)
    b.add_argument("--rounds", type=int, default=5, help="timed rounds (after --warmup)")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--paths", default="xdp,userspace", help="comma list of xdp,userspace")
    b.add_argument("--mode", choices=RESULT_MODES, default=ResultMode.SUM.value)
    b.add_argument("--json", metavar="FILE", help="write the results as JSON")
    add_bench_options(b)  # baselines, limit, gradients, link rate, plot (runner); skips the above
    b.set_defaults(func=_bench_allreduce)


def _bench_allreduce(args) -> int:
    # dosa's paths (dosa_paths) run beside the baselines in one invocation
    from benchmarks.allreduce import runner

    return runner.cli_run(args, extra_methods=runner.dpu_fw_methods(args))


# --- dosa bench offload ------------------------------------------------------------------------

def _register_offload(bench_sub) -> None:
    from benchmarks import offload

    b = bench_sub.add_parser("offload", help="time per epoch: host-only vs augmentation+validation offloaded")
    b.add_argument("--json", default=None, help="write the results here")
    b.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    b.add_argument("--dataset", default=offload.DEFAULT_DATASET)
    b.add_argument("--epochs", type=int, default=3, help="epochs per timed run")
    b.add_argument("--rounds", type=int, default=5, help="timed runs per mode (alternating)")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--hidden", type=int, default=384, help="hidden width of the MLP trained")
    b.add_argument("--host-cpu", type=int, default=0)
    b.add_argument("--dpu-cpus", default="1")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--nice", type=int, default=0,
                   help="niceness of the host loop and the services alike (e.g. -10 on a busy shared "
                        "machine, to approach dedicated cores; below 0 needs root)")
    b.set_defaults(func=offload.main)
