"""``python -m benchmarks.wire``: what protocol v2 puts on the wire for one host's round, and what it
costs the host to build and parse it, next to protocol v1 in the same run.

The input is one host's top-k of the benchmarks' synthetic gradient (benchmarks.allreduce.gradients:
layers of different scales, heavy tails; 4 hosts, correlation 0.5), quantized. For each MTU it prints
the data packets and bytes on the wire (Ethernet frames, dosa.packetizer's output plus 42 bytes
of Ethernet/IPv4/UDP headers), the same for the DPU's result of the 4 hosts' union, and the CPU time
(process time, median of ``--repeat``) of packetize and of parse_batch. v1 (8-byte absolute entries,
180 a packet, one MTU) is computed from its definition: ceil(count / 180) packets a partition, at
least one, each 74 + 8 x entries bytes; tests/unit/test_bench_wire.py checks that definition against
v1's rules on small inputs.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.allreduce import gradients as G
from dosa import wire
from dosa.packetizer import packetize, packetize_results, parse_batch

FRAME = wire.ETH_HDR_LEN + wire.IPV4_HDR_LEN + wire.UDP_HDR_LEN  # bytes around a dosa packet


def v1_packets_and_bytes(counts: np.ndarray) -> tuple[int, int]:
    """Protocol v1 (docs/protocol.md *Versioning*): 180 entries of 8 bytes a 1500-byte packet."""
    npk = np.maximum(1, -(-np.asarray(counts, np.int64) // 180))
    return int(npk.sum()), int(npk.sum() * wire.PACKET_OVERHEAD + 8 * int(np.sum(counts)))


def _cpu(fn, repeat: int):
    ts, out = [], None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        ts.append(time.process_time() - t)
    return float(np.median(ts)), out


def measure(numel: int, density: float, hosts: int = 4, mtus=(1500, 3500), repeat: int = 5,
            seed: int = 0) -> dict:
    grads = G.make_gradients(hosts, numel, 0.5, seed=seed)
    k = G.k_for(numel, density)
    sets = [G.topk_indices(g, k) for g in grads]
    pm = wire.PartitionMap(numel)
    idx = sets[0].astype(np.uint32)
    q = np.random.default_rng(seed).integers(-2**20, 2**20, len(idx)).astype(np.int32)
    union = np.unique(np.concatenate(sets)).astype(np.uint32)
    sums = np.random.default_rng(seed + 1).integers(-2**22, 2**22, len(union)).astype(np.int32)
    counts = np.bincount(idx.astype(np.int64) // pm.partition_size, minlength=pm.num_partitions)
    rcounts = np.bincount(union.astype(np.int64) // pm.partition_size, minlength=pm.num_partitions)
    v1_pk, v1_b = v1_packets_and_bytes(counts)
    v1r_pk, v1r_b = v1_packets_and_bytes(rcounts)
    rows = [{"protocol": "v1", "mtu": 1500, "data_packets": v1_pk, "data_bytes": v1_b,
             "result_packets": v1r_pk, "result_bytes": v1r_b}]
    for mtu in mtus:
        tp, b = _cpu(lambda: packetize(idx, q, pm, job_id=1, worker_id=0, round=0, scale_exp=10, mtu=mtu), repeat)
        tparse, _ = _cpu(lambda: parse_batch(b), repeat)
        r = packetize_results(union, sums, pm, job_id=1, round=0, scale_exp=10, mtu=mtu)
        types = b.headers()["type"]
        rows.append({"protocol": "v2", "mtu": mtu, "data_packets": len(b),
                     "data_bytes": int(b.lengths.sum()) + FRAME * len(b),
                     "dense_data_packets": int((types == wire.PacketType.DENSE_DATA).sum()),
                     "result_packets": len(r), "result_bytes": int(r.lengths.sum()) + FRAME * len(r),
                     "packetize_cpu_ms": 1e3 * tp, "parse_cpu_ms": 1e3 * tparse})
    base = rows[0]
    for row in rows:
        row["data_bytes_vs_v1"] = row["data_bytes"] / base["data_bytes"]
        row["result_bytes_vs_v1"] = row["result_bytes"] / base["result_bytes"]
    return {"numel": numel, "density": density, "hosts": hosts, "entries": int(len(idx)),
            "union_entries": int(len(union)), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wire", description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rep = measure(a.numel, a.density, a.hosts, repeat=a.repeat)
    if a.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(f"one host's round: {rep['entries']} entries of {a.numel} (density {a.density}); "
          f"result: {rep['union_entries']} entries (union of {a.hosts} hosts)")
    print(f"{'proto':>5} {'mtu':>5} {'data pkts':>9} {'data bytes':>11} {'vs v1':>6} {'result pkts':>11} "
          f"{'result bytes':>12} {'vs v1':>6} {'packetize':>10} {'parse':>8}")
    for r in rep["rows"]:
        cpu = (f"{r['packetize_cpu_ms']:8.1f}ms {r['parse_cpu_ms']:6.1f}ms" if "parse_cpu_ms" in r else "")
        print(f"{r['protocol']:>5} {r['mtu']:>5} {r['data_packets']:>9} {r['data_bytes']:>11} "
              f"{r['data_bytes_vs_v1']:>6.3f} {r['result_packets']:>11} {r['result_bytes']:>12} "
              f"{r['result_bytes_vs_v1']:>6.3f} {cpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
