"""``dosa offload serve-augment | serve-validate | train``."""
from __future__ import annotations

from dpu_fw.offload import service, validation
from examples import train_offload


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
    train_offload.add_arguments(t)
    t.set_defaults(func=train_offload.run)
