"""A training loop with the dataflow offload: augmentation and validation on the DPU's cores (or,
for comparison, on the host), the host trains on. What ``dosa offload train``, the offload demo and
``dosa bench offload`` run; the library it uses is host_lib.offload.

    python -m examples.train_offload --dataset digits --epochs 3 --offload --cpus 1
"""
from __future__ import annotations

import argparse
import time

from host_lib.offload import LocalLoader, OffloadedLoader, OffloadedValidator, OffloadServices
from dosa.offload.augment import AugmentConfig
from dosa.offload.datasets import load_dataset
from dosa.offload.evaluate import evaluate_snapshot
from dosa.offload.models import build_model, state_arrays


def default_model_spec(dataset: str, hidden=(128,)) -> dict:
    """An MLP spec fitting ``dataset``'s images (what the demo and the benchmark train)."""
    ds = load_dataset(dataset)
    return {"family": "mlp", "in_shape": list(ds.train.image_shape), "classes": ds.classes,
            "hidden": list(hidden)}


def run_training(dataset: str = "digits", model_spec: dict | None = None, epochs: int = 3,
                 batch_size: int = 64, seed: int = 0, lr: float = 0.05,
                 offload: "OffloadServices | bool | None" = None, cpus: str | None = None,
                 fallback: bool = True, augment: AugmentConfig | None = AugmentConfig(),
                 log=None) -> dict:
    """Train a model from dosa.offload.models with validation after every epoch.

    Args:
        offload: None/False: augmentation and validation on the host (LocalLoader + local
            evaluation). True: start the services (pinned to ``cpus``) for the run and stop them
            after. An OffloadServices already started: use its addresses.
        log: called with one line per epoch (e.g. ``print``), or None.

    Returns {"epochs": [{epoch, seconds, train_loss, val_loss, val_accuracy}], "seconds": total,
    "cpu_seconds": the host process's CPU time, "offloaded": bool, "fell_back": bool}. The total
    includes waiting for the last validation.
    """
    import torch  # here: ``dosa --help`` lists this command without importing torch

    if offload is True:
        with OffloadServices(cpus=cpus, datasets=[dataset]) as svc:
            return run_training(dataset, model_spec, epochs, batch_size, seed, lr, svc, cpus,
                                fallback, augment, log)
    spec = model_spec or default_model_spec(dataset)
    torch.manual_seed(seed)
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if offload:
        loader = OffloadedLoader(offload.augment_address, dataset=dataset, batch_size=batch_size,
                                 seed=seed, augment=augment, fallback=fallback)
        validator = OffloadedValidator(offload.validate_address, dataset=dataset, fallback=fallback)
    else:
        loader = LocalLoader(dataset, batch_size, seed, augment)
        validator = None
    rows, pending = [], []
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        for epoch in range(epochs):
            t0 = time.perf_counter()
            loader.set_epoch(epoch)
            model.train()
            loss_sum, n = 0.0, 0
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                loss_sum += loss.item() * len(y)
                n += len(y)
            row = {"epoch": epoch, "train_loss": loss_sum / max(n, 1)}
            if validator is not None:
                pending.append((row, validator.submit(model, epoch)))
            else:
                row.update(_local_metrics(model, spec, dataset))
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            if log and validator is None:
                log(_epoch_line(row))
        for row, handle in pending:
            m = handle.result(timeout=600)
            row.update(val_loss=m["loss"], val_accuracy=m["accuracy"])
            if log:
                log(_epoch_line(row))
    finally:
        if validator is not None:
            validator.close()
        if isinstance(loader, OffloadedLoader):
            loader.close()
    return {"epochs": rows, "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu_start, "offloaded": bool(offload),
            "fell_back": bool(offload) and (loader.fell_back or validator.fell_back)}


def _local_metrics(model, spec, dataset) -> dict:
    m = evaluate_snapshot(spec, state_arrays(model), dataset)
    return {"val_loss": m["loss"], "val_accuracy": m["accuracy"]}


def _epoch_line(row) -> str:
    return (f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}, "
            f"val accuracy {row['val_accuracy']:.3f} ({row['seconds']:.2f} s on the host)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="digits")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--offload", action="store_true", help="start the services and use them")
    p.add_argument("--cpus", default=None, help="CPUs for the services (with --offload)")


def run(args) -> int:
    r = run_training(args.dataset, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
                     lr=args.lr, offload=args.offload or None, cpus=args.cpus, log=print)
    print(f"total {r['seconds']:.2f} s" + (" (fell back to the host)" if r["fell_back"] else ""))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.train_offload", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
