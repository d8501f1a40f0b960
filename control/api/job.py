"""A job as the control plane's registry keeps it: its shape, its DPUs and the members joined so far.

:meth:`Job.view` is the JSON every endpoint answers with (``POST /v1/join``, ``GET /v1/jobs``...);
hosts and DPU workers read it back with ``JobConfig.from_view``."""
from __future__ import annotations

from dataclasses import dataclass, field

from dosa import wire

MODES = ("sum", "gtopk")


@dataclass
class Job:
    job_id: int
    workers: int
    numel: int
    dpus: list  # [(address, data port)], index = DPU index
    partition_size: int = wire.DEFAULT_PARTITION_SIZE
    scale_exp: int = 16
    mode: str = "sum"
    density: float = 0.01
    port: int = wire.DEFAULT_PORT
    members: dict = field(default_factory=dict)  # worker_id -> (address, port)

    def view(self, worker_id: int | None = None) -> dict:
        pm = wire.PartitionMap(self.numel, self.partition_size, len(self.dpus))
        d = {"job_id": self.job_id, "workers": self.workers, "numel": self.numel,
             "partition_size": self.partition_size, "num_partitions": pm.num_partitions,
             "scale_exp": self.scale_exp, "mode": self.mode, "density": self.density, "port": self.port,
             "dpus": [{"index": i, "address": a, "port": p} for i, (a, p) in enumerate(self.dpus)],
             "hosts": [{"worker_id": w, "address": a, "port": p} for w, (a, p) in sorted(self.members.items())],
             "complete": len(self.members) == self.workers}
        if worker_id is not None:
            d["worker_id"] = worker_id
        return d

    def body(self) -> dict:
        """The job as every DPU's registry keeps it (the view hosts get, plus ``num_dpus``): a DPU
        worker asking its own control plane must learn density, mode, DPUs and hosts."""
        body = self.view()
        for k in ("complete", "num_partitions", "worker_id"):
            body.pop(k, None)
        body["num_dpus"] = len(self.dpus)
        return body

    def dpu_index(self, address: str) -> int | None:
        """Index of the DPU at ``address`` in this job, None when it is not one of the job's."""
        for i, (a, _) in enumerate(self.dpus):
            if a == address:
                return i
        return None
