"""Addressing rules both ends of a job derive from the job alone: address tables for batched sends
and the per-job multicast group of the results.

Addresses are kept as arrays (IPv4 and port in network order, one row per host or DPU) so a batch's
``dest`` column maps to destinations with one numpy gather, never a Python loop per packet."""
from __future__ import annotations

import socket

import numpy as np

from dosa.env import switch_on

#: TCP port of the control plane's join API on every DPU (``dosa ctl serve --listen``'s default,
#: the testbed's and the deploy's): written here only
DEFAULT_CONTROL_PORT = 17800

#: First address of the per-job result groups (administratively scoped, RFC 2365): job j's group
#: is 239.77.(j >> 8 & 255).(j & 255). Not part of the wire protocol: both ends derive it from the
#: job, like the partition map. ``DOSA_MULTICAST=0`` (set on hosts AND DPU workers) turns it off.
MULTICAST_PREFIX = (239, 77)


def addr_arrays(addrs) -> tuple[np.ndarray, np.ndarray]:
    """[(ip, port), ...] -> (ip u32 holding network-order bytes, port u16 in network order)."""
    ips = np.array([np.frombuffer(socket.inet_aton(a), np.uint32)[0] for a, _ in addrs], np.uint32)
    ports = np.array([socket.htons(int(p)) for _, p in addrs], np.uint16)
    return ips, ports


def multicast_group(job) -> tuple[str, int] | None:
    """The (group, port) a DPU sends this job's (a complete dosa.job.JobConfig) results to once, or
    None for unicast fan-out.

    Multicast needs every host on the same port (one datagram reaches every joined socket bound to
    group:port) and distinct, non-loopback addresses (hosts on separate interfaces of a fabric that
    forwards multicast, as the testbed's bridge does); otherwise, or with DOSA_MULTICAST=0, the
    DPU sends each result packet to every host (unicast fan-out)."""
    if not switch_on("DOSA_MULTICAST"):
        return None
    ports = {p for _, p in job.hosts}
    addrs = [a for a, _ in job.hosts]
    if len(job.hosts) < 2 or len(ports) != 1 or len(set(addrs)) != len(addrs) or \
            any(a.startswith("127.") or a == "0.0.0.0" for a in addrs):
        return None
    j = int(job.job_id)
    return f"{MULTICAST_PREFIX[0]}.{MULTICAST_PREFIX[1]}.{(j >> 8) & 255}.{j & 255}", ports.pop()


def parse_hostport(s: str, what: str = "address") -> tuple[str, int]:
    """``"ADDR:PORT"`` -> (ADDR, PORT): the one parser of the command lines' ADDR:PORT options; a
    ValueError in one sentence for anything else (argparse reports it against the option)."""
    host, sep, port = str(s).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} must be ADDR:PORT with a port in 1..65535 (e.g. 10.0.1.1:{DEFAULT_CONTROL_PORT}), "
                         f"got {s!r}")
    return host, int(port)


def hostport_arg(s: str) -> tuple[str, int]:
    """argparse ``type=`` of an ADDR:PORT option (its message names the option)."""
    import argparse

    try:
        return parse_hostport(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


#: getsockopt(IPPROTO_IP, IP_MTU) of a connected socket: the route's MTU to that address (Linux)
_IP_MTU = getattr(socket, "IP_MTU", 14)


def path_mtu(addr: str, port: int = 9) -> int | None:
    """The MTU of this network namespace's route to ``addr`` (a connected UDP socket's IP_MTU; no
    packet is sent), or None when it cannot be read. A job created from a host takes the largest
    wire MTU its path allows (``min(path_mtu, wire.MAX_MTU)``)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return int(s.getsockopt(socket.IPPROTO_IP, _IP_MTU))
    except (OSError, ValueError):
        return None


def local_address_towards(addr: str) -> str:
    """The local IPv4 address the kernel would use to reach ``addr`` (no packet is sent): the
    address a host joins a job from when it names none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]
