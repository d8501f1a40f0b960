"""One rank of ``dosa bench train`` (benchmarks/train.py starts it on every testbed host, once per method).

A ~1.1M-parameter CNN on scikit-learn's digits, upscaled (the 1,797 8x8 images ship with
scikit-learn: no download), DDP over Gloo. Every method sees the same seed, split, shards, batches
and initial weights; they differ only in how gradients are averaged:

* ``gloo_dense``: DDP's own allreduce; SGD with momentum.
* ``dosa_sum`` / ``dosa_gtopk``: ``host_lib.torch_hook.dosa_hook`` (overlap, fast top-k, error
  feedback, DGC momentum correction in the encoder: SGD without momentum) through the DPU.
* ``gloo_sparse_allgather``: DGC over Gloo: the *same* encoder per bucket (top-k, error feedback,
  momentum correction, the same fixed point), every rank's entries allgathered and summed locally.
  Its updates equal ``dosa_sum``'s; only the transport differs.
* ``powersgd``: PyTorch's ``powerSGD_hook`` (rank-2 approximation with error feedback, warm start).

The training clock runs only while training (evaluation pauses it, on every rank, behind barriers).
Bytes per step are this rank's fabric interface counters (``/proc/net/dev`` of its namespace:
everything on the wire, headers included) over the training steps. Rank 0 writes the JSON record.
"""
# no `from __future__ import annotations`: DDP checks the hook annotations are real types
import argparse
import gc
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dosa.job import DEFAULT_SCALE_EXP
from host_lib.compress import target_k
from host_lib.encoder import RoundEncoder
from host_lib.hook_codec import next_scale_exp
from host_lib.hook_encoders import BucketEncoders

METHODS = ("dosa_sum", "dosa_gtopk", "gloo_dense", "gloo_sparse_allgather", "powersgd")
SPARSE = ("dosa_sum", "dosa_gtopk", "gloo_sparse_allgather")


