"""``dosa demo``: see dosa/app/demo/ (its __init__ says what runs)."""
from __future__ import annotations

import json

from dosa.app.demo import BACKENDS, DemoConfig
from dosa.job import RESULT_MODES, ResultMode


def register(sub) -> None:
    p = sub.add_parser("demo", help="train a small model with DDP via dosa and via dense Gloo, compare")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--dpus", type=int, default=1)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="per host")
    p.add_argument("--warmup-steps", type=int, default=0, help="dense steps before dosa takes over")
    p.add_argument("--mode", choices=RESULT_MODES, default=ResultMode.SUM.value,
                   help="DPU result mode: exact sums (default) or only the k largest per partition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/demo", help="directory for demo.json and loss.png")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="testbed (namespaces, root), loopback (userspace DPU workers), auto")
    p.add_argument("--offload", action="store_true", help="also train with augmentation and "
                   "validation on the DPUs (services pinned to the DPU CPUs) and compare the time per "
                   "epoch with the same training doing both on the hosts")
    p.add_argument("--offload-dataset", default=DemoConfig.offload_dataset,
                   help="dataset spec of the --offload training (see docs/offload.md)")
    p.add_argument("--offload-epochs", type=int, default=DemoConfig.offload_epochs)
    p.add_argument("--offload-batch-size", type=int, default=DemoConfig.offload_batch_size,
                   help="per host")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the training runs")
    p.add_argument("--tta-methods", default=DemoConfig.tta_methods,
                   help="testbed only: methods of the time-to-accuracy run after the comparison "
                        "(dosa bench train at demo size; '' skips it)")
    p.add_argument("--tta-epochs", type=int, default=DemoConfig.tta_epochs)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    import sklearn  # noqa: F401  the ranks train on its digits: missing, the demo says so before starting
    import torch  # noqa: F401

    from dosa.app.demo import format_report, run_demo

    cfg = DemoConfig(hosts=args.hosts, dpus=args.dpus, density=args.density, epochs=args.epochs,
                     batch_size=args.batch_size, warmup_steps=args.warmup_steps, seed=args.seed,
                     out=args.out, backend=args.backend, mode=args.mode, offload=args.offload,
                     timeout=args.timeout, offload_dataset=args.offload_dataset,
                     offload_epochs=args.offload_epochs, offload_batch_size=args.offload_batch_size,
                     tta_methods=args.tta_methods, tta_epochs=args.tta_epochs)
    summary = run_demo(cfg, echo=(lambda line: None) if args.json else print)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}
                         | {"runs": {c: {k: v for k, v in r.items() if k != "loss_per_step"}
                                     for c, r in summary["runs"].items()}}, indent=1))
    else:
        print(format_report(summary))
        if summary.get("time_to_accuracy"):
            print(f"wrote {summary['time_to_accuracy']['plot']} (accuracy against wall time)")
        print(f"wrote {args.out}/demo.json" + (f" and {summary['plot']}" if summary["plot"] else
                                                " (no plot: install the `plot` extra)"))
    return 0 if summary["within_target"] else 1
