"""The rank side of ``dosa demo --offload``: DDP training (gradients by Gloo's dense allreduce, so
only the data path differs) of an MLP from dosa.offload.models, run twice in one launch:

* ``host``: every rank augments its own shard of batches (``LocalLoader``) and rank 0 evaluates the
  validation split after each epoch while the other ranks wait for it at the next allreduce;
* ``offload``: every rank reads its shard from an ``OffloadedLoader`` pointed at its DPU's
  augmentation service, and rank 0 submits a snapshot to its DPU's validation service after each
  epoch and trains on (the metrics are collected at the end).

Shards: rank r trains on the dataset ``--shard-spec`` with ``{rank}`` replaced (the demo writes one
npz file per rank: equal-sized disjoint parts of the training split, the whole validation split),
so the service streams exactly that rank's batches. Both modes see bit-identical batches (same seed,
same pipeline: docs/offload.md), start from the same weights and therefore must produce the same
losses, which the summary checks.

Launched like examples.train_digits (torchrun's variables); each rank writes ``--json`` ({rank}).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from datetime import timedelta


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard-spec", required=True, help="dataset spec of this rank's shard ({rank})")
    p.add_argument("--augment", default="", help="augmentation service per DPU: HOST:PORT,...")
    p.add_argument("--validate", default="", help="validation service per DPU: HOST:PORT,...")
    p.add_argument("--modes", default="host,offload")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="summary path ({rank} -> rank)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.augment = [a for a in args.augment.split(",") if a]
    args.validate = [a for a in args.validate.split(",") if a]
    if any(m not in ("host", "offload") for m in args.modes) or not args.modes:
        p.error("--modes must be a comma list of host, offload")
    if "offload" in args.modes and not (args.augment and args.validate):
        p.error("the offload mode needs --augment and --validate addresses")
    return args


def run_mode(mode: str, args, rank: int, world: int, progress: bool) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dosa.offload.models import build_model, state_arrays
    from dosa.offload.evaluate import evaluate_snapshot
    from examples.train_offload import default_model_spec
    from host_lib.offload import LocalLoader, OffloadedLoader, OffloadedValidator, OffloadFallbackWarning

    my_spec = args.shard_spec.replace("{rank}", str(rank))
    val_spec = args.shard_spec.replace("{rank}", "0")  # every shard holds the same validation split
    spec = default_model_spec(val_spec, hidden=(args.hidden,))
    torch.manual_seed(args.seed)
    model = build_model(spec)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    validator = None
    if mode == "offload":
        dpu = rank % len(args.augment)  # host i is served by DPU i mod #DPUs
        loader = OffloadedLoader(args.augment[dpu], dataset=my_spec, batch_size=args.batch_size,
                                 seed=args.seed, drop_last=True, fallback=True, timeout=60.0)
        if rank == 0:
            validator = OffloadedValidator(args.validate[0], dataset=val_spec, fallback=True,
                                           timeout=60.0)
    else:
        loader = LocalLoader(my_spec, args.batch_size, args.seed, drop_last=True)
    losses, epoch_seconds, metrics, handles = [], [], [], []
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for epoch in range(args.epochs):
                t0 = time.perf_counter()
                loader.set_epoch(epoch)
                ddp.train()
                for x, y in loader:
                    opt.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(ddp(x), y)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.item()))
                if rank == 0:
                    if validator is not None:
                        handles.append(validator.submit(model, epoch, spec=spec))
                    else:
                        metrics.append(evaluate_snapshot(spec, state_arrays(model), val_spec))
                epoch_seconds.append(time.perf_counter() - t0)
                if progress:
                    print(f"[{mode}] epoch {epoch + 1}/{args.epochs} loss "
                          f"{np.mean(losses[-len(loader):]):.4f} ({epoch_seconds[-1]:.2f} s)", flush=True)
            for h in handles:
                metrics.append(h.result(timeout=300))
            total = time.perf_counter() - start
        finally:
            if validator is not None:
                validator.close()
            if mode == "offload":
                loader.close()
    return {
        "mode": mode, "rank": rank, "world_size": world, "dataset": my_spec, "model": spec,
        "epochs": args.epochs, "steps_per_epoch": len(loader), "batch_size": args.batch_size,
        "loss": losses, "epoch_seconds": epoch_seconds, "total_seconds": total,
        "val_accuracy_per_epoch": [m["accuracy"] for m in metrics],
        "val_loss_per_epoch": [m["loss"] for m in metrics],
        "remote_batches": getattr(loader, "remote_batches", 0),
        "local_batches": getattr(loader, "local_batches", len(loader) * args.epochs),
        "loader_fell_back": bool(getattr(loader, "fell_back", False)),
        "validator_fell_back": bool(validator is not None and validator.fell_back),
        "validated_on_dpu": sum(1 for h in handles if not h.local),
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, OffloadFallbackWarning)][:5],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("DOSA_PG_TIMEOUT", "120"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        runs = [run_mode(m, args, rank, world, progress=rank == 0 and not args.quiet)
                for m in args.modes]
    finally:
        gc.collect()  # the DDP modules (in reference cycles) are freed now, not at interpreter exit
        dist.destroy_process_group()
    with open(args.json.replace("{rank}", str(rank)), "w") as f:
        json.dump({"runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
