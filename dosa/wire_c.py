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
    DENSE_ENTRY_LEN, DPU_SENDER_ID, FLAGS_VALID_MASK, HDR_LEN, HEADER_DTYPE, HEADER_FIELDS, MAGIC,
    MAX_DENSE_ENTRIES,
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


#: The name of each payload layout in the accessors' names (``dosa_<layout>_<block>``): the types
#: that share a layout share accessors.
_LAYOUT_NAMES = {PacketType.SPARSE_DATA: "sparse", PacketType.SPARSE_RESULT: "sparse",
                 PacketType.DENSE_DATA: "dense", PacketType.DENSE_RESULT: "dense",
                 PacketType.RETX_REQUEST: "retx", PacketType.STATUS: "status"}
_C_INT = {("u", 1): "__u32", ("u", 2): "__u32", ("u", 4): "__u32", ("i", 1): "__s32",
          ("i", 4): "__s32"}


def _load(size: int, kind: str, at: str) -> str:
    """C reading a ``size``-byte big-endian integer at byte ``at`` of packet ``pk``, in host order."""
    expr = {1: f"pk[{at}]", 2: f"dosa_get_be16(pk + {at})", 4: f"dosa_get_be32(pk + {at})"}[size]
    return f"(__s8){expr}" if (kind, size) == ("i", 1) else f"(__s32){expr}" if kind == "i" else expr


def accessors() -> list[tuple[str, str, list[tuple[str, str]], str]]:
    """The packet accessors of the C header, as (return type, name, [(type, param)], body): a
    getter per header field (``dosa_hdr_<field>(pk)``, at its offset in HEADER_DTYPE), and a getter
    and a writer per payload block (``dosa_<layout>_<block>(pk, count, j)``: entry j of a packet of
    ``count`` entries; ``dosa_put_<layout>_<block>(pk, count, j, v)``), each block at the offset
    PAYLOAD_BLOCKS gives it (the blocks before it, each padded to 4 bytes). Rendered as C functions
    into dosa_wire.h and as Cython declarations into dosa_wire.pxd, from this one list."""
    pk = [("const __u8 *", "pk")]
    out = []
    for name, dt, _ in HEADER_FIELDS:
        d = np.dtype(dt)
        off = HEADER_DTYPE.fields[name][1]
        out.append((_C_INT[d.kind, d.itemsize], f"dosa_hdr_{name}", pk,
                    f"return {_load(d.itemsize, d.kind, str(off))};"))
    entry = [("__u32", "count"), ("__u32", "j")]
    done = set()
    for t, blocks in PAYLOAD_BLOCKS.items():
        layout = _LAYOUT_NAMES.get(t)
        if layout is None or layout in done:
            continue
        done.add(layout)
        start = "DOSA_HDR_LEN"
        for block, dt in blocks:
            d = np.dtype(dt)
            at = f"{start} + {d.itemsize} * j"
            ctype = _C_INT[d.kind, d.itemsize]
            unused = "" if "count" in at else "(void)count;\n\t"  # same parameters for every block
            out.append((ctype, f"dosa_{layout}_{block}", pk + entry,
                        f"{unused}return {_load(d.itemsize, d.kind, at)};"))
            put = {2: "dosa_put_be16", 4: "dosa_put_be32"}[d.itemsize]
            out.append(("void", f"dosa_put_{layout}_{block}", [("__u8 *", "pk")] + entry + [(ctype, "v")],
                        f"{unused}{put}(pk + {at}, (__u32)v);"))
            pad = f" + 2 * (count & 1)" if d.itemsize == 2 else ""
            start = f"{start} + {d.itemsize} * count{pad}"
        if any(np.dtype(d).itemsize == 2 for _, d in blocks):
            out.append(("void", f"dosa_put_{layout}_pad", [("__u8 *", "pk"), ("__u32", "count")],
                        _pad_body(blocks)))
    return out


