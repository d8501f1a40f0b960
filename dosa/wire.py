"""The dosa wire protocol, version 1: the one definition every component uses.

host_lib (packetizer, parser), dpu_fw (result packets), the scapy layer (``dosa.scapy_layer``) and the
tests all take field names, sizes, offsets and constants from here. ``dataplane/dosa_wire.h`` mirrors
it in C; ``tests/unit/test_wire_c_header.py`` compiles that header and checks every offset and size
against this module, so the two cannot drift. The spec in prose is ``docs/protocol.md``.

Layout: UDP payload = 32-byte header + ``count`` entries. All multi-byte fields are big-endian
(network order). The entry size depends only on the packet type, so ``count`` alone sizes the payload.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields as dc_fields

import numpy as np

MAGIC = 0x444F5341  # b"DOSA"
VERSION = 1
DEFAULT_PORT = 4791 + 13000  # 17791; any port can be configured per deployment

MTU = 1500
IPV4_HDR_LEN = 20
UDP_HDR_LEN = 8
ETH_HDR_LEN = 14
HDR_LEN = 32
#: Largest dosa payload (header + entries) that fits a 1500-byte MTU without IP options.
MAX_UDP_PAYLOAD = MTU - IPV4_HDR_LEN - UDP_HDR_LEN  # 1472
MAX_BODY = MAX_UDP_PAYLOAD - HDR_LEN  # 1440

SPARSE_ENTRY_LEN = 8  # u32 index + s32 value
DENSE_ENTRY_LEN = 4  # s32 value
RETX_ENTRY_LEN = 4  # u32 missing result sequence number
STATUS_ENTRY_LEN = 4  # u32 worker_id that has not delivered its contribution

MAX_SPARSE_ENTRIES = MAX_BODY // SPARSE_ENTRY_LEN  # 180
MAX_DENSE_ENTRIES = MAX_BODY // DENSE_ENTRY_LEN  # 360
MAX_RETX_ENTRIES = MAX_BODY // RETX_ENTRY_LEN  # 360

#: Packets one worker may send for one partition in one round (seq < this). Sizes the dedup bitmap.
MAX_PACKETS_PER_CONTRIBUTION = 256
MAX_WORKERS = 64  # worker_id < MAX_WORKERS
MAX_PARTITIONS = 65535  # partition < MAX_PARTITIONS
DPU_SENDER_ID = 0xFFFF  # worker_id of packets sent by a DPU (results)
SCALE_EXP_MIN = -32
SCALE_EXP_MAX = 62
INT32_MAX = 2**31 - 1


class PacketType(enum.IntEnum):
    """Values of the ``type`` field."""

    SPARSE_DATA = 1  # host -> DPU: count x (u32 index, s32 value), indices inside the partition
    DENSE_DATA = 2  # host -> DPU: count x s32 for indices [base, base + count)
    SPARSE_RESULT = 3  # DPU -> host: count x (u32 index, s32 sum)
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

ENTRY_LEN = {
    PacketType.SPARSE_DATA: SPARSE_ENTRY_LEN,
    PacketType.DENSE_DATA: DENSE_ENTRY_LEN,
    PacketType.SPARSE_RESULT: SPARSE_ENTRY_LEN,
    PacketType.DENSE_RESULT: DENSE_ENTRY_LEN,
    PacketType.RETX_REQUEST: RETX_ENTRY_LEN,
    PacketType.HEARTBEAT: 0,
    PacketType.STATUS: STATUS_ENTRY_LEN,
}
MAX_ENTRIES = {
    t: (MAX_BODY // n if n else 0) for t, n in ENTRY_LEN.items()
}

#: (name, numpy big-endian dtype, C type in dataplane/dosa_wire.h). Order is wire order.
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

SPARSE_ENTRY_DTYPE = np.dtype([("index", ">u4"), ("value", ">i4")])
DENSE_ENTRY_DTYPE = np.dtype(">i4")
RETX_ENTRY_DTYPE = np.dtype(">u4")
assert SPARSE_ENTRY_DTYPE.itemsize == SPARSE_ENTRY_LEN


class ProtocolError(ValueError):
    """A buffer is not a valid dosa v1 packet. The message says which rule it breaks."""


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


def expected_length(ptype: int, count: int) -> int:
    """UDP payload length of a packet of this type carrying ``count`` entries."""
    return HDR_LEN + ENTRY_LEN[PacketType(ptype)] * count


def validate_header(h: Header, length: int) -> None:
    """Raise ProtocolError unless ``h`` is a well-formed v1 header for a payload of ``length`` bytes.

    Checks only what a packet says about itself; flow checks (job, worker, partition ownership,
    index range, round window) belong to the receiver, which knows the job.
    """
    if h.magic != MAGIC:
        raise BadMagic(f"bad magic 0x{h.magic:08x} (expected 0x{MAGIC:08x} 'DOSA')")
    if h.version != VERSION:
        raise BadVersion(f"unsupported protocol version {h.version} (this is version {VERSION})")
    try:
        ptype = PacketType(h.type)
    except ValueError:
        raise BadType(f"unknown packet type {h.type}") from None
    if h.count > MAX_ENTRIES[ptype]:
        raise CountMismatch(f"count {h.count} exceeds the maximum {MAX_ENTRIES[ptype]} for {ptype.name}")
    want = expected_length(ptype, h.count)
    if length != want:
        raise CountMismatch(f"count {h.count} needs a {want}-byte payload, packet has {length}")
    if h.flags & ~FLAGS_VALID_MASK:
        raise BadField(f"unknown flag bits 0x{h.flags & ~FLAGS_VALID_MASK:04x}")
    if h.reserved != 0:
        raise BadField("reserved byte must be zero")
    if ptype in (PacketType.SPARSE_DATA, PacketType.DENSE_DATA, PacketType.SPARSE_RESULT,
                 PacketType.DENSE_RESULT):
        if not 1 <= h.total <= MAX_PACKETS_PER_CONTRIBUTION:
            raise BadField(f"total {h.total} outside 1..{MAX_PACKETS_PER_CONTRIBUTION}")
        if h.seq >= h.total:
            raise BadField(f"seq {h.seq} not below total {h.total}")
        if bool(h.flags & Flags.LAST) != (h.seq == h.total - 1):
            raise BadField("LAST flag must be set exactly on seq == total - 1")
        if not SCALE_EXP_MIN <= h.scale_exp <= SCALE_EXP_MAX:
            raise BadField(f"scale_exp {h.scale_exp} outside {SCALE_EXP_MIN}..{SCALE_EXP_MAX}")
    if ptype in (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT) and h.base != 0:
        raise BadField("base must be zero in sparse packets")
    if h.worker_id >= MAX_WORKERS and h.worker_id != DPU_SENDER_ID:
        raise BadField(f"worker_id {h.worker_id} outside 0..{MAX_WORKERS - 1}")
    if h.partition >= MAX_PARTITIONS:
        raise BadField(f"partition {h.partition} outside 0..{MAX_PARTITIONS - 1}")


def parse_packet(buf: bytes | memoryview) -> tuple[Header, np.ndarray]:
    """Decode one UDP payload into (header, entries). Entries are a big-endian numpy view.

    Sparse types give a SPARSE_ENTRY_DTYPE array, dense types an ``>i4`` array, RETX_REQUEST ``>u4``.
    Raises ProtocolError (a subclass naming the broken rule) for anything malformed.
    """
    h = Header.unpack(buf)
    validate_header(h, len(buf))
    ptype = PacketType(h.type)
    if ptype in (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT):
        dt = SPARSE_ENTRY_DTYPE
    elif ptype in (PacketType.DENSE_DATA, PacketType.DENSE_RESULT):
        dt = DENSE_ENTRY_DTYPE
    elif ptype in (PacketType.RETX_REQUEST, PacketType.STATUS):
        dt = RETX_ENTRY_DTYPE
    else:
        return h, np.zeros(0, np.uint8)
    return h, np.frombuffer(buf, dt, count=h.count, offset=HDR_LEN)


def build_packet(h: Header, entries: np.ndarray | None = None) -> bytes:
    """Encode a header and its entries (any array convertible to the type's entry dtype).

    ``h.count`` is overwritten with the number of entries, so callers cannot make them disagree.
    """
    ptype = PacketType(h.type)
    if entries is None:
        body = b""
        n = 0
    else:
        if ptype in (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT):
            e = np.asarray(entries)
            arr = np.empty(len(e), SPARSE_ENTRY_DTYPE)
            if e.dtype.names:
                arr["index"], arr["value"] = e["index"], e["value"]
            else:
                arr["index"], arr["value"] = e[:, 0], e[:, 1]
        elif ptype in (PacketType.DENSE_DATA, PacketType.DENSE_RESULT):
            arr = np.asarray(entries).astype(DENSE_ENTRY_DTYPE)
        else:
            arr = np.asarray(entries).astype(RETX_ENTRY_DTYPE)
        body, n = arr.tobytes(), len(arr)
    from dataclasses import replace

    return replace(h, count=n).pack() + body


# --------------------------------------------------------------------------------------------------
# Partitioning of the index space and ownership by DPUs
# --------------------------------------------------------------------------------------------------
DEFAULT_PARTITION_SIZE = 1 << 16


@dataclass(frozen=True)
class PartitionMap:
    """Cuts [0, numel) into contiguous partitions of ``partition_size`` indices (the last may be
    shorter) and assigns partition p to DPU ``p % num_dpus`` (round robin balances load when
    gradients are denser in some layers than others)."""

    numel: int
    partition_size: int = DEFAULT_PARTITION_SIZE
    num_dpus: int = 1

    def __post_init__(self):
        if self.numel < 1:
            raise ValueError(f"numel must be at least 1, got {self.numel}")
        if self.partition_size < 1:
            raise ValueError(f"partition_size must be at least 1, got {self.partition_size}")
        if self.num_dpus < 1:
            raise ValueError(f"num_dpus must be at least 1, got {self.num_dpus}")
        if self.num_partitions > MAX_PARTITIONS:
            raise ValueError(
                f"{self.numel} entries in partitions of {self.partition_size} make "
                f"{self.num_partitions} partitions, more than the protocol's {MAX_PARTITIONS}")
        if self.numel > 2**32:
            raise ValueError("numel must fit a u32 index")

    @property
    def num_partitions(self) -> int:
        return -(-self.numel // self.partition_size)

    def bounds(self, p: int) -> tuple[int, int]:
        if not 0 <= p < self.num_partitions:
            raise ValueError(f"partition {p} outside 0..{self.num_partitions - 1}")
        lo = p * self.partition_size
        return lo, min(lo + self.partition_size, self.numel)

    def owner(self, p: int | np.ndarray):
        return p % self.num_dpus

    def owned_by(self, dpu: int) -> np.ndarray:
        return np.arange(dpu, self.num_partitions, self.num_dpus)

    def partition_of(self, index):
        return np.asarray(index) // self.partition_size


# --------------------------------------------------------------------------------------------------
# Many packets in one buffer (what the packetizer builds and the batched socket calls consume)
# --------------------------------------------------------------------------------------------------
STRIDE = MAX_UDP_PAYLOAD  # 1472, a multiple of 8: every packet slot starts 8-byte aligned


@dataclass
class PacketBatch:
    """Packets in one contiguous buffer: packet i is ``data[i, :lengths[i]]``.

    A fixed stride (one MTU-sized slot per packet) makes building vectorized (a 2-D numpy view)
    and maps one-to-one onto the iovecs of sendmmsg/recvmmsg. ``dest`` says where each packet goes:
    the owning DPU's index for data packets, the host's rank for results (-1 = every host).
    """

    data: np.ndarray  # uint8, shape (n, STRIDE), C-contiguous
    lengths: np.ndarray  # int64, shape (n,)
    dest: np.ndarray  # int64, shape (n,)

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def empty(cls, n: int) -> "PacketBatch":
        return cls(np.zeros((n, STRIDE), np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64))

    @classmethod
    def from_packets(cls, packets: list[bytes], dest=None) -> "PacketBatch":
        b = cls.empty(len(packets))
        for i, p in enumerate(packets):
            if len(p) > STRIDE:
                raise ProtocolError(f"packet {i} has {len(p)} bytes, more than the {STRIDE}-byte maximum")
            b.data[i, : len(p)] = np.frombuffer(p, np.uint8)
            b.lengths[i] = len(p)
        if dest is not None:
            b.dest[:] = dest
        return b

    def packet(self, i: int) -> bytes:
        return self.data[i, : self.lengths[i]].tobytes()

    def headers(self) -> np.ndarray:
        """All headers as one structured array (a copy), vectorized."""
        return np.ascontiguousarray(self.data[:, :HDR_LEN]).view(HEADER_DTYPE).reshape(-1)

    def select(self, mask) -> "PacketBatch":
        return PacketBatch(self.data[mask], self.lengths[mask], self.dest[mask])
