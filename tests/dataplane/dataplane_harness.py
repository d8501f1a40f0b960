"""Helpers of the BPF_PROG_TEST_RUN tests: one loaded instance, jobs with their own regions, packets
built with scapy (Ether/IP/UDP) around dosa bytes from dosa.wire.build_packet."""
from __future__ import annotations

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from control.alloc import touched_list_cap
from dataplane import libbpf
from dataplane.maps import DataplaneMaps, JobInfo
from dosa import wire

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX = 0, 1, 2, 3
PORT = wire.DEFAULT_PORT
HDR_OFF = 14 + 20 + 8  # Ethernet + IPv4 (no options) + UDP: where the dosa header starts


def worker_addr(w: int) -> tuple[str, int]:
    return f"10.0.0.{w + 1}", 40000 + w


class Harness:
    def __init__(self, instance: str, maps: DataplaneMaps, prog_fd: int, bpf=None):
        self.instance, self.maps, self.prog_fd, self.bpf = instance, maps, prog_fd, bpf
        self._next_job = 100
        self._pool = self._pstate = self._wstate = 0
        maps.add_port(PORT)

    def reset(self) -> None:
        """Remove every job and flow and zero all state: each test starts from an empty dataplane."""
        for j in self.maps.jobs():
            self.maps.delete_job(j.job_id)
        for (job_id, w) in self.maps.flows():
            self.maps.delete_flow(job_id, w)
        self.maps.pool[:] = 0
        self.maps.pstate[:] = 0
        self.maps.wstate[:] = 0
        self._pool = self._pstate = self._wstate = 0

    def job(self, workers=2, numel=1000, partition_size=256, num_dpus=1, dpu_index=0,
            install_flows=True, slots=0, list_cap=None) -> JobInfo:
        """A fresh job with its own (bump-allocated) regions and every worker's flow installed;
        ``slots`` aggregation slots (0: one per owned partition); ``list_cap`` offsets in each
        buffer's touched list (None: what the control plane chooses, 0: no lists)."""
        self._next_job += 1
        nparts = -(-numel // partition_size)
        owned = len(range(dpu_index, nparts, num_dpus))
        if list_cap is None:
            list_cap = touched_list_cap(min(partition_size, numel))
        j = JobInfo(job_id=self._next_job, workers=workers, partition_size=partition_size, numel=numel,
                    num_partitions=nparts, dpu_index=dpu_index, num_dpus=num_dpus, num_owned=owned,
                    mode=0, pool_off=self._pool, pstate_off=self._pstate, wstate_off=self._wstate,
                    scale_exp=0, port=PORT, slots=slots, list_cap=list_cap)
        self._pool += j.pool_len
        self._pstate += j.pstate_len
        self._wstate += j.wstate_len
        assert self._pool <= len(self.maps.pool) and self._wstate <= len(self.maps.wstate)
        self.maps.clear_job_state(j)
        self.maps.put_job(j)
        if install_flows:
            for w in range(workers):
                self.maps.put_flow(j.job_id, w, *worker_addr(w))
        return j

    @staticmethod
    def frame(payload: bytes, worker: int = 0, src: str | None = None, sport: int | None = None,
              dport: int = PORT, ip_flags: int = 0) -> bytes:
        a, p = worker_addr(worker)
        return bytes(Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
                     / IP(src=src or a, dst="10.0.1.1", flags=ip_flags)
                     / UDP(sport=sport or p, dport=dport) / payload)

    def data(self, j: JobInfo, worker: int, partition: int, round: int, idx, val, scale: int = 0,
             per_packet: int = wire.MAX_SPARSE_ENTRIES) -> list[bytes]:
        """The frames of one worker's contribution to (round, partition): chunks of sorted entries
        with seq/total/LAST, offsets from the partition's first index; one empty packet when there
        are no entries."""
        idx = np.asarray(idx, np.int64)
        val = np.asarray(val, np.int64)
        chunks = [slice(s, s + per_packet) for s in range(0, len(idx), per_packet)] or [slice(0, 0)]
        total = len(chunks)
        out = []
        lo = j.bounds(partition)[0] if partition < j.num_partitions else 0
        base = min(lo, int(idx.min())) if len(idx) else lo  # below lo only for out-of-partition tests
        for seq, sl in enumerate(chunks):
            h = wire.Header(type=wire.PacketType.SPARSE_DATA, job_id=j.job_id, worker_id=worker,
                            partition=partition, round=round, seq=seq, total=total, scale_exp=scale,
                            flags=int(wire.Flags.LAST) if seq == total - 1 else 0, base=base)
            ent = np.stack([idx[sl], val[sl]], axis=1) if len(idx[sl]) else None
            out.append(self.frame(wire.build_packet(h, ent), worker))
        return out

    def run(self, frame: bytes) -> int:
        action, _ = libbpf.prog_test_run(self.prog_fd, frame)
        return action

    def run_all(self, frames) -> list[int]:
        return [self.run(f) for f in frames]

    def counters(self) -> np.ndarray:
        return self.maps.counters_array().astype(np.int64)


def random_contribution(rng, j: JobInfo, partition: int, density: float = 0.3, vmax: int = 2**20):
    """Sorted unique indices of the partition and s32 values (what a packetizer would send)."""
    lo, hi = j.bounds(partition)
    n = rng.binomial(hi - lo, density)
    idx = np.sort(rng.choice(np.arange(lo, hi), size=n, replace=False))
    val = rng.integers(-vmax, vmax, size=n)
    return idx, val
