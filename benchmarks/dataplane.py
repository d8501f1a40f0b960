"""``dosa bench dataplane``: how fast the XDP program merges real traffic, against userspace merges
of the same entries measured in the same run.

Set-up: two namespaces joined by a veth; the dataplane attached (native XDP) to the DPU end; a job
of W workers whose packets (dosa.packetizer, one PacketBatch per worker) are sent with batched
sendmmsg (host_lib's Cython ``send_batch``) from one socket per worker, split over ``senders``
threads (the send loop runs without the GIL, so threads use both cores). Every round: patch the
round field, send everything, wait for the completions, check every partition's sum against the
numpy reference (a corrupt sum is counted, never hidden), advance. Lost packets are resent (the
dedup bitmap makes that safe) and counted.

Reported: offered packet rate and bit rate, fraction of offered packets merged on their first
transmission, XDP merged entries/s, and entries/s of ``np.add.at`` over the same entries.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid

import numpy as np

from dosa import wire
from dosa.errors import DosaError
from dosa.progress import track

HOST_IP, DPU_IP = "10.78.0.1", "10.78.0.2"
JOB_ID = 4242


def _ip(*args) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise DosaError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


class VethLab:
    """Two namespaces and a veth; ``close()`` removes them (also after a failure).

    ``qdisc``: a pfifo on the sender's veth. Without one (veth's default is noqueue) a burst larger
    than the receiver's 256-slot XDP ring is dropped at the sender's veth (TX dropped); with one,
    the veth stops its queue when the ring is full and the sender waits (backpressure, kernel 6.17+),
    which is what a NIC with flow control does."""

    def __init__(self, qdisc: bool = True, mtu: int | None = None):
        tag = uuid.uuid4().hex[:6]
        self.h, self.d = f"dbh{tag}", f"dbd{tag}"
        self.made: list[str] = []
        try:
            for ns in (self.h, self.d):
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.h, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", self.d)
            _ip("-n", self.h, "addr", "add", f"{HOST_IP}/24", "dev", "eth0")
            _ip("-n", self.d, "addr", "add", f"{DPU_IP}/24", "dev", "eth0")
            for ns in (self.h, self.d):
                if mtu:
                    _ip("-n", ns, "link", "set", "eth0", "mtu", str(mtu))
                _ip("-n", ns, "link", "set", "eth0", "up")
            #: the DPU end's MAC (a raw frame sender addresses it)
            self.dpu_mac = mac = json.loads(_ip("-j", "-n", self.d, "link", "show", "eth0"))[0]["address"]
            # a static neighbour: no ARP queue (which holds only a few packets) at the first burst
            _ip("-n", self.h, "neigh", "replace", DPU_IP, "lladdr", mac, "dev", "eth0")
            if qdisc:
                r = subprocess.run(["ip", "netns", "exec", self.h, "tc", "qdisc", "replace", "dev", "eth0",
                                    "root", "pfifo", "limit", "20000"], capture_output=True, text=True)
                if r.returncode != 0:
                    raise DosaError(f"cannot add a qdisc to the sender's veth: {r.stderr.strip()}")
        except Exception:
            self.close()
            raise

    def tx_dropped(self) -> int:
        st = json.loads(_ip("-j", "-s", "-n", self.h, "link", "show", "eth0"))[0]
        return int(st["stats64"]["tx"]["dropped"])

    def close(self):
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []


def _make_round(rng, pmap, workers: int, density: float):
    """Per worker: sorted unique indices and int32 values; the reference sums (int64)."""
    from dosa.packetizer import packetize

    ref = np.zeros(pmap.numel, np.int64)
    batches, entries = [], []
    vmax = (2**31 - 1) // workers
    for w in range(workers):
        n = int(pmap.numel * density)
        idx = np.sort(rng.choice(pmap.numel, n, replace=False)).astype(np.uint32)
        val = rng.integers(-vmax, vmax, n).astype(np.int32)
        np.add.at(ref, idx.astype(np.int64), val)
        entries.append((idx, val))
        batches.append(packetize(idx, val, pmap, job_id=JOB_ID, worker_id=w, round=0, scale_exp=8))
    return batches, entries, ref


def _baselines(entries, numel: int, ref: np.ndarray, repeat: int = 3) -> dict:
    """Entries/s of np.add.at over the same entries (best of ``repeat``), checked against the
    reference (the DPU worker's own userspace merge is measured by ``dosa bench dpu``)."""
    idx = np.concatenate([e[0] for e in entries])
    val = np.concatenate([e[1] for e in entries])
    out = {"entries": int(len(idx))}
    best = float("inf")
    for _ in range(repeat):
        buf = np.zeros(numel, np.int64)
        t = time.perf_counter()
        np.add.at(buf, idx.astype(np.intp), val)
        best = min(best, time.perf_counter() - t)
    out["numpy_add_at"] = {"entries_per_s": len(idx) / best, "exact": bool(np.array_equal(buf, ref))}
    return out


def run(workers: int = 8, numel: int = 1 << 22, density: float = 0.05, rounds: int = 8,
        partition_size: int = wire.DEFAULT_PARTITION_SIZE, senders: int = 2, seed: int = 0,
        xdp_mode: str = "native", qdisc: bool = True, link_baseline: bool = True, log=print) -> dict:
    from control.controller import Controller
    from control.netns import run_in_netns
    from dataplane import loader
    from dataplane.loader import LoadConfig
    from dosa.transport import UdpEndpoint
    from dosa.net import addr_arrays

    loader.require_root("dosa bench dataplane")
    if not 1 <= workers <= wire.MAX_WORKERS or rounds < 1 or senders < 1 or not 0 < density <= 1:
        raise DosaError("need 1..64 workers, at least one round and sender, density in (0, 1]")
    rng = np.random.default_rng(seed)
    pmap = wire.PartitionMap(numel, partition_size, 1)
    log(f"building {workers} workers x {int(numel * density)} entries ...")
    batches, entries, ref = _make_round(rng, pmap, workers, density)
    npk = sum(len(b) for b in batches)
    nbytes = sum(int(b.lengths.sum()) for b in batches)
    nentries = sum(len(e[0]) for e in entries)
    base = _baselines(entries, numel, ref)

    lab = VethLab(qdisc)
    inst = f"bench-{uuid.uuid4().hex[:6]}"
    ctl = Controller(inst)
    eps = []
    try:
        ctl.attach("eth0", netns=lab.d, mode=xdp_mode,
                   config=LoadConfig(pool_buffers=2 * pmap.num_partitions,
                                     pstate_slots=max(64, pmap.num_partitions),
                                     wstate_slots=max(1024, 2 * pmap.num_partitions * workers)))
        # whole rounds are offered at once (the merge rate is measured, not a host's window), so
        # every partition gets its own aggregation slot (docs/dataplane.md, *Slots*)
        ctl.add_job(JOB_ID, workers=workers, numel=numel, partition_size=partition_size,
                    slots=pmap.num_partitions)
        for w in range(workers):
            port = 41000 + w
            eps.append(run_in_netns(lab.h, UdpEndpoint, (HOST_IP, port)))
            ctl.add_worker(JOB_ID, w, HOST_IP, port)
        maps = ctl.maps
        dst = addr_arrays([(DPU_IP, wire.DEFAULT_PORT)])
        groups = [list(range(w, workers, senders)) for w in range(senders)]

        def send_round(rows_of=None):
            def go(ws):
                for w in ws:
                    b = batches[w]
                    rows = np.arange(len(b)) if rows_of is None else rows_of[w]
                    n = len(rows)
                    eps[w].send(b, rows, np.repeat(dst[0], n), np.repeat(dst[1], n), timeout=5.0)
            ts = [threading.Thread(target=go, args=(g,)) for g in groups if g]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        def settle(prev: int) -> int:
            """Wait until the merged counter stops moving (XDP drains the veth ring)."""
            while True:
                time.sleep(0.02)
                cur = maps.counters()["merged"]
                if cur == prev:
                    return cur
                prev = cur

        send_s = 0.0
        first_merged = first_entries = corrupt = resent = 0
        for r in track(range(rounds), "dosa bench dataplane", unit="round"):
            rb = np.array([r], ">u4").view(np.uint8)
            for b in batches:
                b.data[:, 16:20] = rb  # the round field of every header
            c0 = maps.counters()
            t = time.perf_counter()
            send_round()
            send_s += time.perf_counter() - t
            merged = settle(c0["merged"])
            c1 = maps.counters()
            first_merged += merged - c0["merged"]
            first_entries += c1["merged_entries"] - c0["merged_entries"]
            done = {c.partition for c in maps.poll_completions(0)}
            tries = 0
            while len(done) < pmap.num_partitions:
                if tries == 5:
                    raise DosaError(f"round {r}: {pmap.num_partitions - len(done)} partitions still "
                                    "incomplete after 5 retransmissions")
                tries += 1
                send_round()  # duplicates of merged packets are dropped by the dedup bitmap
                resent += npk
                settle(maps.counters()["merged"])
                done |= {c.partition for c in maps.poll_completions(200)}
            for p in range(pmap.num_partitions):
                lo, hi = pmap.bounds(p)
                if not np.array_equal(maps.buffer(JOB_ID, p, r), ref[lo:hi]):
                    corrupt += 1
                maps.advance(JOB_ID, p, r)
        counters = maps.counters()
        tx_dropped = lab.tx_dropped()
        prog_time = _program_time(inst, batches, rounds, maps, pmap, ref)
        link = None
        if link_baseline:
            ctl.destroy()  # detach dosa; the same traffic against a program that only drops
            link = _link_baseline(lab, send_round, batches, rounds, npk, nbytes, xdp_mode)
    finally:
        for e in eps:
            e.close()
        try:
            if loader.is_loaded(inst):
                ctl.destroy()
        finally:
            lab.close()

    offered = npk * rounds
    xdp = {"packets_offered": offered, "send_seconds": send_s, "offered_pps": offered / send_s,
           "offered_gbit_s": nbytes * rounds * 8 / send_s / 1e9,
           "merged_first_pass_fraction": first_merged / offered,
           "merged_entries_per_s": first_entries / send_s, "packets_resent": resent,
           "corrupt_partition_sums": corrupt, "rounds": rounds, "veth_tx_dropped": tx_dropped,
           "drops": {k: v for k, v in counters.items() if v and not k.startswith(("merged", "pass",
                                                                                  "completions"))}}
    res = {"config": {"workers": workers, "numel": numel, "density": density, "rounds": rounds,
                      "partition_size": partition_size, "senders": senders, "xdp_mode": xdp_mode,
                      "packets_per_round": npk, "entries_per_round": nentries},
           "xdp": xdp, "xdp_program_time": prog_time, "userspace": base, "link_xdp_drop": link}
    ratios = {}
    if link:
        ratios["xdp_merge_pps_over_xdp_drop_pps"] = xdp["offered_pps"] / link["offered_pps"]
    for k in ("numpy_add_at",):
        if base.get(k):
            ratios[f"xdp_over_{k}"] = xdp["merged_entries_per_s"] / base[k]["entries_per_s"]
    res["ratios"] = ratios
    res["target_met"] = (xdp["merged_first_pass_fraction"] >= 0.95 and corrupt == 0
                         and prog_time["exact"])
    return res


def _program_time(inst, batches, rnd, maps, pmap, ref) -> dict:
    """One more round through BPF_PROG_TEST_RUN instead of the veth: the kernel's own measure of
    the program's time per packet, free of sender, veth and scheduling costs (each run is timed
    alone, so caches are as warm as the previous packet left them). The sums are checked too."""
    import os

    from dataplane import libbpf, loader

    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    head = bytes(Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IP(src=HOST_IP, dst=DPU_IP)
                 / UDP(sport=0, dport=wire.DEFAULT_PORT))
    fd = loader.open_prog(inst)
    total_ns = entries = npk = 0
    try:
        rb = np.array([rnd], ">u4").view(np.uint8)
        for w, b in enumerate(batches):
            b.data[:, 16:20] = rb
            for i in range(len(b)):
                n = int(b.lengths[i])
                ip_udp = bytearray(head)
                ip_udp[16:18] = (20 + 8 + n).to_bytes(2, "big")  # IPv4 total length
                ip_udp[34:36] = (41000 + w).to_bytes(2, "big")  # UDP source port of worker w
                ip_udp[38:40] = (8 + n).to_bytes(2, "big")  # UDP length
                _, ns = libbpf.prog_test_run_timed(fd, bytes(ip_udp) + b.data[i, :n].tobytes())
                total_ns += ns
                entries += int.from_bytes(b.data[i, 22:24].tobytes(), "big")
                npk += 1
    finally:
        os.close(fd)
    exact = all(np.array_equal(maps.buffer(JOB_ID, p, rnd), ref[slice(*pmap.bounds(p))])
                for p in range(pmap.num_partitions))
    return {"packets": npk, "ns_per_packet": total_ns / npk, "ns_per_entry": total_ns / max(entries, 1),
            "packets_per_s_per_core": npk / (total_ns / 1e9), "exact": bool(exact)}


_DROP_PROG = "int xdp_drop_all(struct xdp_md *ctx) { return XDP_DROP; }"


def _link_baseline(lab, send_round, batches, rounds, npk, nbytes, xdp_mode) -> dict:
    """The same packets, same link, same sender, into an XDP program that drops everything: the
    rate the link and sender allow when the XDP work is nil. dosa's merge rate over this rate says
    how much of the path the merge itself costs."""
    import socket as _s

    from bcc import BPF

    from control.netns import run_in_netns
    from dataplane import libbpf

    flags = {"native": libbpf.XDP_FLAGS_DRV_MODE, "skb": libbpf.XDP_FLAGS_SKB_MODE, "auto": 0}[xdp_mode]
    bpf = BPF(text=_DROP_PROG)
    fd = bpf.load_func("xdp_drop_all", BPF.XDP).fd
    idx = run_in_netns(lab.d, _s.if_nametoindex, "eth0")
    run_in_netns(lab.d, libbpf.xdp_attach, idx, fd, flags)
    try:
        t = time.perf_counter()
        for _ in range(rounds):
            send_round()
        dt = time.perf_counter() - t
    finally:
        run_in_netns(lab.d, libbpf.xdp_detach, idx, 0)
        bpf.cleanup()
    return {"offered_pps": npk * rounds / dt, "offered_gbit_s": nbytes * rounds * 8 / dt / 1e9,
            "send_seconds": dt}


def summary(res: dict) -> str:
    x, u, c = res["xdp"], res["userspace"], res["config"]
    lines = [f"dosa bench dataplane: {c['workers']} workers, {c['packets_per_round']} packets x "
             f"{c['rounds']} rounds, {c['senders']} sender thread(s), XDP {c['xdp_mode']}",
             f"  offered         {x['offered_pps'] / 1e3:8.1f} kpkt/s  {x['offered_gbit_s']:.2f} Gbit/s",
             f"  merged (1st tx) {100 * x['merged_first_pass_fraction']:8.2f} %   resent {x['packets_resent']}",
             f"  XDP merge       {x['merged_entries_per_s'] / 1e6:8.2f} M entries/s",
             f"  np.add.at       {u['numpy_add_at']['entries_per_s'] / 1e6:8.2f} M entries/s"]
    t = res["xdp_program_time"]
    lines.insert(5, f"  XDP program alone (PROG_TEST_RUN) {t['ns_per_packet'] / 1e3:.2f} us/packet, "
                    f"{t['ns_per_entry']:.1f} ns/entry = {t['packets_per_s_per_core'] / 1e3:.0f} kpkt/s per core"
                    f"{'' if t['exact'] else '  (SUMS WRONG)'}")
    if res.get("link_xdp_drop"):
        lines.insert(2, f"  same link, XDP_DROP only {res['link_xdp_drop']['offered_pps'] / 1e3:8.1f} kpkt/s "
                        "(the sender/link limit)")
    lines.append(f"  corrupt sums    {x['corrupt_partition_sums']}   target (>=95% merged, 0 corrupt): "
                 f"{'met' if res['target_met'] else 'NOT met'}")
    for k, v in res["ratios"].items():
        lines.append(f"  {k:<32} {v:.2f}x")
    return "\n".join(lines)
