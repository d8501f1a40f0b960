"""What a dosa packet says about itself, and when it is well formed: the header rules, ONE table
(part of :mod:`dosa.wire`, which re-exports every name here).

The table is evaluated vectorized in Python (:func:`header_verdicts`, what receivers and the
capture tools run) and rendered as the C check of the XDP program and the hosts' round engine
(``dosa_check_header`` of ``dosa/dosa_wire.h``, by ``dosa.wire_c``), so the two cannot disagree.
Flow checks (job, worker, partition ownership, index range, round window) belong to the receiver,
which knows the job.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dosa.wire_format import (
    DPU_SENDER_ID, ENTRY_LEN, FLAGS_VALID_MASK, HDR_LEN, HEADER_DTYPE, HEADER_FIELDS, MAGIC,
    MAX_ENTRIES, MAX_PACKETS_PER_CONTRIBUTION, MAX_PARTITIONS, MAX_SPARSE_BASE, MAX_WORKERS, ODD_PAD,
    DENSE_TYPES, PAYLOAD_BLOCKS, SCALE_EXP_MAX, SCALE_EXP_MIN, SEQUENCED_TYPES, SPARSE_ENTRY_DTYPE,
    SPARSE_OFFSET_DTYPE, SPARSE_TYPES, VALUE_DTYPE, VERSION, BadField, BadMagic, BadType, BadVersion,
    CountMismatch, Flags, Header, PacketType, ProtocolError, TruncatedPacket, payload_length,
    value_offset,
)


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

#: Per-type tables a rule may call (``NAME(type)``): value per PacketType, 0 for any other type.
#: C renders each as a ``dosa_<name>(type)`` function of the generated header.
TYPE_TABLES = {
    "TYPE_OK": {t: 1 for t in PacketType},
    "SEQUENCED": {t: 1 for t in SEQUENCED_TYPES},  # part of a (round, partition) contribution
    "SPARSE": {t: 1 for t in SPARSE_TYPES},
    "DENSE": {t: 1 for t in DENSE_TYPES},  # one s32 value per index from base (no rule names it yet)
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
    if ptype in SPARSE_TYPES:
        off = np.frombuffer(buf, SPARSE_OFFSET_DTYPE, count=h.count, offset=HDR_LEN)
        out = np.empty(h.count, SPARSE_ENTRY_DTYPE)
        out["index"] = h.base + off.astype(np.int64)
        out["value"] = np.frombuffer(buf, VALUE_DTYPE, count=h.count, offset=value_offset(h.count))
        return h, out
    return h, np.frombuffer(buf, np.dtype(blocks[0][1]), count=h.count, offset=HDR_LEN)
