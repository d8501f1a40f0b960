"""``dosa offload serve-augment | serve-validate | train``."""
from __future__ import annotations

from dpu_fw.offload import service, validation


def _train(args) -> int:
    from host_lib.offload import run_training
    r = run_training(args.dataset, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
                     lr=args.lr, offload=args.offload or None, cpus=args.cpus, log=print)
    print(f"total {r['seconds']:.2f} s" + (" (fell back to the host)" if r["fell_back"] else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("offload", help="augmentation and validation services on the DPU's cores")
    osub = p.add_subparsers(dest="offload_cmd", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    a = osub.add_parser("serve-augment", help="run the augmentation service (on the DPU)")
    service.add_arguments(a)
    a.set_defaults(func=service.serve)
    v = osub.add_parser("serve-validate", help="run the validation service (on the DPU)")
    validation.add_arguments(v)
    v.set_defaults(func=validation.serve)
    t = osub.add_parser("train", help="train a small model, optionally with --offload")
    t.add_argument("--dataset", default="digits")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--offload", action="store_true", help="start the services and use them")
    t.add_argument("--cpus", default=None, help="CPUs for the services (with --offload)")
    t.set_defaults(func=_train)
