"""UDP transport shared by hosts and DPU workers: one non-blocking socket, batched sends and receives
of whole PacketBatches (Cython in ``host_lib/_net.pyx``: UDP GSO over sendmmsg, UDP GRO over
recvmmsg), and the job description both ends need (:class:`JobConfig`: who the hosts and DPUs are,
how the index space is cut).

Why GSO/GRO: the host's per-datagram kernel work, not the link, bounded a round (docs/performance.md).
With GSO one ``sendmmsg`` entry carries a run of equal-size packets to one destination (a partition's
packets, the short one last) and the kernel cuts it below the socket; with GRO one receive returns
many segments. Support is probed once per process (``batching()``); where the kernel or the path
refuses, the endpoint falls back to one datagram per packet with one log line. ``DOSA_GSO=0`` /
``DOSA_GRO=0`` turn either off (A/B runs).

Addresses are kept as arrays (IPv4 and port in network order, one row per host or DPU) so a batch's
``dest`` column maps to destinations with one numpy gather, never a Python loop per packet.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import struct
from dataclasses import asdict, dataclass, field

import numpy as np

from dosa import wire
from dosa.errors import DosaError
from dosa.wire import PacketBatch, PartitionMap

from . import _net

log = logging.getLogger("dosa.net")

#: Socket buffers asked for (SO_*BUFFORCE as root, else capped by net.core.*mem_max). A round of a
#: 25M gradient at 1% is ~1800 packets a host; results fan out 4x that from a DPU.
DEFAULT_SOCKET_BUFFER = 64 << 20
RESULT_MODES = ("sum", "gtopk")


def addr_arrays(addrs) -> tuple[np.ndarray, np.ndarray]:
    """[(ip, port), ...] -> (ip u32 holding network-order bytes, port u16 in network order)."""
    ips = np.array([np.frombuffer(socket.inet_aton(a), np.uint32)[0] for a, _ in addrs], np.uint32)
    ports = np.array([socket.htons(int(p)) for _, p in addrs], np.uint16)
    return ips, ports


@dataclass
class JobConfig:
    """Everything a host and a DPU worker must agree on for one job.

    ``hosts[w]`` is the (ip, port) worker ``w`` sends from and receives results on; ``dpus[d]`` the
    (ip, port) DPU ``d`` listens on. Partition p is owned by DPU ``p % len(dpus)``.
    ``mode`` is ``sum`` (exact sums, union of indices) or ``gtopk`` (per partition only the
    ``k = ceil(density * partition_length)`` largest |sum| come back; see docs/dpu_worker.md).
    """

    job_id: int
    numel: int
    hosts: list = field(default_factory=list)
    dpus: list = field(default_factory=list)
    partition_size: int = wire.DEFAULT_PARTITION_SIZE
    mode: str = "sum"
    density: float = 0.01
    scale_exp: int = 16

    def __post_init__(self):
        self.hosts = [(str(a), int(p)) for a, p in self.hosts]
        self.dpus = [(str(a), int(p)) for a, p in self.dpus]
        if not 1 <= self.job_id <= 2**32 - 1:
            raise DosaError(f"job_id {self.job_id} must lie in 1..2^32-1")
        if not 1 <= len(self.hosts) <= wire.MAX_WORKERS:
            raise DosaError(f"a job needs 1..{wire.MAX_WORKERS} hosts, got {len(self.hosts)}")
        if not self.dpus:
            raise DosaError("a job needs at least one DPU")
        if self.mode not in RESULT_MODES:
            raise DosaError(f"result mode must be one of {RESULT_MODES}, got {self.mode!r}")
        if not 0 < self.density <= 1:
            raise DosaError(f"density must lie in (0, 1], got {self.density}")
        if not wire.SCALE_EXP_MIN <= self.scale_exp <= wire.SCALE_EXP_MAX:
            raise DosaError(f"scale_exp {self.scale_exp} outside {wire.SCALE_EXP_MIN}..{wire.SCALE_EXP_MAX}")
        try:
            self.pmap  # noqa: B018 - validates numel/partition_size
        except ValueError as e:
            raise DosaError(str(e)) from None

    @property
    def workers(self) -> int:
        return len(self.hosts)

    @property
    def pmap(self) -> PartitionMap:
        return PartitionMap(self.numel, self.partition_size, len(self.dpus))

    def gtopk_k(self, partition_length) -> np.ndarray | int:
        """k of a partition in gtopk mode: ceil(density * partition_length), at least 1."""
        return np.maximum(1, np.ceil(self.density * np.asarray(partition_length)).astype(np.int64))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise DosaError(f"job config has unknown keys {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise DosaError(f"bad job config: {e}") from None

    @classmethod
    def from_view(cls, v: dict) -> "JobConfig":
        """From the control plane's job view (control.api: ``POST /v1/join``, ``GET /v1/jobs``)."""
        try:
            hosts = sorted(v["hosts"], key=lambda h: h["worker_id"])
            if [h["worker_id"] for h in hosts] != list(range(v["workers"])):
                raise DosaError(f"job {v['job_id']} is not complete: hosts "
                                f"{[h['worker_id'] for h in hosts]} of {v['workers']} joined")
            dpus = sorted(v["dpus"], key=lambda d: d["index"])
            return cls(job_id=v["job_id"], numel=v["numel"],
                       hosts=[(h["address"], h["port"]) for h in hosts],
                       dpus=[(d["address"], d["port"]) for d in dpus],
                       partition_size=v["partition_size"], mode=v.get("mode", "sum"),
                       density=v.get("density", 0.01), scale_exp=v.get("scale_exp", 16))
        except (KeyError, TypeError) as e:
            raise DosaError(f"the control plane's job description lacks {e}") from None

    @classmethod
    def load(cls, path: str) -> "JobConfig":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise DosaError(f"cannot read job config {path}: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


#: First address of the per-job result groups (administratively scoped, RFC 2365): job j's group
#: is 239.77.(j >> 8 & 255).(j & 255). Not part of the wire protocol: both ends derive it from the
#: job, like the partition map. ``DOSA_MULTICAST=0`` (set on hosts AND DPU workers) turns it off.
MULTICAST_PREFIX = (239, 77)


def multicast_group(job: "JobConfig") -> tuple[str, int] | None:
    """The (group, port) a DPU sends this job's results to once, or None for unicast fan-out.

    Multicast needs every host on the same port (one datagram reaches every joined socket bound to
    group:port) and distinct, non-loopback addresses (hosts on separate interfaces of a fabric that
    forwards multicast, as the testbed's bridge does); otherwise, or with DOSA_MULTICAST=0, the
    DPU sends each result packet to every host (unicast fan-out)."""
    if os.environ.get("DOSA_MULTICAST", "1").strip().lower() in ("0", "no", "off", "false"):
        return None
    ports = {p for _, p in job.hosts}
    addrs = [a for a, _ in job.hosts]
    if len(job.hosts) < 2 or len(ports) != 1 or len(set(addrs)) != len(addrs) or \
            any(a.startswith("127.") or a == "0.0.0.0" for a in addrs):
        return None
    j = int(job.job_id)
    return f"{MULTICAST_PREFIX[0]}.{MULTICAST_PREFIX[1]}.{(j >> 8) & 255}.{j & 255}", ports.pop()


def _env_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "no", "off", "false")


