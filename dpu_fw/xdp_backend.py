"""The DPU worker's state backend in XDP mode: the dataplane's pinned maps (dataplane.maps).

The XDP program merged the data; this adapter gives the worker the same view the userspace
MergeState gives (base round, completeness, missing workers, the zero-copy buffer, advance), so
dpu_fw.worker has one code path for both modes. Because everything lives in pinned maps, a worker
that is killed and restarted re-opens them and continues: completions it never consumed stay in the
ring buffer, results it never sent are rebuilt from the (not yet cleared) buffer.
"""
from __future__ import annotations

import numpy as np

from dosa.errors import DosaError
from dosa.job import JobConfig

from . import _merge


def open_maps(instance: str | None):
    try:
        from dataplane.maps import DataplaneMaps
    except ImportError as e:
        raise DosaError(f"XDP mode needs the dataplane package ({e}); use --mode userspace") from None
    return DataplaneMaps.open(instance or "default")


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
        # a worker that has not joined yet (or has left) is None: the DPU worker starts serving a
        # job once it is complete and keeps serving it while its members leave at the end
        hosts = [flows.get((j.job_id, w)) for w in range(j.workers)]
        dpus = [("0.0.0.0", my_addr[1])] * j.num_dpus
        dpus[j.dpu_index] = my_addr
        out.append(JobConfig(job_id=j.job_id, numel=j.numel, hosts=hosts,
                             dpus=dpus, partition_size=j.partition_size,
                             mode="gtopk" if j.mode == MODE_GTOPK else "sum", density=density,
                             scale_exp=j.scale_exp, slots=max(1, j.slots)))
    return out


