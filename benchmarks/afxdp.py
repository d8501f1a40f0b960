"""``dosa bench afxdp``: what an AF_XDP host transport would save, against the UDP GSO sends dosa's
hosts use, measured on the same veth in the same run (root).

Set-up: two namespaces joined by a veth (benchmarks.dataplane.VethLab) at ``--mtu``; on the
receiving end a native XDP program counts the UDP frames to the test port and drops them (the DPU
side's work is then nil, and the count is the ground truth of what arrived). Each method sends
``--packets`` frames of ``--payload`` bytes of UDP payload (default: the largest one frame of the
MTU carries, as dosa's packets are):

* ``udp_gso``: dosa's own send loop (``dosa.transport.UdpEndpoint.send``: UDP GSO over sendmmsg,
  a run of equal-size packets to one destination is one datagram);
* ``udp_sendmmsg``: the same loop with GSO off (one datagram per packet, sendmmsg batches);
* ``af_xdp_copy``: a TX-only AF_XDP socket on the sender's veth in copy mode (veth has no
  zero-copy), written in C with raw syscalls (benchmarks/afxdp_tx.c, built by this command with
  the system's cc): frames are written into the UMEM once, the loop posts descriptors and kicks.

Reported per method (median of ``--repeat`` alternated runs): packets per second, the sender's CPU
per packet (its own user + sys: what a training host pays), the machine's CPU per packet (all
cores busy, from /proc/stat: it includes the veth's and the receiver's work, which on a real NIC
is the NIC's), and the fraction of frames the receiver's XDP counted. Zero-copy AF_XDP needs a NIC
driver with XSK support (mlx5, ice, i40e...); veth has none, so it is not measured here.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from dosa.errors import DosaError

HERE = Path(__file__).resolve().parent
PORT = 47000
METHODS = ("udp_gso", "udp_sendmmsg", "af_xdp_copy")

_COUNT_PROG = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>
BPF_PERCPU_ARRAY(frames, u64, 1);
int xdp_count(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || eth->h_proto != htons(ETH_P_IP))
        return XDP_PASS;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP || ip->ihl != 5)
        return XDP_PASS;
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > end || udp->dest != htons(PORT))
        return XDP_PASS;
    u32 k = 0;
    u64 *v = frames.lookup(&k);
    if (v)
        *v += 1;
    return XDP_DROP;
}
"""


