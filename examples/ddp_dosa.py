"""A plain DDP training script with the dosa hook, as a cluster would launch it with torchrun.

    dosa testbed run --torchrun -- examples/ddp_dosa.py --steps 20

Nothing here knows about the testbed: torchrun sets RANK/WORLD_SIZE/MASTER_*, ``dosa testbed run``
adds the DOSA_* variables naming the job, and ``DosaHookState()`` joins it. Each rank prints one JSON
line (its torchrun identity, the hook's statistics, the loss, and whether all replicas are identical).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from host_lib.torch_hook import DosaHookState, dosa_hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.5)  # several buckets (DDP's first one holds up to 1 MB)
    state = DosaHookState(density=args.density, fallback=False)
    ddp.register_comm_hook(state, dosa_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=g)
        y = (x @ w).argmax(1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    state.close()
    flat = torch.cat([p.detach().float().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    record = json.dumps({
        "rank": rank, "world_size": world, "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "group_rank": os.environ.get("GROUP_RANK"), "master_addr": os.environ.get("MASTER_ADDR"),
        "dosa_host_addr": os.environ.get("DOSA_HOST_ADDR"), "first_loss": losses[0], "last_loss": losses[-1],
        "replicas_identical": all(torch.equal(flat, o) for o in gathered),
        "stats": {k: v for k, v in state.stats.as_dict().items() if not isinstance(v, list)}})
    # one write of the whole line: a node's ranks share torchrun's stdout, and print() may write the
    # text and its newline separately (unbuffered stdout), so two ranks' records could share a line;
    # a pipe's write of up to PIPE_BUF (4096) bytes is never interleaved with another's
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (record + "\n").encode())
    # DDP's reducer holds the process group and the hook's state: drop it while the interpreter is
    # whole, so the group's Gloo threads are joined by destroy_process_group, not by a destructor
    # at interpreter exit (which aborted 1 run in 6: "terminate called without an active exception")
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
