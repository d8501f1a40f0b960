"""One job's aggregation state on this DPU, in the dataplane's layout, whichever merges into it.

In XDP mode the state is the job's region of the dataplane's pinned maps (the XDP program merges
there; a restarted worker re-opens the same memory and continues). In userspace mode it is the
worker's own memory laid out the same way (dataplane/dosa_state.h: the same buffers, slot and
worker states), with one slot per owned partition, optionally file-backed (``state_dir``) so a
restarted worker continues too. So the completion path (dpu_fw/_completion.pyx), the NACK scan and
the answers are one code for both modes; only where the merge runs differs (the XDP program, or
dpu_fw/_softmerge.pyx).
"""
from __future__ import annotations

import os

import numpy as np

from dataplane import layout
from dataplane.maps import MODES, JobInfo
from dosa.errors import DosaError
from dosa.job import JobConfig


def userspace_info(job: JobConfig, dpu_index: int) -> JobInfo:
    """The geometry of ``job``'s state in a userspace worker: one slot per owned partition (a
    worker owns its partitions alone and its memory is not a fixed pool; the hosts still pace by
    the job's slots, which only makes the window smaller than the state)."""
    pm = job.pmap
    owned = len(pm.owned_by(dpu_index))
    stride = min(job.partition_size, job.numel)
    return JobInfo(job_id=job.job_id, workers=job.workers, partition_size=job.partition_size,
                   numel=job.numel, num_partitions=pm.num_partitions, dpu_index=dpu_index,
                   num_dpus=len(job.dpus), num_owned=owned, mode=MODES[job.mode], pool_off=0,
                   pstate_off=0, wstate_off=0, scale_exp=job.scale_exp, port=job.port,
                   stride=stride, slots=max(1, owned), list_cap=layout.touched_list_cap(stride))


