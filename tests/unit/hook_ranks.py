"""One rank of tests/unit/test_torch_hook_ranks.py: trains copies of one small model under DDP with
the dosa hook, one job per configuration, and writes its parameters and the hook's stats as JSON.

argv: OUT_JSON then one ``name:dtype:overlap:job_config`` per configuration."""
from __future__ import annotations

import copy
import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from host_lib.client import AggregationClient
from host_lib.torch_hook import DosaHookState, dosa_hook
from dosa.job import JobConfig


def main() -> None:
    out, configs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    report = {}
    for spec in configs:
        name, dtype, overlap, cfg = spec.split(":", 3)
        model = copy.deepcopy(base).to(getattr(torch, dtype))
        ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets, several partitions each
        job = JobConfig.load(cfg)
        state = DosaHookState(client_factory=lambda n, job=job: AggregationClient(job, worker_id=rank, timeout=20),
                              density=0.05, overlap=overlap == "1", fallback=False)
        ddp.register_comm_hook(state, dosa_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        losses = []
        for x, y in data * 2:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x.to(model[0].weight.dtype)).float(), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        state.close()
        report[name] = {"params": [p.detach().float().reshape(-1).tolist() for p in ddp.parameters()],
                        "stats": state.stats.as_dict(), "losses": losses}
        del ddp, opt, state  # DDP's reducer holds the group: freed now, not at interpreter exit
    with open(out, "w") as f:
        json.dump(report, f)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
