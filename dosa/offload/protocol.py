"""Framing of the offload service protocol (TCP, between a host and its DPU's services).

This is NOT the dosa gradient wire protocol (dosa/wire.py, UDP): it is a small request/response
stream for bulk arrays. One message on the stream is::

    fixed head  (16 bytes, network order): magic b"DOFL", version u8, 3 pad bytes,
                header length u32, payload length u32
    header      UTF-8 JSON: {"kind": str, "meta": {...}, "arrays": [{"name", "dtype", "shape"}]}
    payload     the arrays' raw bytes (C order), back to back, in header order

Arrays travel as raw bytes with a dtype from a small whitelist and an explicit shape: nothing from
the network is ever unpickled or evaluated, and every length is checked against limits and against
each other before a byte of payload is allocated. A model state dict is just a set of named arrays.
"""
from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import dataclass, field

import numpy as np

from dosa.errors import DosaError

MAGIC = b"DOFL"
VERSION = 1
HEAD = struct.Struct("!4sB3xII")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = (1 << 31) - 1
MAX_ARRAYS = 4096
MAX_NDIM = 8
#: dtypes allowed on the stream (explicit byte order, so both ends agree whatever their CPU).
DTYPES = frozenset({"|u1", "|i1", "|b1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8",
                    "<f2", "<f4", "<f8"})


class OffloadError(DosaError):
    """Base of the offload errors a user can see."""


class FrameError(OffloadError, ValueError):
    """A malformed message on the service stream; the connection is closed."""


class ConnectionClosed(OffloadError, ConnectionError):
    """The peer closed the connection (or it broke) before a whole message arrived."""


@dataclass
class Message:
    kind: str
    meta: dict = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def _wire_array(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and a.dtype.itemsize > 1
                                    and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    if a.dtype.str not in DTYPES:
        raise FrameError(f"arrays of dtype {a.dtype} cannot be sent; allowed: {sorted(DTYPES)}")
    return a


def encode_header(kind: str, meta: dict | None, arrays: dict[str, np.ndarray]) -> tuple[bytes, list]:
    """Build the head + header bytes and the list of payload buffers of one message."""
    descs, bufs, total = [], [], 0
    for name, a in arrays.items():
        a = _wire_array(a)
        descs.append({"name": str(name), "dtype": a.dtype.str, "shape": list(a.shape)})
        if a.nbytes:
            bufs.append(memoryview(a).cast("B"))
        total += a.nbytes
    if len(descs) > MAX_ARRAYS:
        raise FrameError(f"a message carries at most {MAX_ARRAYS} arrays, not {len(descs)}")
    header = json.dumps({"kind": kind, "meta": meta or {}, "arrays": descs},
                        separators=(",", ":")).encode()
    if len(header) > MAX_HEADER or total > MAX_PAYLOAD:
        raise FrameError(f"message too large ({len(header)} header / {total} payload bytes)")
    return HEAD.pack(MAGIC, VERSION, len(header), total) + header, bufs


def send_message(sock: socket.socket, kind: str, meta: dict | None = None,
                 arrays: dict[str, np.ndarray] | None = None) -> None:
    """Send one message; blocks while the peer's window is full (that is the backpressure)."""
    head, bufs = encode_header(kind, meta, arrays or {})
    sock.sendall(head)
    for b in bufs:
        sock.sendall(b)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionClosed("the peer closed the connection in the middle of a message"
                                   if got else "the peer closed the connection")
        got += n


def _parse_header(raw: bytes, payload_len: int) -> tuple[str, dict, list]:
    try:
        h = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"message header is not valid JSON: {e}") from None
    if not isinstance(h, dict) or not isinstance(h.get("kind"), str) \
            or not isinstance(h.get("meta", {}), dict) or not isinstance(h.get("arrays", []), list):
        raise FrameError("message header must be an object with 'kind', 'meta' and 'arrays'")
    descs = h.get("arrays", [])
    if len(descs) > MAX_ARRAYS:
        raise FrameError(f"message declares {len(descs)} arrays (limit {MAX_ARRAYS})")
    total, out = 0, []
    for d in descs:
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) \
                or d.get("dtype") not in DTYPES or not isinstance(d.get("shape"), list):
            raise FrameError(f"bad array descriptor {d!r}")
        shape = d["shape"]
        if len(shape) > MAX_NDIM or not all(isinstance(s, int) and not isinstance(s, bool)
                                            and 0 <= s <= MAX_PAYLOAD for s in shape):
            raise FrameError(f"bad array shape {shape!r}")
        dtype = np.dtype(d["dtype"])
        nbytes = math.prod(shape) * dtype.itemsize
        total += nbytes
        if total > payload_len:
            break
        out.append((d["name"], dtype, tuple(shape)))
    if total != payload_len:
        raise FrameError(f"arrays need {total} bytes but the payload has {payload_len}")
    return h["kind"], h.get("meta", {}), out


def recv_message(sock: socket.socket) -> Message:
    """Receive one message. Raises ConnectionClosed at end of stream, FrameError if malformed.

    Arrays are received straight into their own buffers (no intermediate copy)."""
    head = bytearray(HEAD.size)
    _recv_into(sock, memoryview(head))
    magic, version, header_len, payload_len = HEAD.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not an offload service stream")
    if version != VERSION:
        raise FrameError(f"unsupported offload protocol version {version} (this side speaks {VERSION})")
    if header_len > MAX_HEADER:
        raise FrameError(f"header of {header_len} bytes exceeds the {MAX_HEADER}-byte limit")
    raw = bytearray(header_len)
    _recv_into(sock, memoryview(raw))
    kind, meta, descs = _parse_header(bytes(raw), payload_len)
    arrays = {}
    for name, dtype, shape in descs:
        a = np.empty(shape, dtype=dtype)
        if a.nbytes:
            _recv_into(sock, memoryview(a).cast("B"))
        arrays[name] = a
    return Message(kind, meta, arrays)


def parse_address(address, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"host:port"``, ``":port"``, ``port`` or ``(host, port)`` -> (host, port)."""
    if isinstance(address, tuple) and len(address) == 2:
        host, port = address
    elif isinstance(address, int):
        host, port = default_host, address
    elif isinstance(address, str):
        host, sep, port = address.rpartition(":")
        if not sep:
            raise OffloadError(f"address {address!r} must be HOST:PORT")
        host = host.strip("[]") or default_host
    else:
        raise OffloadError(f"address {address!r} must be 'HOST:PORT' or (host, port)")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise OffloadError(f"port in address {address!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise OffloadError(f"port {port} is outside [0, 65535]")
    return str(host), port


def connect(address, timeout: float) -> socket.socket:
    """Open a TCP_NODELAY connection to a service; OffloadError (one sentence) if that fails."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise OffloadError(f"offload service at {host}:{port} is unreachable: "
                           f"{e.strerror or e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