_BATCHING: dict[str, bool] | None = None


def batching() -> dict[str, bool]:
    """Whether this kernel takes UDP GSO (UDP_SEGMENT) and UDP GRO sockets, probed once per process
    (a socket option on an unbound socket: no packet is sent) and cut by DOSA_GSO=0 / DOSA_GRO=0.
    Logs one line for what is missing. A path that refuses GSO at send time (a device without
    checksum offload, an MTU below the segment size) is caught per endpoint (UdpEndpoint.send)."""
    global _BATCHING
    if _BATCHING is None:
        got = {}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name, opt, val in (("gso", _net.UDP_SEGMENT, 1400), ("gro", _net.UDP_GRO, 1)):
                try:
                    s.setsockopt(_net.SOL_UDP, opt, val)
                    got[name] = True
                except OSError as e:
                    got[name] = False
                    log.info("UDP %s unavailable (%s): one datagram per packet (sendmmsg/recvmmsg)",
                             name.upper(), e.strerror or e)
        _BATCHING = got
    return {"gso": _BATCHING["gso"] and not _env_off("DOSA_GSO"),
            "gro": _BATCHING["gro"] and not _env_off("DOSA_GRO")}


#: errnos with which a path refuses a GSO datagram (not a full buffer): fall back for good
_GSO_REFUSED = {errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EMSGSIZE}


