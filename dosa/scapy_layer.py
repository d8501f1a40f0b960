"""Scapy layer for the dosa wire protocol: build, parse and display dosa packets in captures.

Everything is generated from ``dosa.wire``'s tables, so this layer cannot drift from the one
definition: the header fields from ``HEADER_FIELDS`` (names, order, sizes), the payload from
``PAYLOAD_BLOCKS`` (one list field per block, ``offsets`` / ``values`` / ``seqs`` / ``worker_ids``,
present for the packet types that carry it, each block zero-padded to 4 bytes). Only the
presentation is chosen here (hex magic, enum ``type``, named ``flags``, ``count`` computed from the
lists when left as None). The payload is sized by ``count`` and ``type`` alone, exactly as the spec
says.

Usage::

    >>> from dosa.scapy_layer import Dosa
    >>> p = Dosa(type="SPARSE_DATA", job_id=7, base=4096, offsets=[3], values=[-5])
    >>> p.indices()   # absolute indices: base + offset
    [4099]
    >>> bytes(p) == dosa.wire.build_packet(Header(job_id=7, base=4096), np.array([[4099, -5]]))
    True

Importing this module binds the layer to UDP ``DEFAULT_PORT`` (source or destination); call
``bind_port(p)`` for a deployment that uses another port. Style follows scapy's contrib layers
(``scapy/contrib/roce.py``).
"""
from __future__ import annotations

import numpy as np
from scapy.fields import (ByteEnumField, ByteField, ConditionalField, FieldListField, FlagsField,
                          IntField, ShortField, SignedByteField, SignedIntField, StrFixedLenField,
                          XIntField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_layers

from dosa import wire

#: type value -> name, for ByteEnumField (shows ``SPARSE_DATA`` instead of ``1``).
DOSA_TYPES = {int(t): t.name for t in wire.PacketType}
#: payload block name (wire.PAYLOAD_BLOCKS) -> the scapy list field that carries it
BLOCK_FIELDS = {"offset": "offsets", "value": "values", "seq": "seqs", "worker_id": "worker_ids"}
_ELEMENT = {">u2": ShortField, ">i4": SignedIntField, ">u4": IntField}


def _flag_names() -> list[str]:
    """Flag names indexed by bit position (FlagsField's convention), from ``wire.Flags``."""
    bits = {int(f).bit_length() - 1: f.name for f in wire.Flags if int(f)}
    width = max(bits) + 1
    return [bits.get(i, f"bit{i}") for i in range(width)]


def _types_with(block: str) -> set[int]:
    return {int(t) for t, blocks in wire.PAYLOAD_BLOCKS.items() if block in dict(blocks)}


def _n(pkt) -> int:
    """Entries of ``pkt``: its count, or (count left as None) the length of its first list."""
    if pkt.count is not None:
        return pkt.count
    blocks = wire.PAYLOAD_BLOCKS[wire.PacketType(pkt.type)] if pkt.type in DOSA_TYPES else ()
    return len(getattr(pkt, BLOCK_FIELDS[blocks[0][0]]) or []) if blocks else 0


class _CountField(ShortField):
    """``count``: None on build means "the number of entries in the lists"."""

    def i2m(self, pkt, x):
        return _n(pkt) if x is None else x


def _payload_fields() -> list:
    """One list field per payload block, and a 2-byte pad after a 2-byte block of odd length."""
    out, seen = [], set()
    for blocks in wire.PAYLOAD_BLOCKS.values():
        for name, dt in blocks:
            if name in seen:
                continue
            seen.add(name)
            types = _types_with(name)
            field = FieldListField(BLOCK_FIELDS[name], [], _ELEMENT[dt](name, 0),
                                   count_from=lambda pkt: _n(pkt), max_count=max(wire.MAX_ENTRIES.values()))
            out.append(ConditionalField(field, lambda pkt, types=types: pkt.type in types))
            if np.dtype(dt).itemsize == 2:
                out.append(ConditionalField(
                    StrFixedLenField(f"{name}_pad", b"\0\0", 2),
                    lambda pkt, types=types: pkt.type in types and _n(pkt) & 1))
    return out


_SCALAR = {  # numpy dtype of HEADER_FIELDS -> scapy field class with the same size and sign
    ">u4": IntField,
    ">u2": ShortField,
    "u1": ByteField,
    "i1": SignedByteField,
}
_DEFAULTS = {"magic": wire.MAGIC, "version": wire.VERSION, "type": int(wire.PacketType.SPARSE_DATA),
             "job_id": 1, "total": 1}


def _header_field(name: str, dtype: str):
    size = 8 * np.dtype(dtype).itemsize
    default = _DEFAULTS.get(name, 0)
    if name == "magic":
        return XIntField(name, default)
    if name == "type":
        return ByteEnumField(name, default, DOSA_TYPES)
    if name == "flags":
        return FlagsField(name, default, size, _flag_names())
    if name == "count":
        return _CountField(name, None)
    return _SCALAR[dtype](name, default)


class Dosa(Packet):
    """The dosa header (fields from ``wire.HEADER_FIELDS``) followed by its payload blocks."""

    name = "DOSA"
    fields_desc = [_header_field(n, t) for n, t, _ in wire.HEADER_FIELDS] + _payload_fields()

    def extract_padding(self, s):
        # Bytes beyond the payload ``count`` sizes are not part of the packet (a count mismatch).
        return b"", s

    def indices(self) -> list[int]:
        """Absolute indices of the entries: base + offset (sparse), base + position (dense)."""
        if self.type in _types_with("offset"):
            return [self.base + o for o in self.offsets]
        if self.type in _types_with("value"):
            return [self.base + i for i in range(len(self.values))]
        return []

    def mysummary(self):
        return self.sprintf(
            "DOSA %type% job=%job_id% w=%worker_id% p=%partition% r=%round% "
            "seq=%seq%/%total% n=%count% flags=%flags%")


assert len(Dosa().build()) == wire.HDR_LEN


def bind_port(port: int) -> None:
    """Dissect UDP packets to or from ``port`` as dosa (deployments may configure any port).

    ``UDP()/Dosa()`` then gets ``dport=port`` (the last port bound); the source-port binding is
    dissection only, so a built packet keeps its own source port.
    """
    bind_bottom_up(UDP, Dosa, sport=port)
    bind_layers(UDP, Dosa, dport=port)


bind_port(wire.DEFAULT_PORT)
