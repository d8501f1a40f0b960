"""``dosa bench dataplane``: XDP merge rate on a veth vs userspace merges of the same entries."""
from __future__ import annotations

import json

from dosa import wire


def register_bench(bench_sub) -> None:
    b = bench_sub.add_parser("dataplane", help="XDP merge rate on a veth under a batched sender, vs "
                                               "np.add.at and the Cython scatter-add")
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
    b.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from .bench import run, summary

    res = run(workers=args.workers, numel=args.numel, density=args.density, rounds=args.rounds,
              partition_size=args.partition_size, senders=args.senders, seed=args.seed,
              xdp_mode=args.xdp_mode, qdisc=not args.no_qdisc, link_baseline=not args.no_link_baseline)
    print(summary(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["xdp"]["corrupt_partition_sums"] == 0 else 1
