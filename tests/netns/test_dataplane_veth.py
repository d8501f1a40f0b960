"""Real traffic through the attached program: a host namespace sends dosa packets over a veth to a
DPU namespace whose interface runs the dataplane. Sums are exact, one completion per partition,
invalid sources are dropped and counted, control packets and duplicates of a complete round reach
the DPU's UDP socket, and detach + teardown leave no program, pin or namespace behind."""
from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid

import numpy as np
from veth_pair import veth_pair
import pytest

from dosa import wire

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

HOST_IP, DPU_IP = "10.77.0.1", "10.77.0.2"
PORT = wire.DEFAULT_PORT


def lab():
    return veth_pair("dv", HOST_IP, DPU_IP)


def send_from(ns: str, sport: int, payloads: list[bytes]) -> None:
    """Send UDP payloads from HOST_IP:sport inside namespace ns (a socket made in that namespace)."""
    from control.netns import run_in_netns

    def do():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((HOST_IP, sport))
            for p in payloads:
                s.sendto(p, (DPU_IP, PORT))
    run_in_netns(ns, do)


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def contribution(job_id, w, p, idx, val, per=180):
    chunks = [slice(s, s + per) for s in range(0, len(idx), per)] or [slice(0, 0)]
    out = []
    for seq, sl in enumerate(chunks):
        h = wire.Header(job_id=job_id, worker_id=w, partition=p, seq=seq, total=len(chunks),
                        flags=int(wire.Flags.LAST) if seq == len(chunks) - 1 else 0, scale_exp=8)
        ent = np.stack([idx[sl], val[sl]], 1) if len(idx[sl]) else None
        out.append(wire.build_packet(h, ent))
    return out


