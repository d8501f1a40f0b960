"""The C view of the wire: ``dosa/dosa_wire.h``, rendered from :mod:`dosa.wire_format`,
:mod:`dosa.wire_rules` and :mod:`dosa.counters` (``python -m dosa.gen_headers`` writes it;
tests/unit/test_wire_c_header.py fails when the file differs from :func:`c_header`). The XDP
program and the compiled host code include it, so no C code spells a field, a size or a rule by
hand. Re-exported by :mod:`dosa.wire` (``wire.c_header``).
"""
from __future__ import annotations

import re

import numpy as np

from dosa import counters
from dosa.wire_format import (
    DENSE_ENTRY_LEN, DPU_SENDER_ID, FLAGS_VALID_MASK, HDR_LEN, HEADER_FIELDS, MAGIC, MAX_DENSE_ENTRIES,
    MAX_MTU, MAX_PACKETS_PER_CONTRIBUTION, MAX_PARTITION_SIZE, MAX_PARTITIONS, MAX_RETX_ENTRIES,
    MAX_SPARSE_BASE, MAX_SPARSE_ENTRIES, MAX_WORKERS, PAYLOAD_BLOCKS, RETX_ENTRY_LEN,
    RX_MAX_DENSE_ENTRIES, RX_MAX_SPARSE_ENTRIES, SCALE_EXP_MAX, SCALE_EXP_MIN, SPARSE_ENTRY_LEN,
    STATUS_ENTRY_LEN, VERSION, Flags, PacketType, value_offset,
)
from dosa.wire_rules import HEADER_RULES, RULE_CONSTANTS, TYPE_TABLES

_C_PREFIX = "DOSA_"


def _c_expr(expr: str) -> str:
    """A rule expression in C: fields -> ``f_<name>`` locals, constants -> ``DOSA_<NAME>``, tables ->
    ``dosa_<name>(type)`` calls."""
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