class XdpBackend:
    def __init__(self, maps, job: JobConfig, owned: np.ndarray):
        self.maps = maps
        self.job_id = job.job_id
        self.owned = owned
        info = maps.job_info(job.job_id)
        if info is None:
            raise DosaError(f"job {job.job_id} is not installed in the dataplane; install it with "
                            "the control plane first")
        if (info.numel, info.partition_size, info.workers, info.num_dpus) != \
                (job.numel, job.partition_size, job.workers, len(job.dpus)):
            raise DosaError(f"job {job.job_id} in the dataplane (numel {info.numel}, partition size "
                            f"{info.partition_size}, {info.workers} workers, {info.num_dpus} DPUs) "
                            "differs from the job config given to the worker")
        if info.num_owned and info.slots != job.slots_on(info.dpu_index):
            # hosts pace their window by the config's slots: a different count here would let a
            # slot's next occupant complete before every host has the previous one's result
            raise DosaError(f"job {job.job_id} has {info.slots} aggregation slots in the dataplane "
                            f"but {job.slots_on(info.dpu_index)} in the job config given to the worker")
        self.info = info
        from dataplane import layout

        self.bias = layout.SCALE_TAG_BIAS
        # per local partition, as Python ints: its slot, its occupant number in the slot within a
        # round, and the slot's occupants per round (JobInfo.slot / gen / per_round, precomputed:
        # the completion path asks for them several times per completion)
        S = info.slots
        self._slot = [lp % S for lp in range(len(owned))] if S else []
        self._k = [lp // S for lp in range(len(owned))] if S else []
        self._per_round = [info.per_round(lp % S) for lp in range(len(owned))] if S else []
        self._base_gen = maps.pstate["base_gen"]  # live views of the pinned map
        self._scale_tag = maps.pstate["scale_tag"]

    # local partition lp aggregates in slot lp % slots; (lp, rnd) is that slot's occupant number
    # rnd * per_round + lp // slots (dataplane.maps.JobInfo, docs/dataplane.md *Slots*)
    def _ps(self, lp: int):
        return self.maps.pstate[self.info.pstate_off + self._slot[lp]]

    def _gen(self, lp: int, rnd: int) -> int:
        return rnd * self._per_round[lp] + self._k[lp]

    def _base(self, lp: int) -> int:
        return int(self._base_gen[self.info.pstate_off + self._slot[lp]])

    def is_next(self, lp: int, rnd: int) -> bool:
        """(lp, rnd) is the occupant after its slot's base: completing it releases the base."""
        return self._gen(lp, rnd) == self._base(lp) + 1

    def previous(self, lp: int, rnd: int) -> tuple[int, int] | None:
        """The occupant of lp's slot before (lp, rnd), as (local partition, round)."""
        g = self._gen(lp, rnd)
        if g == 0:
            return None
        r, k = divmod(g - 1, self._per_round[lp])
        return self._slot[lp] + k * self.info.slots, r

    def in_window(self, lp: int, rnd: int) -> bool:
        b = self._base(lp)
        return b <= self._gen(lp, rnd) <= b + 1

    def is_complete(self, lp: int, rnd: int) -> bool:
        return self.in_window(lp, rnd) and \
            int(self._ps(lp)["workers_done"][self._gen(lp, rnd) & 1]) >= self.info.workers

    def missing_workers(self, lp: int, rnd: int) -> list[int]:
        ws = self.maps.worker_state(self.job_id, int(self.owned[lp]), rnd)
        total = ws["total"].astype(np.int64)
        missing = (total == 0) | (ws["received"].astype(np.int64) < total)
        return np.flatnonzero(missing).tolist()

    def buffer(self, lp: int, rnd: int) -> np.ndarray:
        return self.maps.buffer(self.job_id, int(self.owned[lp]), rnd, job=self.info)

    def touched(self, lp: int, rnd: int) -> tuple[np.ndarray, int] | None:
        """The buffer's touched list (uint16 view, count; DataplaneMaps.touched): the offsets of
        its non-zeros unless the count exceeds the list's capacity; None when the job has none."""
        return self.maps.touched(self.job_id, int(self.owned[lp]), rnd, job=self.info)

    def scale_exp(self, lp: int, rnd: int) -> int:
        tag = int(self._scale_tag[self.info.pstate_off + self._slot[lp], self._gen(lp, rnd) & 1])
        return tag - self.bias if tag else 0

    def advance(self, lp: int, rnd: int, nonzero, prev: tuple[int, int] | None = None) -> None:
        """``nonzero``: the global indices (u32) that were non-zero in the occupant being cleared
        (``prev``, the one before (lp, rnd) in its slot, computed when not given; the worker
        extracted them for its result): only those entries are zeroed (one compiled loop), not the
        whole buffer (None, e.g. after a restart lost the shadow copy: the whole buffer)."""
        clear = None
        if nonzero is not None:
            prev = self.previous(lp, rnd) if prev is None else prev
            if prev is not None:
                base = int(self.owned[prev[0]]) * self.info.partition_size
                idx = np.ascontiguousarray(nonzero, np.uint32)

                def clear(buf):
                    _merge.clear_indices(buf, idx, base)
        self.maps.advance(self.job_id, int(self.owned[lp]), rnd, None, job=self.info, clear=clear)

    def incomplete(self):
        """([(local partition, round, worker, partial)] for every worker that has not delivered its
        whole contribution to an occupant some other workers have delivered whole, [(local
        partition, round, worker)] for those other workers): the NACK scan's view
        (dpu_worker.JobRuntime.nack_scan); partial: some of its packets are in."""
        j = self.info
        S, W = j.slots, j.workers
        if not S:
            return [], []
        ps = self.maps.pstate[j.pstate_off:j.pstate_off + S]
        done = ps["workers_done"].astype(np.int64)
        cand = np.argwhere((done > 0) & (done < W))
        if not len(cand):
            return [], []
        base = ps["base_gen"].astype(np.int64)
        ws = self.maps.wstate[j.wstate_off:j.wstate_off + S * 2 * W].reshape(S, 2, W)
        cs, cp = cand[:, 0], cand[:, 1]
        rec = ws["received"][cs, cp].astype(np.int64)  # (candidates, W)
        tot = ws["total"][cs, cp].astype(np.int64)
        whole = (tot > 0) & (rec >= tot)
        occ = {}

        def occupant(i: int) -> tuple[int, int]:
            o = occ.get(i)
            if o is None:
                s, par = int(cs[i]), int(cp[i])
                g = int(base[s]) if (int(base[s]) & 1) == par else int(base[s]) + 1
                p, rnd = j.occupant(s, g)
                o = occ[i] = (p // j.num_dpus, rnd)
            return o

        ci, cw = np.nonzero(~whole)
        partial = (rec[ci, cw] > 0).tolist()
        missing = [(*occupant(i), w, part) for i, w, part in zip(ci.tolist(), cw.tolist(), partial)]
        di, dw = np.nonzero(whole)
        delivered = [(*occupant(i), w) for i, w in zip(di.tolist(), dw.tolist())]
        return missing, delivered

    def flush(self) -> None:
        pass