def test_real_traffic_merges_exactly_and_teardown_leaves_nothing():
    from control.controller import Controller
    from control.netns import run_in_netns
    from dataplane import libbpf, loader
    from dataplane.loader import LoadConfig
    from dataplane.maps import Completion

    rng = np.random.default_rng(7)
    inst = f"veth-{uuid.uuid4().hex[:6]}"
    with lab() as (h, d):
        ctl = Controller(inst)
        try:
            ctl.attach("eth0", netns=d, config=LoadConfig(pool_buffers=32, pstate_slots=256,
                                                         wstate_slots=4096))
            ctl.add_job(9, workers=2, numel=40000, partition_size=10000)
            for w in range(2):
                ctl.add_worker(9, w, HOST_IP, 40000 + w)
            # the DPU worker's socket: what XDP passes up must arrive here
            sock = run_in_netns(d, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            sock.bind((DPU_IP, PORT))
            sock.settimeout(5)

            refs = [np.zeros(10000, np.int64) for _ in range(4)]
            sent = 0
            first = {}
            for w in range(2):
                pkts = []
                for p in range(4):
                    n = rng.integers(0, 3000)
                    idx = np.sort(rng.choice(np.arange(p * 10000, (p + 1) * 10000), n, replace=False))
                    val = rng.integers(-2**24, 2**24, n)
                    np.add.at(refs[p], idx - p * 10000, val)
                    c = contribution(9, w, p, idx, val)
                    first[w, p] = c[0]
                    pkts += c
                send_from(h, 40000 + w, pkts)
                sent += len(pkts)
            maps = ctl.maps
            assert wait_for(lambda: maps.counters()["merged"] == sent)
            comps = []
            assert wait_for(lambda: (comps.extend(maps.poll_completions(50)), len(comps) == 4)[1])
            assert sorted(comps, key=lambda c: c.partition) == [Completion(9, p, 0, 8) for p in range(4)]
            for p in range(4):
                assert np.array_equal(maps.buffer(9, p, 0), refs[p])

            # an impostor (right address, wrong port) is dropped and counted
            send_from(h, 40007, contribution(9, 0, 0, np.array([5]), np.array([1])))
            assert wait_for(lambda: maps.counters()["bad_source"] == 1)
            assert maps.buffer(9, 0, 0)[5] == refs[0][5]
            # heartbeat and a duplicate of the complete round reach the DPU's socket
            hb = wire.build_packet(wire.Header(type=wire.PacketType.HEARTBEAT, job_id=9, worker_id=1))
            send_from(h, 40001, [hb])
            assert sock.recvfrom(2048) == (hb, (HOST_IP, 40001))
            dup = first[0, 1]  # an exact copy of a packet already merged
            send_from(h, 40000, [dup])
            assert sock.recvfrom(2048)[0] == dup
            c = maps.counters()
            assert c["pass_control"] == 1 and c["pass_dup_of_complete"] == 1
            assert c["completions"] == 4 and c["completion_lost"] == 0
            sock.close()
        finally:
            if loader.is_loaded(inst):
                ctl.detach("eth0", netns=d)
        assert run_in_netns(d, lambda: libbpf.xdp_query_id(socket.if_nametoindex("eth0"))) == 0
        assert not loader.is_loaded(inst)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert h not in listed and d not in listed


def test_largest_mtu_frames_through_native_xdp_on_veth():
    """At MTU 3500 (the largest frame native XDP takes on veth without multi-buffer) the packetizer's
    full packets (573 sparse entries, 860-value dense runs: 3514-byte frames) reach the attached
    program whole and merge exactly; nothing is fragmented or passed up."""
    from control.controller import Controller
    from control.netns import run_in_netns
    from dataplane import loader
    from dataplane.loader import LoadConfig
    from dosa.packetizer import packetize

    mtu = wire.MAX_MTU
    rng = np.random.default_rng(11)
    inst = f"vmtu-{uuid.uuid4().hex[:6]}"
    with lab() as (h, d):
        for ns in (h, d):
            subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(mtu)], check=True)
        ctl = Controller(inst)
        try:
            ctl.attach("eth0", netns=d, config=LoadConfig(pool_buffers=64, pstate_slots=256,
                                                         wstate_slots=4096))
            numel = 150000
            ctl.add_job(11, workers=2, numel=numel, partition_size=65536)
            pm = wire.PartitionMap(numel, 65536)
            ref = np.zeros(numel, np.int64)
            sent, frames = 0, []
            for w in range(2):
                ctl.add_worker(11, w, HOST_IP, 41000 + w)
                idx = np.unique(np.r_[rng.choice(131072, 4000, replace=False), np.arange(131072, 140000)])
                val = rng.integers(-2**20, 2**20, len(idx)).astype(np.int32)
                np.add.at(ref, idx, val)
                b = packetize(idx.astype(np.uint32), val, pm, job_id=11, worker_id=w, round=0,
                              scale_exp=8, mtu=mtu)
                pk = [b.packet(i) for i in range(len(b))]
                frames += [len(x) for x in pk]
                send_from(h, 41000 + w, pk)
                sent += len(pk)
            assert max(frames) + 28 == mtu  # full packets: the IPv4 datagram fills the MTU
            maps = ctl.maps
            assert wait_for(lambda: maps.counters()["merged"] == sent), maps.counters()
            for p in range(pm.num_partitions):
                lo, hi = pm.bounds(p)
                assert np.array_equal(maps.buffer(11, p, 0)[:hi - lo], ref[lo:hi]), p
            c = maps.counters()
            assert c["ip_fragment"] == 0 and c["short_packet"] == 0 and c["completions"] == pm.num_partitions
        finally:
            if loader.is_loaded(inst):
                ctl.detach("eth0", netns=d)


def test_bench_dataplane_small_run_is_exact_and_cleans_up():
    """`dosa bench dataplane` at a tiny size: every sum exact, every packet merged (the qdisc gives
    backpressure instead of drops), nothing left behind. No timing is asserted."""
    from benchmarks import dataplane as bench

    def namespaces():
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}

    def bench_pins():
        root = "/sys/fs/bpf/dosa"
        return [d for d in os.listdir(root) if d.startswith("bench-")] if os.path.isdir(root) else []

    before = namespaces()
    res = bench.run(workers=3, numel=200_000, density=0.05, rounds=3, senders=2, link_baseline=False,
                    log=lambda *a: None)
    x = res["xdp"]
    assert x["corrupt_partition_sums"] == 0 and res["userspace"]["numpy_add_at"]["exact"]
    assert x["packets_offered"] == 3 * res["config"]["packets_per_round"]
    assert x["merged_first_pass_fraction"] + x["packets_resent"] / x["packets_offered"] >= 1.0
    assert not {n for n in namespaces() - before if n.startswith(("dbh", "dbd"))}
    assert bench_pins() == []
