"""The dosa wire format, version 2: the layout of a packet (part of :mod:`dosa.wire`, which
re-exports every name here).

Layout: UDP payload = 32-byte header + ``count`` entries. All multi-byte fields are big-endian
(network order). The entry size depends only on the packet type, so ``count`` alone sizes the
payload. The tables are plain data so generators can read them (``dosa.wire_c`` renders them as
C, ``dosa.scapy_layer`` and ``dosa.wireshark`` as dissectors); what a well-formed header is, is
``dosa.wire_rules``. The spec in prose is ``docs/protocol.md``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields as dc_fields, replace

import numpy as np

from dosa.errors import DosaError

MAGIC = 0x444F5341  # b"DOSA"
VERSION = 2
DEFAULT_PORT = 4791 + 13000  # 17791; any port can be configured per deployment

IPV4_HDR_LEN = 20
UDP_HDR_LEN = 8
ETH_HDR_LEN = 14
HDR_LEN = 32
#: Bytes a packet costs on the wire besides its dosa payload's entries: Ethernet + IPv4 + UDP + dosa
#: header (the figure the encoding choice and the benchmarks' byte counts use).
PACKET_OVERHEAD = ETH_HDR_LEN + IPV4_HDR_LEN + UDP_HDR_LEN + HDR_LEN  # 74

# ---- MTU: a job parameter; every size below that depends on it is a function of it ---------------
DEFAULT_MTU = 1500
MIN_MTU = 576  # the IPv4 minimum every link carries
#: Largest MTU a job may use: the largest frame native XDP takes on veth (and mlx5-class NICs)
#: without multi-buffer is about one page minus headroom and skb_shared_info; 3500 is measured to
#: work (docs/protocol.md *MTU*, shared/design/PLATFORM.md). The XDP program's loops are sized for it.
MAX_MTU = 3500
MTU = DEFAULT_MTU


def max_udp_payload(mtu: int = DEFAULT_MTU) -> int:
    """Largest dosa packet (UDP payload: header + entries) in an IPv4 packet of ``mtu`` bytes."""
    check_mtu(mtu)
    return mtu - IPV4_HDR_LEN - UDP_HDR_LEN


def check_mtu(mtu: int) -> int:
    if not isinstance(mtu, (int, np.integer)) or not MIN_MTU <= mtu <= MAX_MTU:
        raise ValueError(f"MTU {mtu!r} outside {MIN_MTU}..{MAX_MTU} (the largest frame native XDP "
                         "takes without multi-buffer)")
    return int(mtu)


def stride_for_mtu(mtu: int = DEFAULT_MTU) -> int:
    """PacketBatch slot size for ``mtu``: the largest payload rounded up to a multiple of the 32-byte
    header (so one HEADER_DTYPE view covers every slot's header and every slot starts aligned)."""
    return -(-max_udp_payload(mtu) // HDR_LEN) * HDR_LEN


#: Largest dosa payload at the default MTU (1472) and the slot stride of a default PacketBatch.
MAX_UDP_PAYLOAD = DEFAULT_MTU - IPV4_HDR_LEN - UDP_HDR_LEN  # 1472
MAX_BODY = MAX_UDP_PAYLOAD - HDR_LEN  # 1440

#: Packets one worker may send for one partition in one round (seq < this). Sizes the dedup bitmap.
MAX_PACKETS_PER_CONTRIBUTION = 256
MAX_WORKERS = 64  # worker_id < MAX_WORKERS
MAX_PARTITIONS = 65535  # partition < MAX_PARTITIONS
#: Sparse offsets are u16: a partition spans at most 65536 indices (PartitionMap enforces it).
MAX_PARTITION_SIZE = 1 << 16
#: base + offset must fit a u32 index: the largest base a sparse packet may carry.
MAX_SPARSE_BASE = 2**32 - MAX_PARTITION_SIZE
DPU_SENDER_ID = 0xFFFF  # worker_id of packets sent by a DPU (results)
SCALE_EXP_MIN = -32
SCALE_EXP_MAX = 62
INT32_MAX = 2**31 - 1


class PacketType(enum.IntEnum):
    """Values of the ``type`` field."""

    SPARSE_DATA = 1  # host -> DPU: count x u16 offset (padded to 4), then count x s32 value
    DENSE_DATA = 2  # host -> DPU: count x s32 for indices [base, base + count)
    SPARSE_RESULT = 3  # DPU -> host: like SPARSE_DATA, the values are sums
    DENSE_RESULT = 4  # DPU -> host: count x s32 sums for [base, base + count)
    RETX_REQUEST = 5  # host -> DPU: resend result packets; count x u32 result seq (0 = all)
    HEARTBEAT = 6  # host -> DPU: liveness, no entries
    STATUS = 7  # DPU -> host: answer to RETX_REQUEST for an incomplete round; count x u32 missing worker_id


class Flags(enum.IntFlag):
    """Bits of the ``flags`` field. Bits not listed must be zero."""

    NONE = 0
    LAST = 0x0001  # seq == total - 1 (redundant with seq/total; makes captures readable)
    RETRANSMIT = 0x0002  # the sender already sent this packet once
    GTOPK = 0x0004  # result packet of a gtopk-mode job (only the k largest sums of the partition)


FLAGS_VALID_MASK = int(Flags.LAST | Flags.RETRANSMIT | Flags.GTOPK)

#: The payload after the header, per type, as data: blocks of ``count`` elements each, in wire order,
#: each block zero-padded to a multiple of 4 bytes so the next one starts 4-byte aligned (XDP reads
#: the s32 values aligned to the header). (block name, numpy big-endian dtype.)
PAYLOAD_BLOCKS: dict[PacketType, tuple[tuple[str, str], ...]] = {
    PacketType.SPARSE_DATA: (("offset", ">u2"), ("value", ">i4")),  # index = base + offset
    PacketType.DENSE_DATA: (("value", ">i4"),),  # index = base + position
    PacketType.SPARSE_RESULT: (("offset", ">u2"), ("value", ">i4")),
    PacketType.DENSE_RESULT: (("value", ">i4"),),
    PacketType.RETX_REQUEST: (("seq", ">u4"),),
    PacketType.HEARTBEAT: (),
    PacketType.STATUS: (("worker_id", ">u4"),),
}
assert all(np.dtype(d).itemsize in (2, 4) for b in PAYLOAD_BLOCKS.values() for _, d in b)

#: Bytes per entry (the sum of the blocks' element sizes) and the padding an odd ``count`` adds
#: (2 per 2-byte block): payload length = HDR_LEN + ENTRY_LEN * count + ODD_PAD * (count & 1).
ENTRY_LEN = {t: sum(np.dtype(d).itemsize for _, d in b) for t, b in PAYLOAD_BLOCKS.items()}
ODD_PAD = {t: sum(2 for _, d in b if np.dtype(d).itemsize == 2) for t, b in PAYLOAD_BLOCKS.items()}
SPARSE_ENTRY_LEN = ENTRY_LEN[PacketType.SPARSE_DATA]  # 6: u16 offset + s32 value
DENSE_ENTRY_LEN = ENTRY_LEN[PacketType.DENSE_DATA]  # 4: s32 value
RETX_ENTRY_LEN = ENTRY_LEN[PacketType.RETX_REQUEST]  # 4: u32 missing result sequence number
STATUS_ENTRY_LEN = ENTRY_LEN[PacketType.STATUS]  # 4: u32 worker_id that has not delivered


#: the same two tables indexed by the type's value (0 for a byte that is no type): vectorized lookups
_ENTRY_LEN_BY_TYPE = np.zeros(256, np.int64)
_ODD_PAD_BY_TYPE = np.zeros(256, np.int64)
for _t in PacketType:
    _ENTRY_LEN_BY_TYPE[int(_t)], _ODD_PAD_BY_TYPE[int(_t)] = ENTRY_LEN[_t], ODD_PAD[_t]

#: the types whose payload is (u16 offset, s32 value) entries, and those part of a (round,
#: partition) contribution (they carry seq/total/scale_exp)
SPARSE_TYPES = (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT)
DENSE_TYPES = (PacketType.DENSE_DATA, PacketType.DENSE_RESULT)
SEQUENCED_TYPES = (PacketType.SPARSE_DATA, PacketType.DENSE_DATA, PacketType.SPARSE_RESULT,
                   PacketType.DENSE_RESULT)


def payload_length(ptype, count):
    """UDP payload length of packets of type ``ptype`` carrying ``count`` entries (arrays work)."""
    if isinstance(ptype, (int, np.integer)):
        t = PacketType(ptype)
        return HDR_LEN + ENTRY_LEN[t] * count + ODD_PAD[t] * (count & 1)
    t = np.clip(np.asarray(ptype, np.int64), 0, 255)
    c = np.asarray(count, np.int64)
    return HDR_LEN + _ENTRY_LEN_BY_TYPE[t] * c + _ODD_PAD_BY_TYPE[t] * (c & 1)


def value_offset(count):
    """Byte offset (from the start of the dosa header) of the s32 value block of a sparse packet
    with ``count`` entries: after the u16 offsets, padded to 4 (arrays work)."""
    return HDR_LEN + 2 * count + 2 * (count & 1)


def entries_per_packet(ptype, mtu: int = DEFAULT_MTU) -> int:
    """Most entries one packet of ``ptype`` carries at ``mtu`` (0 for HEARTBEAT): the one function
    every builder and the XDP program's loop bounds (at MAX_MTU) take packet sizes from."""
    t = PacketType(ptype)
    body = max_udp_payload(mtu) - HDR_LEN
    n = body // ENTRY_LEN[t] if ENTRY_LEN[t] else 0
    while n and payload_length(t, n) > HDR_LEN + body:
        n -= 1
    return n


def encoded_bytes(count, span, mtu: int = DEFAULT_MTU) -> tuple[np.ndarray, np.ndarray]:
    """Bytes on the wire (Ethernet frames: PACKET_OVERHEAD a packet, padding included) of one
    partition's ``count`` entries spread over ``span`` indices (last - first + 1), sent sparse
    (6 bytes an entry) or as one dense run (4 bytes an index of the span). Arrays work.

    This is the break-even the builders use, computed, not guessed: per entry, ignoring the packet
    headers, dense wins once count / span > 4 / 6 = 2/3; headers move it by a few percent (a sparse
    packet at MTU 1500 holds 240 entries, a dense one 360 values). A bitmap (span / 8 bytes plus 4 an
    entry) would win over sparse from count / span > 1/16; dosa does not send bitmaps (docs/protocol.md
    *Encodings* says why).
    """
    count = np.asarray(count, np.int64)
    span = np.asarray(span, np.int64)
    per_s = entries_per_packet(PacketType.SPARSE_DATA, mtu)
    per_d = entries_per_packet(PacketType.DENSE_DATA, mtu)
    npk_s = np.maximum(1, -(-count // per_s))
    tail = count - (npk_s - 1) * per_s
    pads = 2 * ((npk_s - 1) * (per_s & 1) + (tail & 1))
    sparse = SPARSE_ENTRY_LEN * count + pads + npk_s * PACKET_OVERHEAD
    dense = np.where(span > 0, DENSE_ENTRY_LEN * span + (-(-span // per_d)) * PACKET_OVERHEAD,
                     np.iinfo(np.int64).max)
    return sparse, dense


MAX_SPARSE_ENTRIES = entries_per_packet(PacketType.SPARSE_DATA)  # 240 at the default MTU
MAX_DENSE_ENTRIES = entries_per_packet(PacketType.DENSE_DATA)  # 360
MAX_RETX_ENTRIES = entries_per_packet(PacketType.RETX_REQUEST)  # 360
#: What a receiver accepts: the most entries of each type at MAX_MTU (sizes the XDP loops).
MAX_ENTRIES = {t: entries_per_packet(t, MAX_MTU) for t in PacketType}
RX_MAX_SPARSE_ENTRIES = MAX_ENTRIES[PacketType.SPARSE_DATA]  # 573
RX_MAX_DENSE_ENTRIES = MAX_ENTRIES[PacketType.DENSE_DATA]  # 860

#: (name, numpy big-endian dtype, C type in dosa/dosa_wire.h). Order is wire order.
HEADER_FIELDS: list[tuple[str, str, str]] = [
    ("magic", ">u4", "__be32"),
    ("version", "u1", "__u8"),
    ("type", "u1", "__u8"),
    ("flags", ">u2", "__be16"),
    ("job_id", ">u4", "__be32"),
    ("worker_id", ">u2", "__be16"),
    ("partition", ">u2", "__be16"),
    ("round", ">u4", "__be32"),
    ("seq", ">u2", "__be16"),
    ("count", ">u2", "__be16"),
    ("total", ">u2", "__be16"),
    ("scale_exp", "i1", "__s8"),
    ("reserved", "u1", "__u8"),
    ("base", ">u4", "__be32"),
]
HEADER_DTYPE = np.dtype([(n, t) for n, t, _ in HEADER_FIELDS])
assert HEADER_DTYPE.itemsize == HDR_LEN

#: A decoded sparse entry (absolute index = base + offset, value): what parsers return.
SPARSE_ENTRY_DTYPE = np.dtype([("index", "<u4"), ("value", "<i4")])
SPARSE_OFFSET_DTYPE = np.dtype(">u2")
VALUE_DTYPE = np.dtype(">i4")
DENSE_ENTRY_DTYPE = VALUE_DTYPE
RETX_ENTRY_DTYPE = np.dtype(">u4")


class ProtocolError(DosaError, ValueError):
    """A buffer is not a valid dosa packet. The message says which rule it breaks: one sentence a
    user can act on, so a DosaError (the CLI prints it without a traceback); still a ValueError, as
    it always was, for the callers that catch bad input as one."""


class TruncatedPacket(ProtocolError):
    pass


class BadMagic(ProtocolError):
    pass


class BadVersion(ProtocolError):
    pass


class BadType(ProtocolError):
    pass


class CountMismatch(ProtocolError):
    pass


class BadField(ProtocolError):
    pass


@dataclass(frozen=True)
class Header:
    """One decoded header. Defaults make a valid SPARSE_DATA header of an empty contribution."""

    type: int = PacketType.SPARSE_DATA
    job_id: int = 1
    worker_id: int = 0
    partition: int = 0
    round: int = 0
    seq: int = 0
    count: int = 0
    total: int = 1
    scale_exp: int = 0
    flags: int = 0
    base: int = 0
    magic: int = MAGIC
    version: int = VERSION
    reserved: int = 0

    def pack(self) -> bytes:
        arr = np.zeros(1, HEADER_DTYPE)
        for f in dc_fields(self):
            arr[f.name] = getattr(self, f.name)
        return arr.tobytes()

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> "Header":
        if len(buf) < HDR_LEN:
            raise TruncatedPacket(f"packet has {len(buf)} bytes, shorter than the {HDR_LEN}-byte dosa header")
        rec = np.frombuffer(buf, HEADER_DTYPE, count=1)[0]
        return cls(**{n: int(rec[n]) for n, _, _ in HEADER_FIELDS})


def build_packet(h: Header, entries: np.ndarray | None = None) -> bytes:
    """Encode a header and its entries. Sparse types take (absolute index, value) pairs (an (n, 2)
    array or SPARSE_ENTRY_DTYPE records), written as offsets from ``h.base``; other types the values.

    ``h.count`` is overwritten with the number of entries, so callers cannot make them disagree.
    Raises ValueError when an index is not within 0..65535 of ``h.base``.
    """
    ptype = PacketType(h.type)
    if entries is None or not PAYLOAD_BLOCKS[ptype]:
        return replace(h, count=0).pack()
    e = np.asarray(entries)
    if ptype in SPARSE_TYPES:
        idx, val = (e["index"], e["value"]) if e.dtype.names else (e[:, 0], e[:, 1]) if len(e) \
            else (np.zeros(0, np.int64), np.zeros(0, np.int64))
        off = np.asarray(idx, np.int64) - h.base
        if len(off) and (off.min() < 0 or off.max() >= MAX_PARTITION_SIZE):
            raise ValueError(f"sparse indices must lie in base..base+{MAX_PARTITION_SIZE - 1} "
                             f"(base {h.base}), got {int(np.asarray(idx).min())}..{int(np.asarray(idx).max())}")
        n = len(off)
        body = np.zeros(payload_length(ptype, n) - HDR_LEN, np.uint8)
        body[:2 * n] = off.astype(SPARSE_OFFSET_DTYPE).view(np.uint8)
        body[value_offset(n) - HDR_LEN:] = np.asarray(val).astype(VALUE_DTYPE).view(np.uint8)
        return replace(h, count=n).pack() + body.tobytes()
    arr = e.astype(np.dtype(PAYLOAD_BLOCKS[ptype][0][1]))
    return replace(h, count=len(arr)).pack() + arr.tobytes()
