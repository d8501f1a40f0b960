"""The two ends of :mod:`benchmarks.plan.testbed_path`'s measurements, run inside testbed nodes:

    python -m benchmarks.plan.path_probe udp-recv PORT SEGMENT [GROUP]   # prints "ready", then its result
    python -m benchmarks.plan.path_probe udp-send ADDR PORT SEGMENT PACKETS
    python -m benchmarks.plan.path_probe tcp-recv PORT
    python -m benchmarks.plan.path_probe tcp-send ADDR PORT MBYTES

Each prints one JSON line: what it moved and its own CPU time (user + system, getrusage), so the
caller can divide CPU by packets or bytes. UDP sends are GSO datagrams of SEGMENT-byte packets, as
dosa's send loop makes them; receives ask for GRO, as dosa's endpoint does."""
from __future__ import annotations

import json
import resource
import socket
import struct
import sys
import time

SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def udp_recv(port: int, seg: int, group: str | None = None) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 25)
    s.bind((group or "0.0.0.0", port))
    if group:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                     socket.inet_aton(group) + struct.pack("=I", socket.INADDR_ANY))
    try:
        s.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        pass
    s.settimeout(1.0)
    buf = bytearray(1 << 17)
    print("ready", flush=True)
    got, c0, first = 0, None, True
    while True:
        try:
            n = s.recv_into(buf)
        except socket.timeout:
            if not first:
                break
            continue
        if first:
            c0, first = _cpu(), False
        if n == 1:  # the sender's end marker
            break
        got += -(-n // seg)
    return {"packets": got, "cpu_s": _cpu() - (c0 or _cpu())}


def udp_send(addr: str, port: int, seg: int, packets: int) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    per = min(64, 65507 // seg)
    try:
        s.setsockopt(SOL_UDP, UDP_SEGMENT, seg)
    except OSError:
        per = 1
    payload = b"\0" * (seg * per)
    c0, t0, sent = _cpu(), time.monotonic(), 0
    while sent < packets:
        try:
            s.sendto(payload, (addr, port))
            sent += per
        except BlockingIOError:
            time.sleep(0.0005)
    cpu, wall = _cpu() - c0, time.monotonic() - t0
    time.sleep(0.2)
    for _ in range(3):
        s.sendto(b"\0", (addr, port))
    return {"packets": sent, "cpu_s": cpu, "wall_s": wall}


def tcp_recv(port: int) -> dict:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("ready", flush=True)
    c, _ = srv.accept()
    buf = bytearray(1 << 20)
    c0, n = _cpu(), 0
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        n += k
    return {"bytes": n, "cpu_s": _cpu() - c0}


def tcp_send(addr: str, port: int, mbytes: int) -> dict:
    c = socket.create_connection((addr, port))
    data = b"\0" * (1 << 20)
    c0, t0 = _cpu(), time.monotonic()
    for _ in range(mbytes):
        c.sendall(data)
    c.close()
    return {"bytes": mbytes << 20, "cpu_s": _cpu() - c0, "wall_s": time.monotonic() - t0}


def main(argv: list[str]) -> int:
    role, args = argv[0], argv[1:]
    if role == "udp-recv":
        out = udp_recv(int(args[0]), int(args[1]), args[2] if len(args) > 2 else None)
    elif role == "udp-send":
        out = udp_send(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif role == "tcp-recv":
        out = tcp_recv(int(args[0]))
    elif role == "tcp-send":
        out = tcp_send(args[0], int(args[1]), int(args[2]))
    else:
        print(f"path_probe: unknown role {role!r}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
