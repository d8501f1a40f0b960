"""Train a small MLP (or CNN, ``--model cnn``) on scikit-learn's digits with DDP over Gloo, gradients reduced either by dosa
(``--comm dosa``: the DDP hook of ``host_lib.torch_hook``) or by Gloo's dense allreduce
(``--comm dense``). The dataset ships with scikit-learn: nothing is downloaded.

Launched like any torchrun script: it reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
LOCAL_RANK) from the environment; ``dosa testbed run`` sets them plus the DOSA_* variables the hook
uses to join the job. Without them it runs as a single process (world size 1).

    torchrun --nproc-per-node 4 -m examples.train_digits --comm dense --epochs 20
    dosa testbed run -- python -m examples.train_digits --comm dosa --density 0.01 --json out-{rank}.json

Each rank records its loss per step and the test accuracy (the replicas are identical, which the
script checks at the end). On nodes of several ranks (``dosa testbed run --ranks-per-node L``,
torchrun's LOCAL_WORLD_SIZE) the hook reduces inside the node first (host_lib.hook_node);
``--ranks-per-node 1`` keeps every rank a dosa worker of its own. Every rank also reads its
network interface's counters (``/proc/net/dev``, rx + tx, every header) over the training steps:
on a testbed node that is the node's link, shared by its ranks. With ``--json PATH`` every rank writes ``{"runs": [summary, ...]}`` (``{rank}`` in PATH is replaced by the rank; without it only rank 0 writes).
Bytes on the wire per step, per host: dosa reports the client's counted UDP payload bytes sent and
received; dense reports the ring-allreduce volume ``2 * (W-1)/W * model bytes`` sent (and as much
received) per host, Gloo's own algorithm does not expose a counter.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dosa.job import RESULT_MODES

log = logging.getLogger("dosa.train_digits")


class DigitsMLP(nn.Module):
    """64 -> hidden -> hidden -> 10. With hidden=128: 26,122 parameters, so 1% density is ~260
    entries per step (two dosa packets)."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class DigitsCNN(nn.Module):
    """conv 1->16 -> conv 16->32 -> pool -> fc 512 -> 128 -> 10 on the 8x8 images: 71,754
    parameters, most in the first fully connected layer."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x.view(-1, 1, 8, 8))))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(kind: str, hidden: int) -> nn.Module:
    return DigitsCNN(hidden) if kind == "cnn" else DigitsMLP(hidden)


def link_bytes(iface: str | None = None) -> int:
    """rx + tx bytes of this namespace's interface (DOSA_IFACE, else eth0) so far; 0 without one."""
    iface = iface or os.environ.get("DOSA_IFACE") or "eth0"
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    v = rest.split()
                    return int(v[0]) + int(v[8])
    except OSError:
        pass
    return 0


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """Digits (1797 8x8 images), scaled to [0, 1], stratified train/test split with a fixed seed so
    every rank and every run sees the same split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)


def shard_batches(n: int, rank: int, world: int, batch: int, epoch: int, seed: int):
    """This rank's minibatches of one epoch: a permutation shared by all ranks (seeded by epoch),
    strided by rank and cut to the same length on every rank, so every rank runs the same number of
    steps (DDP needs that; so do dosa rounds)."""
    perm = np.random.default_rng(seed * 1000 + epoch).permutation(n)
    per_rank = n // world
    mine = perm[rank:per_rank * world:world]
    steps = per_rank // batch
    return [torch.from_numpy(mine[i * batch:(i + 1) * batch]) for i in range(steps)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comm", default="dosa",
                   help="dosa, dense, or a comma list (e.g. dosa,dense: both runs in one launch)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=0, help="dense steps before dosa (hook)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hook-momentum", action="store_true",
                   help="dosa: apply --momentum in the hook (DGC momentum correction), not in SGD")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="mlp: 64-128-128-10 (26k parameters); cnn: two convolutions and two fully "
                        "connected layers (72k)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="dosa: ranks that reduce inside their node first (default: torchrun's "
                        "LOCAL_WORLD_SIZE across several nodes; 1: every rank a dosa worker)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partition-size", type=int, default=None,
                   help="dosa job partition size (control plane jobs; smaller spreads over more DPUs)")
    p.add_argument("--mode", choices=RESULT_MODES, default=None,
                   help="dosa job result mode (control plane jobs): exact sums, or per partition only "
                        "the k largest sums (what did not come back returns to the residual)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size (default DDP's 25 MB: this model fits one bucket)")
    p.add_argument("--json", metavar="PATH", help="write the summary here ({rank} -> rank)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")
    args = p.parse_args(argv)
    args.comm = [c.strip() for c in args.comm.split(",") if c.strip()]
    if not args.comm or any(c not in ("dosa", "dense") for c in args.comm):
        p.error("--comm must be dosa, dense or a comma list of them")
    if not 0 < args.density <= 1 or args.warmup_steps < 0:
        p.error("--density must be in (0, 1] and --warmup-steps >= 0")
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        p.error("--epochs and --batch-size must be >= 1 and --lr > 0")
    return args


def _init_process_group() -> tuple[int, int]:
    if "WORLD_SIZE" not in os.environ:  # plain `python -m ...`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("DOSA_PG_TIMEOUT", "120"))))
    return dist.get_rank(), dist.get_world_size()


def _job_options(args) -> dict | None:
    """Job shape for a job created through the control plane (ignored with DOSA_JOB_CONFIG)."""
    opts = {}
    if args.partition_size:
        opts["partition_size"] = args.partition_size
    if args.mode:
        opts["mode"] = args.mode
        opts["density"] = args.density  # gtopk: k = ceil(density * partition length) per partition
    return opts or None


def ring_allreduce_bytes(model_bytes: int, world: int) -> float:
    """Bytes one host sends (and as many it receives) in a ring allreduce of ``model_bytes``."""
    return 2 * (world - 1) / world * model_bytes if world > 1 else 0.0


def train_one(comm: str, args, rank: int, world: int, data, progress: bool) -> dict:
    """One training run (fresh model, same seed) with ``comm`` reducing the gradients."""
    xtr, ytr, xte, yte = data
    torch.manual_seed(args.seed)
    model = DDP(make_model(args.model, args.hidden), bucket_cap_mb=args.bucket_cap_mb)
    nparams = sum(p.numel() for p in model.parameters())
    state = None
    if comm == "dosa":
        from host_lib.torch_hook import DosaHookState, dosa_hook
        state = DosaHookState(density=args.density, dense_warmup_steps=args.warmup_steps,
                              momentum=args.momentum if args.hook_momentum else 0.0,
                              job_options=_job_options(args), ranks_per_node=args.ranks_per_node)
        model.register_comm_hook(state, dosa_hook)
    hook_has_momentum = state is not None and state.momentum > 0
    opt = torch.optim.SGD(model.parameters(), lr=args.lr,
                          momentum=0.0 if hook_has_momentum else args.momentum)
    steps_per_epoch = len(shard_batches(len(xtr), rank, world, args.batch_size, 0, args.seed))
    # Cosine decay to 0: the last epochs settle instead of bouncing around, so one run's final
    # accuracy is a fair number to compare (the test set has only 360 images: 1 point = 3.6 images).
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.epochs * steps_per_epoch))

    losses: list[float] = []
    step_times: list[float] = []
    acc_per_epoch: list[float] = []
    link = 0
    try:
        for epoch in range(args.epochs):
            model.train()
            link0 = link_bytes()
            for idx in shard_batches(len(xtr), rank, world, args.batch_size, epoch, args.seed):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
                sched.step()
                step_times.append(time.perf_counter() - t0)
                losses.append(float(loss.item()))
            link += link_bytes() - link0
            acc = evaluate(model.module, xte, yte)
            acc_per_epoch.append(acc)
            if progress:
                print(f"[{comm}] epoch {epoch + 1}/{args.epochs} loss {np.mean(losses[-steps_per_epoch:]):.4f} "
                      f"test acc {acc * 100:.2f}%", flush=True)

        # Replicas must be identical (same averaged gradient everywhere): check it, it is cheap.
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        digest = torch.stack([flat.sum(), flat.abs().sum()])
        gathered = [torch.zeros_like(digest) for _ in range(world)]
        dist.all_gather(gathered, digest)
        consistent = all(torch.equal(g, gathered[0]) for g in gathered)
    finally:
        if state is not None:
            state.close()

    steps = len(losses)
    model_bytes = nparams * 4
    ring = ring_allreduce_bytes(model_bytes, world)
    if state is not None:
        hs = state.stats.as_dict()
        # dosa rounds: the client's counters; warm-up / fallback steps went through Gloo: ring volume
        dense_steps = hs["dense_steps"]
        sent_per_step = (hs["bytes_sent"] + dense_steps * ring) / steps if steps else 0.0
        recv_per_step = (hs["bytes_received"] + dense_steps * ring) / steps if steps else 0.0
        bytes_method = ("dosa client counters (UDP payload bytes this host sent / received)"
                        + (f" + {dense_steps} dense warm-up/fallback steps at the ring volume"
                           if dense_steps else ""))
    else:
        hs = None
        sent_per_step = recv_per_step = ring
        bytes_method = "ring allreduce volume: 2*(W-1)/W * model bytes sent, as many received, per host"
    return {
        "comm": comm, "rank": rank, "world_size": world,
        "density": args.density if state else 1.0, "warmup_steps": args.warmup_steps if state else 0,
        "epochs": args.epochs, "steps": steps, "batch_size": args.batch_size, "lr": args.lr,
        "momentum": args.momentum, "hook_momentum": hook_has_momentum,
        "params": nparams, "model_bytes": model_bytes,
        "loss": losses, "test_accuracy": acc_per_epoch[-1], "test_accuracy_per_epoch": acc_per_epoch,
        "time_per_step_s": float(np.mean(step_times)) if step_times else 0.0,
        "time_per_step_median_s": float(np.median(step_times)) if step_times else 0.0,
        "bytes_sent_per_step": sent_per_step, "bytes_received_per_step": recv_per_step,
        "bytes_per_step": sent_per_step + recv_per_step, "bytes_method": bytes_method,
        "replicas_consistent": consistent, "hook": hs, "model": args.model,
        "ranks_per_node": (state.node.layout.per_node if state is not None and state.node is not None
                           else 1),
        "link_bytes_per_step": link / steps if steps else 0.0,
        "link_bytes_method": "rx + tx of this rank's interface (/proc/net/dev) over the training steps; "
                             "on a testbed node, the node's link, which its ranks share",
    }


def train(args) -> list[dict]:
    """Every run of ``args.comm`` (comma list) in this one process group, in order."""
    rank, world = _init_process_group()
    torch.set_num_threads(1)  # several ranks share a couple of cores
    data = load_digits_split(args.seed)
    try:
        return [train_one(c, args, rank, world, data, progress=rank == 0 and not args.quiet)
                for c in args.comm]
    finally:
        gc.collect()  # the DDP modules (in reference cycles) are freed now, not at interpreter exit
        dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("DOSA_LOG", "WARNING"))
    runs = train(args)
    rank = runs[0]["rank"]
    if args.json and ("{rank}" in args.json or rank == 0):
        path = args.json.replace("{rank}", str(rank))
        with open(path, "w") as f:
            json.dump({"runs": runs}, f)
    if rank == 0:
        for r in runs:
            print(f"[{r['comm']}] done: test accuracy {r['test_accuracy'] * 100:.2f}%, "
                  f"{r['time_per_step_s'] * 1e3:.2f} ms/step, "
                  f"{r['bytes_per_step']:.0f} B/step on the wire per host, "
                  f"replicas consistent: {r['replicas_consistent']}", flush=True)
    return 0 if all(r["replicas_consistent"] for r in runs) else 1


if __name__ == "__main__":
    code = main()
    # Results are written and the process group destroyed: skip the interpreter's teardown, in
    # which libtorch/Gloo's threads now and then crash a finished rank (SIGSEGV/SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