def _machine_busy() -> float:
    """Busy seconds of all CPUs so far (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / 100.0  # USER_HZ


def build_tx(out_dir: Path) -> Path:
    """Compile benchmarks/afxdp_tx.c with the system's cc; returns the binary's path."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise DosaError("dosa bench afxdp needs a C compiler (cc); `make setup` installs one")
    exe = out_dir / "afxdp_tx"
    r = subprocess.run([cc, "-O2", "-Wall", "-o", str(exe), str(HERE / "afxdp_tx.c")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise DosaError(f"cannot build benchmarks/afxdp_tx.c: {r.stderr.strip()[:400]}")
    return exe


class _Counter:
    """The receiver's XDP frame counter, attached natively to eth0 of namespace ``ns``."""

    def __init__(self, ns: str):
        import socket

        from bcc import BPF

        from control.netns import run_in_netns
        from dataplane import libbpf

        self.ns, self._run, self._lib = ns, run_in_netns, libbpf
        try:
            self.bpf = BPF(text=_COUNT_PROG.encode(), cflags=[f"-DPORT={PORT}"])
        except Exception as e:  # BCC raises a bare Exception; its compiler's words are on stderr
            raise DosaError(f"cannot build the receiver's XDP counter ({e}); `make setup` installs "
                            f"the kernel headers BCC needs") from None
        fd = self.bpf.load_func(b"xdp_count", BPF.XDP).fd
        self.idx = run_in_netns(ns, socket.if_nametoindex, "eth0")
        run_in_netns(ns, libbpf.xdp_attach, self.idx, fd, libbpf.XDP_FLAGS_DRV_MODE)

    def count(self) -> int:
        return int(sum(self.bpf[b"frames"][0]))

    def close(self) -> None:
        try:
            self._run(self.ns, self._lib.xdp_detach, self.idx, 0)
        finally:
            self.bpf.cleanup()


def _udp_sender(lab, gso: bool, payload: int):
    """A send function for the UDP methods: n packets of ``payload`` bytes through dosa's endpoint
    (in the sender's namespace), 64 packets a call as a round's partition runs are; returns
    (packets sent, the calling thread's CPU seconds)."""
    from control.netns import run_in_netns
    from dosa.net import addr_arrays
    from dosa.transport import UdpEndpoint
    from dosa.wire import HDR_LEN, PacketBatch

    from benchmarks.dataplane import DPU_IP, HOST_IP

    ep = run_in_netns(lab.h, lambda: UdpEndpoint((HOST_IP, 0), gso=gso, gro=False))
    per = 64
    batch = PacketBatch.empty(per, -(-payload // HDR_LEN) * HDR_LEN)
    batch.data[:] = np.arange(batch.data.shape[1], dtype=np.uint8)
    batch.lengths[:] = payload
    ip_be, port_be = addr_arrays([(DPU_IP, PORT)])
    rows = np.arange(per)
    ips, ports = np.repeat(ip_be, per), np.repeat(port_be, per)

    def send(n: int) -> tuple[int, float]:
        c0, sent = time.thread_time(), 0
        while sent < n:
            k = min(per, n - sent)
            sent += ep.send(batch, rows[:k], ips[:k], ports[:k])
        return sent, time.thread_time() - c0

    return ep, send


def _one(method: str, lab, counter: _Counter, senders: dict, exe: Path, dst_mac: str,
         payload: int, packets: int) -> dict:
    from benchmarks.dataplane import DPU_IP, HOST_IP

    before, busy0, t0 = counter.count(), _machine_busy(), time.perf_counter()
    if method == "af_xdp_copy":
        r = subprocess.run(["ip", "netns", "exec", lab.h, str(exe), "eth0", dst_mac, HOST_IP, DPU_IP,
                            str(PORT), str(payload), str(packets), "copy"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise DosaError(f"AF_XDP sender failed: {r.stderr.strip()[:300]}")
        out = json.loads(r.stdout)
        sent, cpu, wall = out["packets"], out["user_s"] + out["sys_s"], out["wall_s"]
    else:
        sent, cpu = senders[method][1](packets)
        wall = time.perf_counter() - t0
    time.sleep(0.05)  # the receiver's NAPI drains what is still in the veth's ring
    got, busy = counter.count() - before, _machine_busy() - busy0
    return {"packets": sent, "wall_s": wall, "pps": sent / wall, "sender_cpu_s": cpu,
            "sender_cpu_us_per_packet": cpu / sent * 1e6, "machine_cpu_us_per_packet": busy / sent * 1e6,
            "received_fraction": got / sent}


def run(packets: int = 300_000, payload: int | None = None, mtu: int = 3500, repeat: int = 3) -> dict:
    from dataplane import loader
    from dosa.progress import progress

    from benchmarks.dataplane import VethLab

    loader.require_root("dosa bench afxdp")
    payload = payload or mtu - 28  # IPv4 + UDP headers: one frame of the MTU
    if not 1 <= payload <= mtu - 28 or packets < 1000 or repeat < 1:
        raise DosaError(f"--payload must be 1..{mtu - 28} (the MTU's frame), --packets at least 1000, "
                        f"--repeat at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="dosa-afxdp-"))
    lab = VethLab(qdisc=True, mtu=mtu)
    counter, senders = None, {}
    try:
        exe = build_tx(tmp)
        counter = _Counter(lab.d)
        senders = {"udp_gso": _udp_sender(lab, True, payload),
                   "udp_sendmmsg": _udp_sender(lab, False, payload)}
        runs: dict[str, list] = {m: [] for m in METHODS}
        bar = progress(repeat * len(METHODS), "dosa bench afxdp", "run")
        for i in range(repeat):
            for m in METHODS:  # alternated, so a slow minute of the machine hits every method
                runs[m].append(_one(m, lab, counter, senders, exe, lab.dpu_mac, payload, packets))
                bar.update(1, status=m)
        bar.close()
        gso_segs = senders["udp_gso"][0].gso_segs
    finally:
        for ep, _ in senders.values():
            ep.close()
        if counter is not None:
            counter.close()
        lab.close()
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"config": {"packets": packets, "payload": payload, "mtu": mtu, "repeat": repeat,
                      "udp_gso_segments": gso_segs},
           "methods": {}}
    for m, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med["runs"] = rs
        res["methods"][m] = med
    g = res["methods"]["udp_gso"]
    for m, r in res["methods"].items():
        r["sender_cpu_vs_udp_gso"] = r["sender_cpu_us_per_packet"] / g["sender_cpu_us_per_packet"]
        r["machine_cpu_vs_udp_gso"] = r["machine_cpu_us_per_packet"] / g["machine_cpu_us_per_packet"]
        r["pps_vs_udp_gso"] = r["pps"] / g["pps"]
    return res


def format_table(r: dict) -> str:
    c = r["config"]
    lines = [f"afxdp: {c['packets']} packets of {c['payload']} B UDP payload a run, MTU {c['mtu']}, "
             f"median of {c['repeat']} alternated runs (UDP GSO: {c['udp_gso_segments']} segments a "
             f"datagram at most)",
             f"{'method':14} {'Mpkt/s':>7} {'x gso':>6} {'sender us/pkt':>14} {'x gso':>6} "
             f"{'machine us/pkt':>15} {'x gso':>6} {'received':>9}"]
    for m, x in r["methods"].items():
        lines.append(f"{m:14} {x['pps'] / 1e6:7.3f} {x['pps_vs_udp_gso']:6.2f} "
                     f"{x['sender_cpu_us_per_packet']:14.3f} {x['sender_cpu_vs_udp_gso']:6.2f} "
                     f"{x['machine_cpu_us_per_packet']:15.3f} {x['machine_cpu_vs_udp_gso']:6.2f} "
                     f"{x['received_fraction']:9.4f}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DosaError("--plot needs matplotlib: pip install 'dosa[plot]'") from None
    ms = list(r["methods"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(ms, [r["methods"][m]["pps"] / 1e6 for m in ms], color="#4c72b0")
    a.set_ylabel("Mpkt/s (one sender)")
    x = np.arange(len(ms))
    b.bar(x - 0.2, [r["methods"][m]["sender_cpu_us_per_packet"] for m in ms], 0.4,
          label="sender", color="#dd8452")
    b.bar(x + 0.2, [r["methods"][m]["machine_cpu_us_per_packet"] for m in ms], 0.4,
          label="whole machine", color="#55a868")
    b.set_xticks(x, ms)
    b.set_ylabel("CPU us per packet")
    b.legend(fontsize=8)
    c = r["config"]
    fig.suptitle(f"{c['payload']} B packets, MTU {c['mtu']}, veth into a counting XDP program",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--packets", type=int, default=300_000, help="packets a run (default 300k)")
    p.add_argument("--payload", type=int, default=None,
                   help="UDP payload bytes (default: the largest one frame of --mtu carries)")
    p.add_argument("--mtu", type=int, default=3500, help="MTU of the veth (default 3500, dosa's testbed)")
    p.add_argument("--repeat", type=int, default=3, help="alternated runs of each method (median)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="write a plot")


def run_cli(args) -> int:
    r = run(args.packets, args.payload, args.mtu, args.repeat)
    print(format_table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(r, args.plot)
        print(f"wrote {args.plot}")
    bad = [m for m, x in r["methods"].items() if x["received_fraction"] < 0.99]
    if bad:
        raise DosaError(f"the receiver counted fewer than 99% of the frames of {bad}: their rates "
                        f"are not rates of delivered packets (see the table)")
    return 0