class UdpEndpoint:
    """A bound, non-blocking UDP socket that sends and receives PacketBatches in batches.

    ``recv`` reuses one receive buffer: the returned batch is valid until the next ``recv``.
    ``gso``/``gro`` (default: what ``batching()`` found) choose the batching; ``send_calls`` /
    ``send_datagrams`` and ``recv_calls`` / ``recv_datagrams`` count system calls and datagrams
    (packets are ``sent_packets`` / ``recv_packets``): with GSO/GRO far fewer than packets.
    """

    def __init__(self, bind: tuple[str, int], *, bufsize: int = DEFAULT_SOCKET_BUFFER,
                 recv_slots: int = 1024, gso: bool | None = None, gro: bool | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._set_buffers(bufsize)
            self.sock.bind(bind)
        except OSError as e:
            self.sock.close()
            raise DosaError(f"cannot bind UDP {bind[0]}:{bind[1]}: {e.strerror or e}") from None
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self._rx = PacketBatch.empty(recv_slots)
        self._src_ip = np.zeros(recv_slots, np.uint32)
        self._src_port = np.zeros(recv_slots, np.uint16)
        self.sent_packets = self.sent_bytes = self.recv_packets = self.recv_bytes = 0
        self.truncated = 0
        self.msock = None
        can = batching()
        self.gso_segs = _net.MAX_GSO_SEGMENTS if (can["gso"] if gso is None else gso) else 0
        self._gro = None
        if can["gro"] if gro is None else gro:
            try:
                self.sock.setsockopt(_net.SOL_UDP, _net.UDP_GRO, 1)
                self._gro = _net.GroReceiver()
            except OSError as e:
                log.info("UDP GRO refused on %s:%d (%s): one datagram per recvmmsg slot",
                         *bind, e.strerror or e)
        self._send_ctr = np.zeros(2, np.int64)
        self._recv_ctr = np.zeros(2, np.int64)

    @property
    def send_calls(self) -> int:
        return int(self._send_ctr[0])

    @property
    def send_datagrams(self) -> int:
        return int(self._send_ctr[1])

    @property
    def recv_calls(self) -> int:
        return int(self._recv_ctr[0]) + (self._gro.calls if self._gro is not None else 0)

    @property
    def recv_datagrams(self) -> int:
        return int(self._recv_ctr[1]) + (self._gro.datagrams if self._gro is not None else 0)

    @property
    def gro(self) -> bool:
        return self._gro is not None

    def _set_buffers(self, size: int) -> None:
        for force, plain in ((32, socket.SO_SNDBUF), (33, socket.SO_RCVBUF)):  # SO_*BUFFORCE
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                self.sock.setsockopt(socket.SOL_SOCKET, plain, size)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def send(self, batch: PacketBatch, rows, ip_be, port_be, timeout: float = 2.0) -> int:
        """Send ``batch`` packets ``rows[k]`` to (ip_be[k], port_be[k]). Raises DosaError when the
        socket stays full for ``timeout`` s (the peer side is not draining)."""
        rows = np.ascontiguousarray(rows, np.int64)
        ip_be = np.ascontiguousarray(ip_be, np.uint32)
        port_be = np.ascontiguousarray(port_be, np.uint16)
        try:
            n = _net.send_batch(self.fd, batch.data, batch.lengths, rows, ip_be, port_be, timeout,
                                self.gso_segs, self._send_ctr)
        except OSError as e:
            if not self.gso_segs or e.errno not in _GSO_REFUSED:
                raise
            log.warning("UDP GSO refused on this path (%s): one datagram per packet from now on",
                        e.strerror or e)
            self.gso_segs = 0
            k = e.sent
            n = k + _net.send_batch(self.fd, batch.data, batch.lengths, rows[k:], ip_be[k:],
                                    port_be[k:], timeout, 0, self._send_ctr)
        self.sent_packets += n
        self.sent_bytes += int(batch.lengths[rows[:n]].sum())
        if n < len(rows):
            raise DosaError(f"send buffer stayed full for {timeout} s: {len(rows) - n} packets not sent")
        return n

    def send_to_table(self, batch: PacketBatch, table: tuple[np.ndarray, np.ndarray], rows=None) -> int:
        """Send each packet (or ``rows``) to ``table[batch.dest[row]]`` (a row of addr_arrays)."""
        rows = np.arange(len(batch)) if rows is None else np.asarray(rows, np.int64)
        d = batch.dest[rows]
        return self.send(batch, rows, table[0][d], table[1][d])

    def join_group(self, group: str, port: int, iface_addr: str) -> None:
        """Also receive datagrams sent to ``group:port`` on the interface holding ``iface_addr``
        (a second socket bound to group:port, IP_ADD_MEMBERSHIP); ``recv`` reads both."""
        m = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            m.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                m.setsockopt(socket.SOL_SOCKET, 33, DEFAULT_SOCKET_BUFFER)  # SO_RCVBUFFORCE
            except OSError:
                m.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, DEFAULT_SOCKET_BUFFER)
            m.bind((group, int(port)))
            m.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                         socket.inet_aton(group) + socket.inet_aton(iface_addr))
            if self._gro is not None:
                m.setsockopt(_net.SOL_UDP, _net.UDP_GRO, 1)
        except OSError as e:
            m.close()
            raise DosaError(f"cannot join multicast group {group}:{port} on {iface_addr}: "
                            f"{e.strerror or e}") from None
        m.setblocking(False)
        self.msock = m
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._poll.register(m.fileno(), select.POLLIN)

    def set_multicast_source(self, iface_addr: str | None) -> None:
        """Send multicast out of the interface holding ``iface_addr`` (default: the route's), TTL 1,
        without looping copies back to this machine's own sockets."""
        try:
            if iface_addr and iface_addr != "0.0.0.0":
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(iface_addr))
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, struct.pack("b", 1))
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, struct.pack("b", 0))
        except OSError as e:
            raise DosaError(f"cannot send multicast from {iface_addr}: {e.strerror or e}") from None

    def _recv_fd(self, fd: int, timeout: float) -> int:
        if self._gro is not None:
            return self._gro.recv(fd, self._rx.data, self._rx.lengths, self._src_ip, self._src_port,
                                  timeout)
        return _net.recv_batch(fd, self._rx.data, self._rx.lengths, self._src_ip, self._src_port,
                               timeout, self._recv_ctr)

    def recv(self, timeout: float) -> tuple[PacketBatch, np.ndarray, np.ndarray]:
        """Receive what is queued (waiting up to ``timeout`` s for the first packet), from the
        unicast socket and, after ``join_group``, the group's socket.

        Returns (batch, src_ip_be, src_port_be); truncated datagrams are dropped and counted.
        """
        if self.msock is None:
            n = self._recv_fd(self.fd, max(0.0, timeout))
        else:
            mfd = self.msock.fileno()
            n = self._recv_fd(mfd, 0.0) or self._recv_fd(self.fd, 0.0)
            if not n and timeout > 0:
                self._poll.poll(max(1, int(timeout * 1000)))
                n = self._recv_fd(mfd, 0.0) or self._recv_fd(self.fd, 0.0)
        lengths = self._rx.lengths[:n]
        ok = lengths >= 0
        self.recv_packets += n
        if not ok.all():
            self.truncated += int((~ok).sum())
            keep = np.flatnonzero(ok)
            b = PacketBatch(self._rx.data[keep], lengths[keep], self._rx.dest[keep])
            return b, self._src_ip[keep], self._src_port[keep]
        self.recv_bytes += int(lengths.sum())
        return (PacketBatch(self._rx.data[:n], lengths, self._rx.dest[:n]),
                self._src_ip[:n], self._src_port[:n])

    def close(self) -> None:
        if self.msock is not None:
            self.msock.close()
            self.msock = None
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