def _pad_body(blocks) -> str:
    """The writer of the zero padding after an odd count of 2-byte elements (the first such block)."""
    start = "DOSA_HDR_LEN"
    for _, dt in blocks:
        size = np.dtype(dt).itemsize
        if size == 2:
            return f"if (count & 1)\n\t\tdosa_put_be16(pk + {start} + 2 * count, 0);"
        start = f"{start} + {size} * count"
    raise ValueError("no 2-byte block")


_BYTE_ORDER = """/* Big-endian integers at a byte pointer (any alignment), in host order: every reader and writer
 * of a packet's fields and entries below goes through these. */
static __always_inline __u32 dosa_get_be16(const __u8 *p)
{
\treturn ((__u32)p[0] << 8) | p[1];
}

static __always_inline __u32 dosa_get_be32(const __u8 *p)
{
\treturn ((__u32)p[0] << 24) | ((__u32)p[1] << 16) | ((__u32)p[2] << 8) | p[3];
}

static __always_inline void dosa_put_be16(__u8 *p, __u32 v)
{
\tp[0] = (__u8)(v >> 8);
\tp[1] = (__u8)v;
}

static __always_inline void dosa_put_be32(__u8 *p, __u32 v)
{
\tp[0] = (__u8)(v >> 24);
\tp[1] = (__u8)(v >> 16);
\tp[2] = (__u8)(v >> 8);
\tp[3] = (__u8)v;
}
"""


def _constants() -> dict[str, object]:
    """The #define constants (``DOSA_<NAME>``), as C spells them."""
    return dict(MAGIC=f"0x{MAGIC:08X}u", VERSION=VERSION, HDR_LEN=HDR_LEN,
                SPARSE_ENTRY_LEN=SPARSE_ENTRY_LEN, DENSE_ENTRY_LEN=DENSE_ENTRY_LEN,
                RETX_ENTRY_LEN=RETX_ENTRY_LEN, STATUS_ENTRY_LEN=STATUS_ENTRY_LEN,
                MAX_SPARSE_ENTRIES=MAX_SPARSE_ENTRIES, MAX_DENSE_ENTRIES=MAX_DENSE_ENTRIES,
                MAX_RETX_ENTRIES=MAX_RETX_ENTRIES, MAX_MTU=MAX_MTU,
                RX_MAX_SPARSE_ENTRIES=RX_MAX_SPARSE_ENTRIES, RX_MAX_DENSE_ENTRIES=RX_MAX_DENSE_ENTRIES,
                MAX_PARTITION_SIZE=MAX_PARTITION_SIZE, MAX_SPARSE_BASE=f"0x{MAX_SPARSE_BASE:08X}u",
                MAX_PACKETS_PER_CONTRIBUTION=MAX_PACKETS_PER_CONTRIBUTION, MAX_WORKERS=MAX_WORKERS,
                MAX_PARTITIONS=MAX_PARTITIONS, DPU_SENDER_ID=f"0x{DPU_SENDER_ID:04X}",
                SCALE_EXP_MIN=f"({SCALE_EXP_MIN})", SCALE_EXP_MAX=SCALE_EXP_MAX)


