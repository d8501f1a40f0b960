"""benchmarks.wire: its v1 baseline is v1's definition, and its v2 rows are what the packetizer sends."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import wire as bw
from dosa import wire

pytestmark = pytest.mark.timeout(60)


def _v1_round_bytes(idx: np.ndarray, pm: wire.PartitionMap) -> tuple[int, int]:
    """v1 packets built byte by byte: per partition chunks of 180 (u32 index, s32 value) entries
    after the 32-byte header (version 1), at least one packet a partition; + Ethernet/IPv4/UDP."""
    packets = []
    for p in range(pm.num_partitions):
        lo, hi = pm.bounds(p)
        mine = idx[(idx >= lo) & (idx < hi)]
        chunks = [mine[i:i + 180] for i in range(0, len(mine), 180)] or [mine[:0]]
        for c in chunks:
            h = wire.Header(partition=p, count=len(c), version=1, total=len(chunks)).pack()
            packets.append(h + b"".join(int(i).to_bytes(4, "big") + b"\0\0\0\1" for i in c))
    return len(packets), sum(len(x) + bw.FRAME for x in packets)


def test_v1_baseline_is_v1s_definition():
    rng = np.random.default_rng(0)
    pm = wire.PartitionMap(400_000, 65536)
    idx = np.sort(rng.choice(pm.numel, 30_000, replace=False))
    counts = np.bincount(idx // pm.partition_size, minlength=pm.num_partitions)
    assert bw.v1_packets_and_bytes(counts) == _v1_round_bytes(idx, pm)


def test_measure_rows_are_the_packetizers_output():
    rep = bw.measure(300_000, 0.01, hosts=2, mtus=(1500, 3500), repeat=1)
    v1, v2a, v2b = rep["rows"]
    assert (v1["protocol"], v2a["mtu"], v2b["mtu"]) == ("v1", 1500, 3500)
    for r in (v2a, v2b):  # 6-byte entries: fewer bytes than v1's 8 at top-k densities
        assert r["data_bytes"] < v1["data_bytes"] and r["result_bytes"] < v1["result_bytes"]
    assert v2b["data_packets"] < v2a["data_packets"] <= v1["data_packets"]
