"""Which jobs a DPU worker serves: the sources it learns them from (the dataplane's maps, the
control plane's registry), how often it asks, and the completions it parks for a job it does not
serve yet.
"""
from __future__ import annotations

import collections
import logging
import time

from dosa.errors import DosaError
from dosa.job import JobConfig

from . import policy

log = logging.getLogger("dosa.dpu")


def jobs_from_maps(maps, my_addr: tuple[str, int], density: float = 0.01) -> list[JobConfig]:
    """JobConfigs of every job installed in the dataplane, built from its maps alone (jobs +
    flows): what a worker started without a job file serves. Other DPUs' addresses are not in this
    DPU's maps and a worker never needs them: they are left as 0.0.0.0; this DPU's own address
    sits at its index, which is how the worker finds which partitions it owns. Jobs whose workers
    have not all joined come with None hosts."""
    from dataplane.maps import MODE_GTOPK

    out = []
    for j in maps.jobs():
        flows = maps.flows(j.job_id)
        hosts = [flows.get((j.job_id, w)) for w in range(j.workers)]
        dpus = [("0.0.0.0", my_addr[1])] * j.num_dpus
        dpus[j.dpu_index] = my_addr
        out.append(JobConfig(job_id=j.job_id, numel=j.numel, hosts=hosts, dpus=dpus,
                             partition_size=j.partition_size,
                             mode="gtopk" if j.mode == MODE_GTOPK else "sum", density=density,
                             scale_exp=j.scale_exp, slots=max(1, j.slots)))
    return out


def control_discovery(control, bind=None):
    """A discover() over the control plane's registry: every job it knows, the incomplete ones
    too (a worker keeps serving a job whose members leave at its end); None when it cannot be
    asked this time (the worker then changes nothing)."""
    from dosa.join import request

    def discover():
        try:
            views = request(control, "GET", "/v1/jobs", timeout=2.0).get("jobs", [])
        except DosaError as e:
            log.warning("%s", e)
            return None
        out = []
        for v in views:
            try:
                out.append(JobConfig.from_view(v, partial=True))
            except DosaError as e:
                log.warning("%s", e)
        return out

    return discover


def maps_and_control(maps, bind, control, density: float):
    """XDP mode with a control plane: the maps' jobs, overridden by the control plane's fuller
    view (a job created through another DPU's control plane is in this DPU's maps but not in this
    control plane's registry). Read in that order: the other way round, a join landing between the
    two reads would let the maps' partial view win."""
    from_control = control_discovery(control, bind)

    def discover():
        got = {j.job_id: j for j in jobs_from_maps(maps, bind, density)}
        ctl = from_control()
        if ctl is None:  # unreachable this time: do not take the maps' view for the truth
            return None
        got.update({j.job_id: j for j in ctl})
        return list(got.values())

    return discover


class Discovery:
    """Polls ``discover`` (``f() -> [JobConfig] | None``) every DISCOVER_EVERY_S, at once (at most
    every DISCOVER_URGENT_S) when asked urgently; keeps the completions of jobs not served yet."""

    def __init__(self, discover):
        self.discover = discover
        self._next = 0.0
        self.parked: dict[int, tuple[float, list]] = {}
        self.stats = collections.Counter()

    def poll(self, urgent: bool = False) -> list[JobConfig] | None:
        """The source's jobs when it is time to ask (None otherwise, or when it cannot answer)."""
        now = time.monotonic()
        if self.discover is None:
            return None
        wait = policy.DISCOVER_EVERY_S - policy.DISCOVER_URGENT_S if urgent else 0.0
        if now < self._next - wait:
            return None
        self._next = now + policy.DISCOVER_EVERY_S
        return self.discover()

    def park(self, records: list) -> None:
        """Keep completions (job, partition, round, scale) of jobs not served yet (PARKED_S);
        beyond PARKED_MAX a job's are counted lost."""
        for rec in records:
            since, kept = self.parked.setdefault(int(rec[0]), (time.monotonic(), []))
            if len(kept) < policy.PARKED_MAX:
                kept.append(rec)
            else:
                self.stats["completion_unknown"] += 1

    def unpark(self, served) -> list:
        """The parked completions of jobs in ``served`` (to handle now); those parked too long
        are dropped and counted."""
        now, out = time.monotonic(), []
        for job_id in list(self.parked):
            since, recs = self.parked[job_id]
            if job_id in served:
                del self.parked[job_id]
                self.stats["completion_parked"] += len(recs)
                out += recs
            elif now - since > policy.PARKED_S:
                del self.parked[job_id]
                self.stats["completion_unknown"] += len(recs)
        return out