class DigitsCNN(torch.nn.Module):
    """conv 1->32 -> conv 32->64 -> pool -> fc 64*(s/2)^2 -> 256 -> 10: 1.07M parameters at s=16,
    most of them in the first fully connected layer (communication-heavy, compute-light)."""

    def __init__(self, size: int):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.c2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.f1 = torch.nn.Linear(64 * (size // 2) ** 2, 256)
        self.f2 = torch.nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 2)
        return self.f2(F.relu(self.f1(x.flatten(1))))


def load_digits(size: int, seed: int):
    """(x_train, y_train, x_test, y_test): digits scaled to [0, 1], bilinearly upscaled to size x size,
    a stratified 80/20 split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - 0.3) / 0.35
    xtr, xte, ytr, yte = train_test_split(x.numpy(), d.target, test_size=0.2, random_state=seed,
                                          stratify=d.target)
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)


def fabric_bytes(iface: str = "eth0") -> int:
    """rx + tx bytes of ``iface`` in this network namespace (0 where it does not exist)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                v = rest.split()
                return int(v[0]) + int(v[8])
    return 0


class SparseAllgatherState:
    """DGC over Gloo: one RoundEncoder per bucket (the dosa hook's encoder and settings); the
    selected fixed-point entries of every rank are allgathered (padded to the selector's bound) and
    summed locally; the scale follows the dosa rule from the previous step's sums."""

    def __init__(self, density: float, momentum: float, scale_exp: int = DEFAULT_SCALE_EXP,
                 headroom: float = 2.0):
        self.density, self.momentum, self.headroom = density, momentum, headroom
        self.scale_exp = scale_exp
        self.encoders = BucketEncoders(density, "fast", momentum, True)
        self.max_abs: list[float] = []

    def encoder(self, bucket) -> RoundEncoder:
        """The dosa hook's encoder for this bucket (host_lib.hook_encoders: the same seeds, and
        residuals carried over DDP's bucket rebuild), so dosa_sum and this method make the same
        updates."""
        if bucket.index() == 0:
            self.encoders.new_step()
        return self.encoders.for_bucket(bucket, bucket.buffer(), dist.get_world_size(),
                                        dist.get_rank())[0]


def sparse_allgather_hook(state: SparseAllgatherState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size()
    if bucket.index() == 0 and state.max_abs:
        state.scale_exp = next_scale_exp(max(state.max_abs), world, state.headroom, state.scale_exp)
        state.max_abs = []
    buf = bucket.buffer()
    enc = state.encoder(bucket)
    s = state.scale_exp
    sent = enc.encode(buf, s)
    cap = int(target_k(buf.numel(), state.density) * 1.2) + 2
    # int32 index + int32 value: 8 bytes an entry, as DGC sends them (Gloo's allgather needs one
    # size on every rank, so each rank pads to the fast selector's bound, 1.2 k)
    packed = torch.full((2 * cap,), -1, dtype=torch.int32)
    packed[:len(sent)] = torch.from_numpy(sent.indices.astype(np.int32))
    packed[cap:cap + len(sent)] = torch.from_numpy(sent.values)
    out = torch.empty(world * 2 * cap, dtype=torch.int32)
    work = dist.all_gather_into_tensor(out, packed, async_op=True)

    def done(fut):
        g = out.view(world, 2, cap)
        idx, val = g[:, 0].reshape(-1), g[:, 1].reshape(-1)
        keep = idx >= 0
        total = torch.zeros(buf.numel(), dtype=torch.float64)
        total.index_add_(0, idx[keep].long(), val[keep].double())
        total = torch.ldexp(total, torch.tensor(-s, dtype=torch.float64))
        if keep.any():
            state.max_abs.append(float(total.abs().max()))
        buf.copy_((total / world).to(buf.dtype).view_as(buf))
        return buf

    return work.get_future().then(done)


def make_hook(method: str, ddp: DDP, args) -> object:
    """Register the method's comm hook; return its state (None for dense)."""
    if method in ("dosa_sum", "dosa_gtopk"):
        from host_lib.torch_hook import DosaHookState, dosa_hook

        opts = {"mode": method.split("_")[1], "density": args.result_density or args.density}
        if args.partition_size:
            opts["partition_size"] = args.partition_size
        state = DosaHookState(density=args.density, momentum=args.momentum, fallback=False,
                              dense_warmup_steps=args.warmup_steps, overlap=not args.no_overlap,
                              job_options=opts)
        ddp.register_comm_hook(state, dosa_hook)
        # join before the training clock starts, as Gloo's process group was set up before it
        state.connect(sum(p.numel() for p in ddp.module.parameters() if p.requires_grad))
        return state
    if method == "gloo_sparse_allgather":
        state = SparseAllgatherState(args.density, args.momentum)
        ddp.register_comm_hook(state, sparse_allgather_hook)
        return state
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                 start_powerSGD_iter=2, min_compression_rate=2, warm_start=True,
                                 random_seed=args.seed)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        return state
    return None


def evaluate(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return 100.0 * acc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="one rank of dosa bench train")
    ap.add_argument("--method", choices=METHODS + ("dosa_sum_blocking",), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: epochs)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--result-density", type=float, default=0.0,
                    help="the job's density: gtopk returns that fraction of each partition (0: --density)")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--partition-size", type=int, default=0)
    ap.add_argument("--powersgd-rank", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    method = args.method
    if method == "dosa_sum_blocking":
        method, args.no_overlap = "dosa_sum", True
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = load_digits(args.size, args.seed)
    torch.manual_seed(args.seed)
    model = DigitsCNN(args.size)
    numel = sum(p.numel() for p in model.parameters())
    # PowerSGD issues its second allreduce from the first one's callback: with several buckets on
    # Gloo, ranks can then issue collectives in different orders (measured: "collective mismatch"
    # aborts), so it gets one bucket (no overlap for it; that is how it runs on Gloo at all)
    ddp = DDP(model, bucket_cap_mb=1024.0 if method == "powersgd" else args.bucket_cap_mb)
    state = make_hook(method, ddp, args)
    sparse = method in SPARSE
    # sparse methods carry momentum in the encoder (DGC momentum correction), not in SGD
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.0 if sparse else args.momentum,
                          weight_decay=1e-4)
    per_step = world * args.batch_size
    steps_per_epoch = len(xtr) // per_step
    total = steps_per_epoch * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total)))
    curve, clock, step, step_times = [], 0.0, 0, []
    bytes0 = fabric_bytes()
    t_start = time.perf_counter()
    while step < total:
        perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(args.seed + step))
        for b in range(steps_per_epoch):
            if step >= total:
                break
            idx = perm[b * per_step:(b + 1) * per_step][rank::world]
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
            sched.step()
            dt = time.perf_counter() - t0
            clock += dt
            step_times.append(dt)
            step += 1
            if step % args.eval_every == 0 or step == total:
                dist.barrier()
                if rank == 0:
                    acc = evaluate(model, xte, yte)
                    curve.append({"step": step, "wall_s": round(clock, 4), "accuracy": round(acc, 3)})
                    print(f"[{method}] step {step}/{total} t={clock:.1f}s acc={acc:.2f}%", flush=True)
                dist.barrier()
    moved = fabric_bytes() - bytes0
    if hasattr(state, "close"):
        state.refresh_counters()
        state.close()
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        rec = {"method": args.method, "numel": numel, "steps": step, "world_size": world,
               "train_seconds": clock, "elapsed_seconds": time.perf_counter() - t_start,
               "step_seconds_median": float(np.median(step_times)),
               "final_accuracy": curve[-1]["accuracy"], "curve": curve,
               "bytes_per_step": moved / max(step, 1), "bytes_source": "rank 0 eth0 rx+tx (/proc/net/dev)",
               "replicas_identical": all(torch.equal(flat, o) for o in gathered)}
        if method in ("dosa_sum", "dosa_gtopk"):
            d = state.stats.as_dict()
            hs = d["hook_seconds_per_step"][1:]  # the first dosa step parks (it creates the client)
            rec["hook"] = {"overlap": not args.no_overlap, "rounds": d["dosa_rounds"],
                           "buckets_per_step": d["buckets_per_step"], "mean_density": d["mean_density"],
                           "hook_block_s_per_step": float(np.median(hs)) if hs else None,
                           "dosa_payload_bytes_per_step": (d["bytes_sent"] + d["bytes_received"]) / max(step, 1),
                           "retransmissions": d["retransmissions"],
                           "retransmit_causes": d["retransmit_causes"]}
        with open(args.out, "w") as f:
            json.dump(rec, f)
    del ddp  # DDP's reducer holds the process group: freed now, not at interpreter exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written and the process group destroyed: leave without the interpreter's
    # teardown, in which libtorch/Gloo's threads crashed ranks now and then after a complete run
    # (SIGSEGV/SIGABRT with every step done, seen in CI), failing a run whose results were in.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