class JobState:
    """``info``: the job's geometry (dataplane.maps.JobInfo); ``bufs``, ``pstate``, ``wstate``: its
    buffers (layout.BUF_DTYPE), slot states and worker states, as numpy views."""

    def __init__(self, info: JobInfo, bufs: np.ndarray, pstate: np.ndarray, wstate: np.ndarray,
                 files: list | None = None):
        self.info = info
        self.bufs, self.pstate, self.wstate = bufs, pstate, wstate
        self._files = files or []
        self.bias = layout.SCALE_TAG_BIAS

    @classmethod
    def in_maps(cls, maps, job: JobConfig) -> "JobState":
        """XDP mode: the job's region of the dataplane's maps, checked against the job config."""
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
        return cls(info, maps.pool[info.pool_off:info.pool_off + info.pool_len],
                   maps.pstate[info.pstate_off:info.pstate_off + info.pstate_len],
                   maps.wstate[info.wstate_off:info.wstate_off + info.wstate_len])

    @classmethod
    def allocate(cls, job: JobConfig, dpu_index: int, state_dir: str | None = None) -> "JobState":
        """Userspace mode: zeroed state in this process's memory (pages are only touched as
        partitions are merged), or in files under ``state_dir`` that a restarted worker re-opens."""
        info = userspace_info(job, dpu_index)
        shapes = {"bufs": (2 * info.slots, layout.BUF_DTYPE), "pstate": (info.slots, layout.PSTATE_DTYPE),
                  "wstate": (2 * info.slots * info.workers, layout.WSTATE_DTYPE)}
        arrays, files = {}, []
        if state_dir is not None:
            os.makedirs(state_dir, exist_ok=True)
        for name, (n, dtype) in shapes.items():
            if state_dir is None:
                arrays[name] = np.zeros(n, dtype)
                continue
            path = os.path.join(state_dir, f"{name}.bin")
            fresh = not os.path.exists(path) or os.path.getsize(path) != n * dtype.itemsize
            mm = np.memmap(path, dtype, mode="w+" if fresh else "r+", shape=(n,))
            arrays[name] = mm
            files.append(mm)
        return cls(info, arrays["bufs"], arrays["pstate"], arrays["wstate"], files)

    def addresses(self) -> tuple[int, int, int]:
        """Addresses of the first buffer, slot state and worker state (for the compiled code)."""
        return self.bufs.ctypes.data, self.pstate.ctypes.data, self.wstate.ctypes.data

    def flush(self) -> None:
        for mm in self._files:
            mm.flush()

    # ---- a (local partition, round) in its slot: dataplane.maps.JobInfo's numbering
    def occupant(self, lp: int, rnd: int) -> tuple[int, int]:
        """(slot, generation) of local partition ``lp`` in round ``rnd``."""
        s = self.info.slots
        slot = lp % s
        return slot, rnd * self.info.per_round(slot) + lp // s

    def base(self, slot: int) -> int:
        return int(self.pstate["base_gen"][slot])

    def in_window(self, lp: int, rnd: int) -> bool:
        slot, g = self.occupant(lp, rnd)
        return self.base(slot) <= g <= self.base(slot) + 1

    def is_complete(self, lp: int, rnd: int) -> bool:
        slot, g = self.occupant(lp, rnd)
        return self.in_window(lp, rnd) and int(self.pstate["workers_done"][slot, g & 1]) >= self.info.workers

    def is_settled(self, lp: int, rnd: int) -> bool:
        """(lp, rnd) is its slot's base: its completion was handled (its result sent)."""
        slot, g = self.occupant(lp, rnd)
        return self.base(slot) == g

    def missing_workers(self, lp: int, rnd: int) -> list[int]:
        slot, g = self.occupant(lp, rnd)
        w = self.info.workers
        ws = self.wstate[(slot * 2 + (g & 1)) * w:(slot * 2 + (g & 1) + 1) * w]
        total = ws["total"].astype(np.int64)
        return np.flatnonzero((total == 0) | (ws["received"].astype(np.int64) < total)).tolist()

    def scale_exp(self, lp: int, rnd: int) -> int:
        slot, g = self.occupant(lp, rnd)
        tag = int(self.pstate["scale_tag"][slot, g & 1])
        return tag - self.bias if tag else 0

    def local_of_slot(self, slot: int, gen: int) -> tuple[int, int]:
        """(local partition, round) that is occupant ``gen`` of ``slot``."""
        rnd, k = divmod(gen, self.info.per_round(slot))
        return slot + k * self.info.slots, rnd

    def incomplete(self, slots: np.ndarray | None = None):
        """The NACK scan's view, vectorized over the slots (all, or ``slots``):
        ([(lp, round, worker, partial)] for every worker that has not delivered its whole
        contribution to an occupant some other workers have delivered whole, [(lp, round, worker)]
        for those other workers); partial: some of its packets are in."""
        j = self.info
        S, W = j.slots, j.workers
        done = self.pstate["workers_done"].astype(np.int64)
        cand = np.argwhere((done > 0) & (done < W))
        if slots is not None and len(cand):
            cand = cand[np.isin(cand[:, 0], slots)]
        if not len(cand):
            return [], []
        base = self.pstate["base_gen"].astype(np.int64)
        ws = self.wstate.reshape(S, 2, W)
        cs, cp = cand[:, 0], cand[:, 1]
        rec = ws["received"][cs, cp].astype(np.int64)
        tot = ws["total"][cs, cp].astype(np.int64)
        whole = (tot > 0) & (rec >= tot)
        occ = {}

        def occupant(i: int) -> tuple[int, int]:
            o = occ.get(i)
            if o is None:
                s, par = int(cs[i]), int(cp[i])
                g = int(base[s]) if (int(base[s]) & 1) == par else int(base[s]) + 1
                o = occ[i] = self.local_of_slot(s, g)
            return o

        ci, cw = np.nonzero(~whole)
        partial = (rec[ci, cw] > 0).tolist()
        missing = [(*occupant(i), w, part) for i, w, part in zip(ci.tolist(), cw.tolist(), partial)]
        di, dw = np.nonzero(whole)
        delivered = [(*occupant(i), w) for i, w in zip(di.tolist(), dw.tolist())]
        return missing, delivered

    def complete_unsettled(self, slots: np.ndarray | None = None) -> list[tuple[int, int]]:
        """(lp, round) of every slot whose next occupant (base + 1) is complete: its completion is
        waiting to be handled (or was lost)."""
        W = self.info.workers
        base = self.pstate["base_gen"].astype(np.int64)
        nxt = (base + 1) & 1
        done = self.pstate["workers_done"].astype(np.int64)[np.arange(len(base)), nxt]
        ready = np.flatnonzero(done >= W)
        if slots is not None:
            ready = ready[np.isin(ready, slots)]
        return [self.local_of_slot(int(s), int(base[s]) + 1) for s in ready]
