"""One rank of :func:`benchmarks.plan.costs.measure_gloo`: Gloo's ring allreduce and allgather on
loopback, timed by this process's CPU (what a rank pays: its TCP, its copies, its additions).

    python -m benchmarks.plan.gloo_probe RANK WORLD PORT NUMEL ROUNDS

Prints one JSON line: CPU seconds a round of each collective (the median of ROUNDS)."""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
from datetime import timedelta


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str]) -> int:
    rank, world, port, numel, rounds = map(int, argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    x = torch.ones(numel, dtype=torch.float32)
    part = torch.ones(numel // world, dtype=torch.int32)
    out = torch.empty(part.numel() * world, dtype=torch.int32)
    ring, ag = [], []
    for i in range(rounds + 1):
        dist.barrier()
        c0 = _cpu()
        dist.all_reduce(x)
        c1 = _cpu()
        dist.barrier()
        c2 = _cpu()
        gather(out, part)
        c3 = _cpu()
        if i:
            ring.append(c1 - c0)
            ag.append(c3 - c2)
    dist.destroy_process_group()
    print(json.dumps({"ring_cpu_s": statistics.median(ring), "allgather_cpu_s": statistics.median(ag)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
