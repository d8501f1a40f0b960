"""UDP transport shared by hosts and DPU workers: one non-blocking socket, batched sends and receives
of whole PacketBatches (Cython in ``dosa/_net.pyx``: UDP GSO over sendmmsg, UDP GRO over
recvmmsg). The job both ends need is dosa.job.JobConfig; address tables and the multicast rule are
dosa.net's.

Why GSO/GRO: the host's per-datagram kernel work, not the link, bounded a round (docs/performance.md).
With GSO one ``sendmmsg`` entry carries a run of equal-size packets to one destination (a partition's
packets, the short one last) and the kernel cuts it below the socket; with GRO one receive returns
many segments. Support is probed once per process (``batching()``); where the kernel or the path
refuses, the endpoint falls back to one datagram per packet with one log line. ``DOSA_GSO=0`` /
``DOSA_GRO=0`` turn either off (A/B runs).
"""
from __future__ import annotations

import logging
import select
import socket
import struct

import numpy as np

from dosa.env import switch_on
from dosa.errors import DosaError
from dosa import wire
from dosa.wire import PacketBatch

from . import _net

log = logging.getLogger("dosa.net")
_C = {name: i for i, name in enumerate(_net.COUNTERS)}  # counter slot by name

#: Socket buffers asked for (SO_*BUFFORCE as root, else capped by net.core.*mem_max). A round of a
#: 25M gradient at 1% is ~1800 packets a host; results fan out 4x that from a DPU.
DEFAULT_SOCKET_BUFFER = 64 << 20


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
    return {"gso": _BATCHING["gso"] and switch_on("DOSA_GSO"),
            "gro": _BATCHING["gro"] and switch_on("DOSA_GRO")}


class UdpEndpoint:
    """A bound, non-blocking UDP socket that sends and receives PacketBatches in batches.

    ``recv`` reuses one receive buffer: the returned batch is valid until the next ``recv``.
    ``gso``/``gro`` (default: what ``batching()`` found) choose the batching; ``send_calls`` /
    ``send_datagrams`` and ``recv_calls`` / ``recv_datagrams`` count system calls and datagrams
    (packets are ``sent_packets`` / ``recv_packets``): with GSO/GRO far fewer than packets.
    """

    def __init__(self, bind: tuple[str, int], *, bufsize: int = DEFAULT_SOCKET_BUFFER,
                 recv_slots: int = 1024, gso: bool | None = None, gro: bool | None = None,
                 sock: socket.socket | None = None):
        """``sock``: a UDP socket already bound to ``bind`` to adopt (e.g. one of a reuseport
        group made by a parent process, dpu_fw/shards.py) instead of binding a new one."""
        self.sock = sock if sock is not None else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._set_buffers(bufsize)
            if sock is None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.sock.bind(bind)
        except OSError as e:
            self.sock.close()
            raise DosaError(f"cannot bind UDP {bind[0]}:{bind[1]}: {e.strerror or e}") from None
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self._rx = PacketBatch.empty(recv_slots, wire.stride_for_mtu(wire.MAX_MTU))  # any job's MTU
        self._src_ip = np.zeros(recv_slots, np.uint32)
        self._src_port = np.zeros(recv_slots, np.uint16)
        #: what went through this socket, one int64 slot per name of COUNTERS (host_lib's round
        #: engine adds to the same array when it sends and receives on this socket itself)
        self.counters = np.zeros(len(_net.COUNTERS), np.int64)
        self.msock = None
        can = batching()
        #: segments a GSO datagram (0: none), in an array the round engine shares: the send loop
        #: sets it to 0 when the path refuses GSO (dosa/_net.pyx send_core)
        self.gso = np.array([_net.MAX_GSO_SEGMENTS if (can["gso"] if gso is None else gso) else 0],
                            np.int64)
        self._gro = None
        if can["gro"] if gro is None else gro:
            try:
                self.sock.setsockopt(_net.SOL_UDP, _net.UDP_GRO, 1)
                self._gro = _net.GroReceiver()
            except OSError as e:
                log.info("UDP GRO refused on %s:%d (%s): one datagram per recvmmsg slot",
                         *bind, e.strerror or e)
        # (system calls, datagrams): the pairs _net.send_batch and recv_batch add to
        self._send_ctr = self.counters[_C["send_calls"]:_C["send_datagrams"] + 1]
        self._recv_ctr = self.counters[_C["recv_calls"]:_C["recv_datagrams"] + 1]

    #: the slots of ``counters``, in order (one definition, dosa/_net.pxd, for host_lib's engine too)
    COUNTERS = _net.COUNTERS

    def _counter(name: str, doc: str):  # noqa: N805 - a property factory used in the class body
        i = _C[name]
        return property(lambda self: int(self.counters[i]), doc=doc)

    send_calls = _counter("send_calls", "sendmmsg system calls")
    send_datagrams = _counter("send_datagrams",
                              "datagrams handed to the kernel (a GSO datagram carries many packets)")
    sent_packets = _counter("sent_packets", "dosa packets sent")
    sent_bytes = _counter("sent_bytes", "bytes of the dosa packets sent (UDP payload)")
    recv_packets = _counter("recv_packets", "packets received (truncated ones included)")
    recv_bytes = _counter("recv_bytes", "bytes received (of the packets not truncated)")
    truncated = _counter("truncated", "datagrams longer than a receive slot, dropped")
    del _counter

    @property
    def gso_segs(self) -> int:
        """Segments a GSO datagram (0: one datagram per packet)."""
        return int(self.gso[0])

    def gso_refused(self) -> None:
        """Say once that the path refused GSO (the send loop, dosa/_net.pyx, has already gone on
        with one datagram per packet)."""
        log.warning("UDP GSO refused on this path: one datagram per packet from now on")

    @property
    def recv_calls(self) -> int:
        return int(self.counters[_C["recv_calls"]]) + (self._gro.calls if self._gro is not None else 0)

    @property
    def recv_datagrams(self) -> int:
        return int(self.counters[_C["recv_datagrams"]]) + (self._gro.datagrams if self._gro is not None else 0)

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
        had_gso = self.gso_segs > 1
        n = _net.send_batch(self.fd, batch.data, batch.lengths, rows, ip_be, port_be, timeout,
                            self.gso, self._send_ctr)
        if had_gso and not self.gso_segs:
            self.gso_refused()
        self.counters[_C["sent_packets"]] += n
        self.counters[_C["sent_bytes"]] += int(batch.lengths[rows[:n]].sum())
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

    @property
    def mfd(self) -> int:
        """The multicast group's socket (``join_group``), or -1."""
        return self.msock.fileno() if self.msock is not None else -1

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
        self.counters[_C["recv_packets"]] += n
        self.counters[_C["recv_bytes"]] += int(lengths[ok].sum())
        if not ok.all():
            self.counters[_C["truncated"]] += int((~ok).sum())
            keep = np.flatnonzero(ok)
            b = PacketBatch(self._rx.data[keep], lengths[keep], self._rx.dest[keep])
            return b, self._src_ip[keep], self._src_port[keep]
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

