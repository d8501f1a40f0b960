"""host_lib's commands: ``dosa bench host`` (per-round CPU costs of compress/quantize/packetize/parse)."""
from __future__ import annotations

import argparse

from dosa.errors import DosaError


def register_bench(bench_sub) -> None:
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
    from host_lib import bench_host

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