def _c_preamble() -> list[str]:
    return [
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


def _c_definitions() -> list[str]:
    """Constants, the counter and type enums, the flags, the header struct, the value offset."""
    out = [f"#define {_C_PREFIX}{k} {v}" for k, v in _constants().items()]
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
    return out


def _c_type_tables() -> list[str]:
    out = []
    for name, tab in TYPE_TABLES.items():
        out.append(f"static __always_inline __u32 dosa_{name.lower()}(__u32 type)\n{{")
        for t, v in tab.items():
            if v:
                out.append(f"\tif (type == DOSA_T_{PacketType(t).name})\n\t\treturn {v};")
        out.append("\treturn 0;\n}\n")
    return out


def _c_check() -> list[str]:
    """dosa_check_header: HEADER_RULES in order, on the struct's fields in host order."""
    ntoh = {1: "", 2: "dosa_ntohs", 4: "dosa_ntohl"}
    out = ["/* What a packet says about itself (dosa/wire.py HEADER_RULES, in order): the counter of",
           " * the first broken rule, or -1 when the header is well formed for a plen-byte payload. */",
           "static __always_inline int dosa_check_header(const struct dosa_hdr *h, __u32 plen)\n{",
           "\t__s64 f_length = plen;"]
    for n, dt, _ in HEADER_FIELDS:
        size = np.dtype(dt).itemsize
        cast = "(__s8)" if np.dtype(dt).kind == "i" else ""
        out.append(f"\t__s64 f_{n} = {cast}{ntoh[size]}(h->{n});")
    for r in HEADER_RULES:
        out.append(f"\tif ({_c_expr(r.expr)})\n\t\treturn DOSA_C_{r.reason.upper()};")
    out.append("\t(void)f_job_id;\n\t(void)f_round;\n\treturn -1;\n}\n")
    return out


def _c_accessors() -> list[str]:
    out = [_BYTE_ORDER,
           "/* A packet's header fields and entries at the byte pointer pk to its first header byte, in",
           " * host order (dosa/wire.py HEADER_FIELDS and PAYLOAD_BLOCKS): dosa_hdr_<field>(pk);",
           " * dosa_<layout>_<block>(pk, count, j) is entry j of a packet of count entries and",
           " * dosa_put_<layout>_<block>(pk, count, j, v) writes it. No caller spells an offset. */"]
    for ret, name, params, body in accessors():
        args = ", ".join(f"{t}{'' if t.endswith('*') else ' '}{n}" for t, n in params)
        out.append(f"static __always_inline {ret} {name}({args})\n{{\n\t{body}\n}}\n")
    return out


def c_header() -> str:
    """The text of dosa/dosa_wire.h: constants, the header struct, the per-type tables, the header
    check of the XDP program and the packet accessors, all from dosa.wire."""
    out = (_c_preamble() + _c_definitions() + _c_type_tables() + _c_check() + _c_accessors()
           + ["#endif /* DOSA_WIRE_H */"])
    return "\n".join(out) + "\n"


#: C types of the accessors as Cython spells them
_PXD_TYPES = {"__u32": "uint32_t", "__s32": "int32_t", "void": "void", "const __u8 *": "const uint8_t *",
              "__u8 *": "uint8_t *"}


def c_pxd() -> str:
    """The text of dosa/dosa_wire.pxd: the Cython declarations of what dosa_wire.h defines (the
    constants, the type and counter enums, the header check and the accessors), so the compiled
    modules cimport them instead of declaring any by hand."""
    ints = [k for k, v in _constants().items() if not str(v).endswith("u")]
    unsigned = [k for k, v in _constants().items() if str(v).endswith("u")]
    out = ["# GENERATED from dosa/wire.py by `python -m dosa.gen_headers`; do not edit",
           "# (tests/unit/test_wire_c_header.py fails when this file and wire.py differ). The Cython",
           "# view of dosa/dosa_wire.h: cimport from here (dosa.dosa_wire), never declare by hand.",
           "from libc.stdint cimport int32_t, uint8_t, uint32_t", "",
           'cdef extern from "dosa_wire.h" nogil:', "    enum:"]
    names = ([f"DOSA_{k}" for k in ints] + [f"DOSA_T_{t.name}" for t in PacketType]
             + [f"DOSA_F_{f.name}" for f in Flags if int(f)] + ["DOSA_F_VALID_MASK"]
             + [f"DOSA_C_{c.name}" for c in counters.Counter] + ["DOSA_NUM_COUNTERS"])
    out += [f"        {n}" for n in names]
    out += [f"    const uint32_t DOSA_{k}" for k in unsigned]
    out += ["", "    struct dosa_hdr:", "        pass", "",
            "    int dosa_check_header(const dosa_hdr *h, uint32_t plen)",
            "    uint32_t dosa_value_offset \"DOSA_VALUE_OFFSET\" (uint32_t count)"]
    for name in TYPE_TABLES:
        out.append(f"    uint32_t dosa_{name.lower()}(uint32_t type)")
    for ret, name, params, _ in accessors():
        args = ", ".join(f"{_PXD_TYPES[t]}{'' if t.endswith('*') else ' '}{n}" for t, n in params)
        out.append(f"    {_PXD_TYPES[ret]} {name}({args})")
    return "\n".join(out) + "\n"
