"""The dosa wire protocol, version 1: the one definition every component uses.

the packetizer and parser (``dosa.packetizer``: hosts' data, DPU workers' results), the scapy layer
(``dosa.scapy_layer``), the capture reader and the tests all take field names, sizes, offsets, constants and the header rules
from here; the tables are plain data so generators can read them. ``dosa/dosa_wire.h`` is
generated from this module (:func:`c_header`, ``python -m dosa.gen_headers``), the XDP
program's header check included; ``tests/unit/test_wire_c_header.py`` fails when they drift. The
spec in prose is ``docs/protocol.md``.

Layout: UDP payload = 32-byte header + ``count`` entries. All multi-byte fields are big-endian
(network order). The entry size depends only on the packet type, so ``count`` alone sizes the payload.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields as dc_fields

import numpy as np

from dosa import counters

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


def payload_length(ptype, count):
    """UDP payload length of packets of type ``ptype`` carrying ``count`` entries (arrays work)."""
    if isinstance(ptype, (int, np.integer)):
        t = PacketType(ptype)
        return HDR_LEN + ENTRY_LEN[t] * count + ODD_PAD[t] * (count & 1)
    t = np.asarray(ptype, np.int64)
    c = np.asarray(count, np.int64)
    return HDR_LEN + _TYPE_TABLE["ENTRY_LEN"][t] * c + _TYPE_TABLE["ODD_PAD"][t] * (c & 1)


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


class ProtocolError(ValueError):
    """A buffer is not a valid dosa packet. The message says which rule it breaks."""


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


# --------------------------------------------------------------------------------------------------
# Header rules: ONE table, evaluated vectorized in Python and rendered as the C check of the XDP
# program (dosa/dosa_wire.h is generated from this module by ``python -m dosa.gen_headers``)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeaderRule:
    """One rule of what a packet says about itself, checked in table order (the first broken rule
    names the verdict).

    ``expr`` is True where the rule is BROKEN. It is written in the small expression language both
    numpy (on int64 field arrays) and C (on host-order locals) read the same way: header field names,
    ``length`` (the UDP payload length), the constants of :data:`RULE_CONSTANTS`, the per-type tables
    of :data:`TYPE_TABLES` called like functions, integers, ``+ - * & | ~ == != < <= > >=``, and
    parentheses around every binary operation (Python's ``&`` binds tighter than its comparisons,
    C's does not: full parentheses make both read alike). ``reason`` is the dataplane counter
    (dosa/counters.py, lower case); ``error`` the ProtocolError subclass the scalar check raises;
    ``message`` a ``str.format`` template over the header's fields, ``length`` and the constants.
    """

    reason: str
    error: type
    expr: str
    message: str


#: Constants a rule may name; C spells them ``DOSA_<NAME>`` (the generated header defines them).
RULE_CONSTANTS = {
    "HDR_LEN": HDR_LEN, "MAGIC": MAGIC, "VERSION": VERSION, "F_VALID_MASK": FLAGS_VALID_MASK,
    "F_LAST": int(Flags.LAST), "MAX_PACKETS_PER_CONTRIBUTION": MAX_PACKETS_PER_CONTRIBUTION,
    "SCALE_EXP_MIN": SCALE_EXP_MIN, "SCALE_EXP_MAX": SCALE_EXP_MAX, "MAX_WORKERS": MAX_WORKERS,
    "DPU_SENDER_ID": DPU_SENDER_ID, "MAX_PARTITIONS": MAX_PARTITIONS,
    "MAX_SPARSE_BASE": MAX_SPARSE_BASE,
}

_SEQUENCED_TYPES = (PacketType.SPARSE_DATA, PacketType.DENSE_DATA, PacketType.SPARSE_RESULT,
                    PacketType.DENSE_RESULT)
_SPARSE_TYPES = (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT)

#: Per-type tables a rule may call (``NAME(type)``): value per PacketType, 0 for any other type.
#: C renders each as a ``dosa_<name>(type)`` function of the generated header.
TYPE_TABLES = {
    "TYPE_OK": {t: 1 for t in PacketType},
    "SEQUENCED": {t: 1 for t in _SEQUENCED_TYPES},  # part of a (round, partition) contribution
    "SPARSE": {t: 1 for t in _SPARSE_TYPES},
    "ENTRY_LEN": {t: n for t, n in ENTRY_LEN.items()},
    "ODD_PAD": {t: n for t, n in ODD_PAD.items()},
    "MAX_ENTRIES": {t: n for t, n in MAX_ENTRIES.items()},
}

HEADER_RULES: list[HeaderRule] = [
    HeaderRule("short_packet", TruncatedPacket, "(length < HDR_LEN)",
               "packet has {length} bytes, shorter than the {HDR_LEN}-byte dosa header"),
    HeaderRule("bad_magic", BadMagic, "(magic != MAGIC)",
               "bad magic 0x{magic:08x} (expected 0x{MAGIC:08x} 'DOSA')"),
    HeaderRule("bad_version", BadVersion, "(version != VERSION)",
               "unsupported protocol version {version} (this is version {VERSION})"),
    HeaderRule("bad_type", BadType, "(TYPE_OK(type) == 0)", "unknown packet type {type}"),
    HeaderRule("count_mismatch", CountMismatch, "(count > MAX_ENTRIES(type))",
               "count {count} exceeds the maximum {max_entries} for {type_name}"),
    HeaderRule("count_mismatch", CountMismatch,
               "(length != ((HDR_LEN + (ENTRY_LEN(type) * count)) + (ODD_PAD(type) * (count & 1))))",
               "count {count} needs a {want}-byte payload, packet has {length}"),
    HeaderRule("bad_field", BadField, "((flags & ~F_VALID_MASK) != 0)",
               "unknown flag bits 0x{bad_flags:04x}"),
    HeaderRule("bad_field", BadField, "(reserved != 0)", "reserved byte must be zero"),
    HeaderRule("bad_field", BadField,
               "(SEQUENCED(type) & ((total < 1) | (total > MAX_PACKETS_PER_CONTRIBUTION)))",
               "total {total} outside 1..{MAX_PACKETS_PER_CONTRIBUTION}"),
    HeaderRule("bad_field", BadField, "(SEQUENCED(type) & (seq >= total))",
               "seq {seq} not below total {total}"),
    HeaderRule("bad_field", BadField,
               "(SEQUENCED(type) & (((flags & F_LAST) != 0) != (seq == (total - 1))))",
               "LAST flag must be set exactly on seq == total - 1"),
    HeaderRule("bad_field", BadField,
               "(SEQUENCED(type) & ((scale_exp < SCALE_EXP_MIN) | (scale_exp > SCALE_EXP_MAX)))",
               "scale_exp {scale_exp} outside {SCALE_EXP_MIN}..{SCALE_EXP_MAX}"),
    HeaderRule("bad_field", BadField, "(SPARSE(type) & (base > MAX_SPARSE_BASE))",
               "base {base} over {MAX_SPARSE_BASE}: base + a u16 offset must fit a u32 index"),
    HeaderRule("bad_field", BadField, "((worker_id >= MAX_WORKERS) & (worker_id != DPU_SENDER_ID))",
               "worker_id {worker_id} outside 0..{max_worker}"),
    HeaderRule("bad_field", BadField, "(partition >= MAX_PARTITIONS)",
               "partition {partition} outside 0..{max_partition}"),
]

_TYPE_TABLE = {}
for _name, _tab in TYPE_TABLES.items():
    _a = np.zeros(256, np.int64)
    for _t, _v in _tab.items():
        _a[int(_t)] = _v
    _TYPE_TABLE[_name] = _a
_COMPILED_RULES = [compile(r.expr, f"<rule {i}: {r.reason}>", "eval") for i, r in enumerate(HEADER_RULES)]
#: reason name of each rule code (code 0 = valid, code i = HEADER_RULES[i - 1] broken)
RULE_REASONS = ["ok"] + [r.reason for r in HEADER_RULES]


def header_verdicts(hdr: np.ndarray, length) -> np.ndarray:
    """The header validator: per packet 0 when valid, else 1 + the index in HEADER_RULES of the
    first rule it breaks. ``hdr`` is any structured array with the HEADER_FIELDS names (big-endian
    views of packet buffers included), ``length`` the UDP payload lengths. Vectorized: one numpy pass
    per rule over the whole batch; :func:`validate_header` is this function on one row."""
    length = np.asarray(length, np.int64).reshape(-1)
    ns = {n: hdr[n].astype(np.int64) for n, _, _ in HEADER_FIELDS}
    ns["length"] = length
    ns.update(RULE_CONSTANTS)
    t = np.clip(ns["type"], 0, 255)
    for name, arr in _TYPE_TABLE.items():
        ns[name] = (lambda a: lambda _type: a[t])(arr)
    code = np.zeros(len(length), np.int64)
    for i in range(len(HEADER_RULES), 0, -1):  # backwards: the earliest broken rule wins
        code[np.asarray(eval(_COMPILED_RULES[i - 1], {"__builtins__": {}}, ns), bool)] = i
    return code


def header_ok(hdr: np.ndarray, length) -> np.ndarray:
    """True where a header is well formed (:func:`header_verdicts` == 0)."""
    return header_verdicts(hdr, length) == 0


def validate_header(h: Header, length: int) -> None:
    """Raise ProtocolError unless ``h`` is a well-formed header for a payload of ``length`` bytes.

    Checks only what a packet says about itself; flow checks (job, worker, partition ownership,
    index range, round window) belong to the receiver, which knows the job. This is
    :func:`header_verdicts` on one row: the rules exist once.
    """
    row = np.zeros(1, HEADER_DTYPE)
    for n, _, _ in HEADER_FIELDS:
        row[n] = getattr(h, n) & ((1 << (8 * HEADER_DTYPE[n].itemsize)) - 1) if HEADER_DTYPE[n].kind == "u" \
            else getattr(h, n)
    code = int(header_verdicts(row, [length])[0])
    if code:
        raise rule_error(code, {n: getattr(h, n) for n, _, _ in HEADER_FIELDS}, length)


def rule_error(code: int, fields: dict, length: int) -> ProtocolError:
    """The ProtocolError (subclass and sentence) of rule ``code`` for a header with ``fields``."""
    rule = HEADER_RULES[code - 1]
    t = fields["type"]
    ctx = dict(fields, length=length, **RULE_CONSTANTS,
               type_name=PacketType(t).name if t in TYPE_TABLES["TYPE_OK"] else str(t),
               max_entries=TYPE_TABLES["MAX_ENTRIES"].get(t, 0),
               want=int(payload_length(t, fields["count"])) if t in TYPE_TABLES["TYPE_OK"] else 0,
               bad_flags=fields["flags"] & ~FLAGS_VALID_MASK, max_worker=MAX_WORKERS - 1,
               max_partition=MAX_PARTITIONS - 1)
    return rule.error(rule.message.format(**ctx))


def parse_packet(buf: bytes | memoryview) -> tuple[Header, np.ndarray]:
    """Decode one UDP payload into (header, entries), for tests, tools and control packets (batches
    go through dosa.packetizer, vectorized).

    Sparse types give a SPARSE_ENTRY_DTYPE array (absolute index = base + offset, value), dense
    types an ``>i4`` array of the values of ``base, base + 1, ...``, RETX_REQUEST and STATUS ``>u4``.
    Raises ProtocolError (a subclass naming the broken rule) for anything malformed.
    """
    h = Header.unpack(buf)
    validate_header(h, len(buf))
    ptype = PacketType(h.type)
    blocks = PAYLOAD_BLOCKS[ptype]
    if not blocks:
        return h, np.zeros(0, np.uint8)
    if ptype in _SPARSE_TYPES:
        off = np.frombuffer(buf, SPARSE_OFFSET_DTYPE, count=h.count, offset=HDR_LEN)
        out = np.empty(h.count, SPARSE_ENTRY_DTYPE)
        out["index"] = h.base + off.astype(np.int64)
        out["value"] = np.frombuffer(buf, VALUE_DTYPE, count=h.count, offset=value_offset(h.count))
        return h, out
    return h, np.frombuffer(buf, np.dtype(blocks[0][1]), count=h.count, offset=HDR_LEN)


def build_packet(h: Header, entries: np.ndarray | None = None) -> bytes:
    """Encode a header and its entries. Sparse types take (absolute index, value) pairs (an (n, 2)
    array or SPARSE_ENTRY_DTYPE records), written as offsets from ``h.base``; other types the values.

    ``h.count`` is overwritten with the number of entries, so callers cannot make them disagree.
    Raises ValueError when an index is not within 0..65535 of ``h.base``.
    """
    from dataclasses import replace

    ptype = PacketType(h.type)
    if entries is None or not PAYLOAD_BLOCKS[ptype]:
        return replace(h, count=0).pack()
    e = np.asarray(entries)
    if ptype in _SPARSE_TYPES:
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
        if self.partition_size > MAX_PARTITION_SIZE:
            raise ValueError(f"partition_size {self.partition_size} over {MAX_PARTITION_SIZE}: sparse "
                             "offsets in a partition are u16")
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
STRIDE = stride_for_mtu(DEFAULT_MTU)  # 1472 = 46 x 32: every packet slot starts 32-byte aligned


@dataclass
class PacketBatch:
    """Packets in one contiguous buffer: packet i is ``data[i, :lengths[i]]``.

    A fixed stride (one MTU-sized slot per packet) makes building vectorized (a 2-D numpy view)
    and maps one-to-one onto the iovecs of sendmmsg/recvmmsg. ``dest`` says where each packet goes:
    the owning DPU's index for data packets, the host's rank for results (-1 = every host).
    """

    data: np.ndarray  # uint8, shape (n, stride), C-contiguous; stride = stride_for_mtu(job's MTU)
    lengths: np.ndarray  # int64, shape (n,)
    dest: np.ndarray  # int64, shape (n,)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def stride(self) -> int:
        return self.data.shape[1]

    @classmethod
    def empty(cls, n: int, stride: int = STRIDE) -> "PacketBatch":
        if stride % HDR_LEN or stride < HDR_LEN:
            raise ValueError(f"stride {stride} must be a positive multiple of {HDR_LEN}")
        return cls(np.zeros((n, stride), np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64))

    @classmethod
    def from_packets(cls, packets: list[bytes], dest=None, stride: int | None = None) -> "PacketBatch":
        longest = max((len(p) for p in packets), default=0)
        if stride is None:
            stride = max(STRIDE, -(-longest // HDR_LEN) * HDR_LEN)
        b = cls.empty(len(packets), stride)
        for i, p in enumerate(packets):
            if len(p) > stride:
                raise ProtocolError(f"packet {i} has {len(p)} bytes, more than the {stride}-byte slot")
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


# --------------------------------------------------------------------------------------------------
# The C rendering: dosa/dosa_wire.h (written by ``python -m dosa.gen_headers``; a test
# fails when the file differs from this text)
# --------------------------------------------------------------------------------------------------
_C_PREFIX = "DOSA_"


def _c_expr(expr: str) -> str:
    """A rule expression in C: fields -> ``f_<name>`` locals, constants -> ``DOSA_<NAME>``, tables ->
    ``dosa_<name>(type)`` calls."""
    import re

    fields = {n for n, _, _ in HEADER_FIELDS}

    def sub(m):
        w = m.group(0)
        if w in TYPE_TABLES:
            return f"dosa_{w.lower()}"
        if w in RULE_CONSTANTS:
            return _C_PREFIX + w
        if w in fields or w == "length":
            return f"f_{w}"
        raise ValueError(f"rule names {w!r}, which is neither a field, a constant nor a table")

    return re.sub(r"[A-Za-z_]\w*", sub, expr)


def c_header() -> str:
    """The text of dosa/dosa_wire.h: constants, the header struct, the per-type tables and the
    header check of the XDP program, all from this module."""
    ntoh = {1: "", 2: "dosa_ntohs", 4: "dosa_ntohl"}
    out = [
        f"/* dosa wire protocol v{VERSION}: GENERATED from dosa/wire.py by `python -m dosa.gen_headers`;",
        " * do not edit (tests/unit/test_wire_c_header.py fails when this file and wire.py differ).",
        " * Spec: docs/protocol.md. All fields big-endian. The check returns DOSA_C_* counters of",
        " * dosa/counters.py, whose enum is below. */",
        "#ifndef DOSA_WIRE_H", "#define DOSA_WIRE_H", "", "#include <linux/types.h>", "",
        "#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__",
        "#define dosa_ntohs(x) ((__u16)__builtin_bswap16(x))",
        "#define dosa_ntohl(x) ((__u32)__builtin_bswap32(x))",
        "#define dosa_htons(x) ((__u16)__builtin_bswap16(x))",
        "#else", "#define dosa_ntohs(x) ((__u16)(x))", "#define dosa_ntohl(x) ((__u32)(x))",
        "#define dosa_htons(x) ((__u16)(x))", "#endif", "",
    ]
    consts = dict(MAGIC=f"0x{MAGIC:08X}u", VERSION=VERSION, HDR_LEN=HDR_LEN,
                  SPARSE_ENTRY_LEN=SPARSE_ENTRY_LEN, DENSE_ENTRY_LEN=DENSE_ENTRY_LEN,
                  RETX_ENTRY_LEN=RETX_ENTRY_LEN, STATUS_ENTRY_LEN=STATUS_ENTRY_LEN,
                  MAX_SPARSE_ENTRIES=MAX_SPARSE_ENTRIES, MAX_DENSE_ENTRIES=MAX_DENSE_ENTRIES,
                  MAX_RETX_ENTRIES=MAX_RETX_ENTRIES, MAX_MTU=MAX_MTU,
                  RX_MAX_SPARSE_ENTRIES=RX_MAX_SPARSE_ENTRIES, RX_MAX_DENSE_ENTRIES=RX_MAX_DENSE_ENTRIES,
                  MAX_PARTITION_SIZE=MAX_PARTITION_SIZE, MAX_SPARSE_BASE=f"0x{MAX_SPARSE_BASE:08X}u",
                  MAX_PACKETS_PER_CONTRIBUTION=MAX_PACKETS_PER_CONTRIBUTION, MAX_WORKERS=MAX_WORKERS,
                  MAX_PARTITIONS=MAX_PARTITIONS, DPU_SENDER_ID=f"0x{DPU_SENDER_ID:04X}",
                  SCALE_EXP_MIN=f"({SCALE_EXP_MIN})", SCALE_EXP_MAX=SCALE_EXP_MAX)
    out += [f"#define {_C_PREFIX}{k} {v}" for k, v in consts.items()]
    out += ["", counters.c_enum().rstrip()]
    out += ["", "enum dosa_type {"] + [f"\tDOSA_T_{t.name} = {int(t)}," for t in PacketType] + ["};", ""]
    out += [f"#define DOSA_F_{f.name} 0x{int(f):04X}" for f in Flags if int(f)]
    out.append(f"#define DOSA_F_VALID_MASK 0x{FLAGS_VALID_MASK:04X}")
    out += ["", "struct dosa_hdr {"]
    out += [f"\t{c} {n};" for n, _, c in HEADER_FIELDS]
    out += ["} __attribute__((packed, aligned(4)));", ""]
    sp = PAYLOAD_BLOCKS[PacketType.SPARSE_DATA]
    assert [np.dtype(d).itemsize for _, d in sp] == [2, 4] and value_offset(3) == HDR_LEN + 8
    out += ["/* Sparse payload: count x u16 offset (index = base + offset), zero-padded to 4 bytes, then",
            " * count x s32 value starting at this byte offset from the dosa header. */",
            "#define DOSA_VALUE_OFFSET(count) (DOSA_HDR_LEN + 2 * (count) + 2 * ((count) & 1))", ""]
    for name, tab in TYPE_TABLES.items():
        out.append(f"static __always_inline __u32 dosa_{name.lower()}(__u32 type)\n{{")
        for t, v in tab.items():
            if v:
                out.append(f"\tif (type == DOSA_T_{PacketType(t).name})\n\t\treturn {v};")
        out.append("\treturn 0;\n}\n")
    out.append("/* What a packet says about itself (dosa/wire.py HEADER_RULES, in order): the counter of")
    out.append(" * the first broken rule, or -1 when the header is well formed for a plen-byte payload. */")
    out.append("static __always_inline int dosa_check_header(const struct dosa_hdr *h, __u32 plen)\n{")
    out.append("\t__s64 f_length = plen;")
    for n, dt, _ in HEADER_FIELDS:
        size = np.dtype(dt).itemsize
        cast = "(__s8)" if np.dtype(dt).kind == "i" else ""
        out.append(f"\t__s64 f_{n} = {cast}{ntoh[size]}(h->{n});")
    for r in HEADER_RULES:
        out.append(f"\tif ({_c_expr(r.expr)})\n\t\treturn DOSA_C_{r.reason.upper()};")
    out.append("\t(void)f_job_id;\n\t(void)f_round;\n\treturn -1;\n}\n")
    out.append("#endif /* DOSA_WIRE_H */")
    return "\n".join(out) + "\n"
