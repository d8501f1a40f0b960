"""One rank of tests/unit/test_hook_node.py: 2 nodes x 2 ranks train copies of one small model under
DDP with the node-aware dosa hook (each local rank's slice job from a job file), and account for
every gradient: what the ranks put in, what the hook gave back, and what the node's ranks keep in
their residuals. Writes its parameters, the hook's stats and that account as JSON.

argv: OUT_JSON then one ``name:overlap:bucket_cap_mb:job_config_slice0,job_config_slice1`` per
configuration."""
from __future__ import annotations

import copy
import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dosa.job import JobConfig
from host_lib.client import AggregationClient
from host_lib.torch_hook import DosaHookState, dosa_hook


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(1))  # a one-entry bucket: one local rank has no slice
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x) * self.gain


def main() -> None:
    out, configs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Model()
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    report = {}
    for spec in configs:
        name, overlap, cap, cfgs = spec.split(":", 3)
        model = copy.deepcopy(base)
        names = {p.data_ptr(): n for n, p in model.named_parameters()}
        ddp = DDP(model, bucket_cap_mb=float(cap))
        jobs = [JobConfig.load(c) for c in cfgs.split(",")]
        state = DosaHookState(
            client_factory=lambda n: AggregationClient(jobs[state.node.layout.local],
                                                       worker_id=state.node.layout.node, timeout=20),
            density=0.05, overlap=overlap == "1", fallback=False, ranks_per_node=2)
        put = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
        got = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}

        def accounted(st, bucket, put=put, got=got):
            """dosa_hook, with the bucket's gradient added to ``put`` and its result (the average,
            times the world) to ``got``, parameter by parameter."""
            spans, off = [], 0
            for p in bucket.parameters():
                spans.append((names[p.data_ptr()], off, p.numel()))
                off += p.numel()
            flat = bucket.buffer().detach().double().clone()
            for n, o, k in spans:
                put[n] += flat[o:o + k]

            def back(fut):
                res = fut.value()
                for n, o, k in spans:
                    got[n] += res[o:o + k].double() * world
                return res
            return dosa_hook(st, bucket).then(back)

        ddp.register_comm_hook(state, accounted)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        losses = []
        for x, y in data * 2:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        # what this rank holds back: its slices' residuals, placed at their parameters
        kept = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
        node = state.node
        lay = node.layout
        for idx, enc in node.encoders.items():
            plan = node.plans[idx]
            layout = node.keys[idx][0]
            pos = plan.positions(lay.local, lay.per_node)
            flat = torch.zeros(plan.n, dtype=torch.float64)
            flat[pos] = enc.r.double()
            off = 0
            for ptr, shape in layout:
                k = int(torch.tensor(shape).prod()) if shape else 1
                kept[names[ptr]] += flat[off:off + k]
                off += k
        state.close()
        account = {}
        for n in put:
            total_put = put[n].clone()
            dist.all_reduce(total_put)
            total_kept = kept[n].clone()
            dist.all_reduce(total_kept)
            scale = float(total_put.abs().max()) or 1.0
            account[n] = float((total_put - got[n] - total_kept).abs().max()) / scale
        report[name] = {"params": [p.detach().reshape(-1).tolist() for p in ddp.parameters()],
                        "stats": state.stats.as_dict(), "losses": losses, "account": account,
                        "layout": [lay.node, lay.nodes, lay.local, lay.per_node],
                        "bucket_sizes": sorted(plan.n for plan in node.plans.values())}
        del ddp, opt, state  # DDP's reducer holds the group: freed now, not at interpreter exit
    with open(out, "w") as f:
        json.dump(report, f)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
