"""``limit``: the fastest any dosa round could be on this setup, to judge how close dosa gets.

Two bounds, both computed in the same run as the methods they judge:

* **Link**: the bytes dosa must put on the busiest link, divided by the link rate. Per host: its
  SPARSE_DATA packets out (every partition sends at least one packet, as many entries a packet as the
  job's MTU holds: 240 at 1500, 573 at the testbed's 3500)
  and the result packets in (sum mode: the union of all hosts' indices per partition; gtopk mode:
  ceil(density * partition length) per partition). Each packet counts its entries plus the dosa,
  UDP, IPv4 and Ethernet headers (sizes from :mod:`dosa.wire`; preamble, FCS and inter-frame gap of
  a physical link are not counted: tc shapes the frame as the kernel sees it). Links are full duplex,
  so a link's time is max(bytes out, bytes in) / rate. DPU links (data in from every host, results
  out once to the job's multicast group, or once per host with unicast fan-out) count only when
  they are shaped too (``shape_dpus``).
* **Packet rate**: the packets the busiest sender must emit divided by this machine's raw UDP packet
  rate, measured here (:func:`measure_packet_rate`: one sender with batched sendmmsg through a veth
  pair between two namespaces created for the purpose, a receiver draining with recvmmsg). The
  busiest sender is a host or a DPU (with unicast fan-out, a DPU sends every result packet once per host).

``limit_s`` = max(link, packet rate): a round cannot be faster than either.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import numpy as np

from dosa import wire
from dosa.job import ResultMode

#: Bytes of headers on every dosa packet as tc sees it (Ethernet + IPv4 + UDP + dosa).
PACKET_OVERHEAD = wire.ETH_HDR_LEN + wire.IPV4_HDR_LEN + wire.UDP_HDR_LEN + wire.HDR_LEN


def _parse_rate(rate) -> float | None:
    """'1gbit', '100mbit', '10g', 1e9 -> bits/s; None/'' -> None (unshaped)."""
    if rate is None or rate == "" or rate == 0:
        return None
    if isinstance(rate, (int, float)):
        return float(rate)
    s = str(rate).strip().lower().removesuffix("bps").removesuffix("bit").removesuffix("b")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    try:
        if s and s[-1] in mult:
            return float(s[:-1]) * mult[s[-1]]
        return float(s)
    except ValueError:
        raise ValueError(f"link rate {rate!r} is not a rate like 1gbit, 100mbit or 1e9") from None


def _packets_and_bytes(counts: np.ndarray, mtu: int) -> tuple[int, int]:
    """Packets and wire bytes of sparse packets carrying ``counts[p]`` entries for each partition p
    (wire.encoded_bytes; dense runs are not modelled: at top-k densities the packetizer picks none)."""
    counts = np.asarray(counts, np.int64)
    npk = np.maximum(1, -(-counts // wire.entries_per_packet(wire.PacketType.SPARSE_DATA, mtu)))
    sparse, _ = wire.encoded_bytes(counts, counts, mtu)
    return int(npk.sum()), int(sparse.sum())


def dosa_traffic(index_sets: list[np.ndarray], numel: int, *, dpus: int = 1,
                 partition_size: int = wire.DEFAULT_PARTITION_SIZE, mode: str = "sum",
                 density: float | None = None, multicast: bool = True, mtu: int = wire.DEFAULT_MTU) -> dict:
    """Packets and bytes every host and DPU sends and receives in one dosa round (see module doc).

    ``mtu``: the job's MTU (on the testbed, its links'): it sets how many entries a packet carries,
    so a model at another MTU than the run's counts other packets and headers.

    ``multicast``: results go to the job's multicast group, so a DPU sends each result packet once
    (the default of dosa's transport); False counts unicast fan-out (one copy per host)."""
    pmap = wire.PartitionMap(numel, partition_size, dpus)
    n_parts = pmap.num_partitions
    w = len(index_sets)
    hosts = []
    per_part_in = np.zeros(n_parts, np.int64)
    for idx in index_sets:
        c = np.bincount(np.asarray(idx, np.int64) // partition_size, minlength=n_parts)
        per_part_in += c
        pk, b = _packets_and_bytes(c, mtu)
        hosts.append({"packets_out": pk, "bytes_out": b, "part_counts": c})
    if mode == ResultMode.SUM:
        union = np.unique(np.concatenate([np.asarray(i, np.int64) for i in index_sets]))
        res_counts = np.bincount(union // partition_size, minlength=n_parts)
    elif mode == ResultMode.GTOPK:
        if density is None:
            raise ValueError("gtopk mode needs the density")
        lengths = np.full(n_parts, partition_size, np.int64)
        lengths[-1] = numel - partition_size * (n_parts - 1)
        res_counts = np.maximum(1, np.ceil(density * lengths).astype(np.int64))
    else:
        raise ValueError(f"mode must be 'sum' or 'gtopk', got {mode!r}")
    res_pk, res_b = _packets_and_bytes(res_counts, mtu)
    out_hosts = [{"packets_out": h["packets_out"], "bytes_out": h["bytes_out"],
                  "packets_in": res_pk, "bytes_in": res_b} for h in hosts]
    owner = np.arange(n_parts) % dpus
    out_dpus = []
    for d in range(dpus):
        mine = owner == d
        pk_in = b_in = 0
        for h in hosts:
            p, b = _packets_and_bytes(h["part_counts"][mine], mtu)
            pk_in, b_in = pk_in + p, b_in + b
        p, b = _packets_and_bytes(res_counts[mine], mtu)
        copies = 1 if multicast else w
        out_dpus.append({"packets_in": pk_in, "bytes_in": b_in, "packets_out": copies * p,
                         "bytes_out": copies * b})
    return {"hosts": out_hosts, "dpus": out_dpus, "result_entries": int(res_counts.sum()),
            "partitions": n_parts, "packet_overhead_bytes": PACKET_OVERHEAD, "mtu": mtu}


def link_limit(traffic: dict, link_rate, *, shape_dpus: bool = False, packet_rate: float | None = None) -> dict:
    """The ``limit`` method's record from :func:`dosa_traffic` output, a link rate and a packet rate."""
    rate = _parse_rate(link_rate)
    links = [("host", i, h) for i, h in enumerate(traffic["hosts"])]
    if shape_dpus:
        links += [("dpu", i, d) for i, d in enumerate(traffic["dpus"])]
    link_s, busiest = 0.0, None
    if rate:
        for kind, i, t in links:
            s = max(t["bytes_out"], t["bytes_in"]) * 8 / rate
            if s > link_s:
                link_s, busiest = s, f"{kind}{i}"
    senders = [("host", i, h["packets_out"]) for i, h in enumerate(traffic["hosts"])] + \
              [("dpu", i, d["packets_out"]) for i, d in enumerate(traffic["dpus"])]
    kind, i, most = max(senders, key=lambda s: s[2])
    packets_s = most / packet_rate if packet_rate else 0.0
    h0 = traffic["hosts"][0]
    return {
        "median_s": max(link_s, packets_s), "min_s": max(link_s, packets_s), "max_s": max(link_s, packets_s),
        "link_s": link_s, "busiest_link": busiest, "link_rate_bps": rate,
        "packets_s": packets_s, "busiest_sender": f"{kind}{i}", "busiest_sender_packets": most,
        "packet_rate_pps": packet_rate,
        "bytes_per_host": {"sent": h0["bytes_out"], "received": h0["bytes_in"],
                           "model": "dosa packets incl. Ethernet+IPv4+UDP+dosa headers (host 0)"},
        "traffic": traffic,
        "notes": "limit_s = max(bytes on the busiest shaped link / rate, packets of the busiest sender "
                 "/ measured UDP packet rate)",
    }


# --------------------------------------------------------------------------------------------------
# Raw UDP packet rate over a veth pair between two namespaces made here
# --------------------------------------------------------------------------------------------------
_ADDR_TX, _ADDR_RX, _PORT = "10.78.0.1", "10.78.0.2", 17792


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _sender(duration: float, payload: int) -> dict:
    from dosa import _net

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    try:
        s.setsockopt(socket.SOL_SOCKET, 32 + 1, 8 << 20)  # SO_SNDBUFFORCE
    except OSError:
        pass
    n = 1024
    data = np.zeros((n, wire.stride_for_mtu(wire.MAX_MTU)), np.uint8)  # room for any MTU's datagram
    lengths = np.full(n, payload, np.int64)
    rows = np.arange(n, dtype=np.int64)
    ip_be = np.full(n, np.frombuffer(socket.inet_aton(_ADDR_RX), np.uint32)[0], np.uint32)
    port_be = np.full(n, socket.htons(_PORT), np.uint16)
    sent = 0
    t0 = time.perf_counter()
    end = t0 + duration
    trace = [(0.0, 0)]
    while time.perf_counter() < end:
        sent += _net.send_batch(s.fileno(), data, lengths, rows, ip_be, port_be, 1.0)
        trace.append((time.perf_counter() - t0, sent))
    el = time.perf_counter() - t0
    return {"sent": sent, "seconds": el, "trace": trace}


def _receiver(duration: float) -> dict:
    from dosa import _net

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE
    except OSError:
        pass
    s.bind((_ADDR_RX, _PORT))
    s.setblocking(False)
    n = 1024
    data = np.zeros((n, wire.stride_for_mtu(wire.MAX_MTU)), np.uint8)  # room for any MTU's datagram
    lengths = np.zeros(n, np.int64)
    ip_be = np.zeros(n, np.uint32)
    port_be = np.zeros(n, np.uint16)
    print("ready", flush=True)
    got, first, last = 0, None, None
    trace = []
    end = time.perf_counter() + duration + 5.0
    while time.perf_counter() < end:
        k = _net.recv_batch(s.fileno(), data, lengths, ip_be, port_be, 0.5)
        now = time.perf_counter()
        if k == 0:
            if first is not None:
                break  # the sender stopped
            continue
        if first is None:
            first = now  # packets of this first batch arrived before the clock started: not counted
        else:
            got += k
        last = now
        trace.append((now - first, got))
    return {"received": got, "seconds": (last - first) if first is not None and last > first else 0.0,
            "trace": trace}


def _best_window(trace, window: float) -> float:
    """Highest rate over any ``window`` seconds of a [(t, cumulative count)] trace (0 if too short)."""
    if len(trace) < 2:
        return 0.0
    t = np.array([x[0] for x in trace])
    c = np.array([x[1] for x in trace], np.float64)
    j = np.searchsorted(t, t + window)
    ok = j < len(t)
    if not ok.any():
        return float((c[-1] - c[0]) / (t[-1] - t[0])) if t[-1] > t[0] else 0.0
    i = np.flatnonzero(ok)
    return float(np.max((c[j[i]] - c[i]) / (t[j[i]] - t[i])))


def measure_packet_rate(duration: float = 1.0, mtu: int = wire.DEFAULT_MTU) -> dict:
    """Measure this machine's raw UDP packet rate: sendmmsg batches of 1024 full-size datagrams
    (``mtu``: the job's, so the packets are as large as dosa's) from one process for ``duration``
    s through a veth pair of that MTU to a recvmmsg receiver.

    Needs root (two namespaces and a veth pair are created and always removed). Returns
    ``{"send_pps", "recv_pps" (means over the run), "pps", "gbit_s", ...}`` where ``pps`` is the best
    delivered rate over any 0.25 s window: the machine is shared, and a limit must be what it *can*
    do, not what it did while another process held the CPU.
    """
    if os.geteuid() != 0:
        raise PermissionError("measuring the packet rate needs root (network namespaces)")
    payload = wire.max_udp_payload(mtu)
    tag = uuid.uuid4().hex[:6]
    a, b = f"dpr{tag}a", f"dpr{tag}b"
    va, vb = f"pr{tag}a", f"pr{tag}b"
    made = []
    procs = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(__import__("pathlib").Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
        _ip("-n", a, "addr", "add", f"{_ADDR_TX}/30", "dev", va)
        _ip("-n", b, "addr", "add", f"{_ADDR_RX}/30", "dev", vb)
        _ip("-n", a, "link", "set", va, "mtu", str(mtu), "up")
        _ip("-n", b, "link", "set", vb, "mtu", str(mtu), "up")
        me = [sys.executable, "-m", "benchmarks.allreduce.limit", "--duration", str(duration), "--payload", str(payload)]
        rx = subprocess.Popen(["ip", "netns", "exec", b, *me, "--role", "recv"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(rx)
        line = rx.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"packet-rate receiver did not start: {rx.stderr.read()[-300:]}")
        tx = subprocess.run(["ip", "netns", "exec", a, *me, "--role", "send"], env=env,
                            capture_output=True, text=True, timeout=duration + 30)
        if tx.returncode != 0:
            raise RuntimeError(f"packet-rate sender failed: {tx.stderr.strip()[-300:]}")
        out, err = rx.communicate(timeout=duration + 30)
        if rx.returncode != 0:
            raise RuntimeError(f"packet-rate receiver failed: {err.strip()[-300:]}")
        snd, rcv = json.loads(tx.stdout), json.loads(out)
        send_pps = snd["sent"] / snd["seconds"] if snd["seconds"] else 0.0
        recv_pps = rcv["received"] / rcv["seconds"] if rcv["seconds"] else 0.0
        window = min(0.25, duration / 2)
        best = _best_window(rcv["trace"], window)
        return {"send_pps": send_pps, "recv_pps": recv_pps, "pps": max(best, recv_pps),
                "best_window_s": window,
                "gbit_s": max(best, recv_pps) * (payload + wire.IPV4_HDR_LEN + wire.UDP_HDR_LEN
                                                 + wire.ETH_HDR_LEN) * 8 / 1e9,
                "sent": snd["sent"], "received": rcv["received"], "payload_bytes": payload, "mtu": mtu,
                "duration_s": duration,
                "how": "one sendmmsg sender (1024 a call) -> veth pair -> one recvmmsg receiver, own namespaces"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for ns in made:
            _ip("netns", "del", ns, check=False)


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="packet-rate helper (started by measure_packet_rate)")
    ap.add_argument("--role", choices=("send", "recv"), required=True)
    ap.add_argument("--duration", type=float, default=1.0)
    ap.add_argument("--payload", type=int, default=wire.MAX_UDP_PAYLOAD)
    a = ap.parse_args(argv)
    res = _sender(a.duration, a.payload) if a.role == "send" else _receiver(a.duration)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
