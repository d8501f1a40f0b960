"""Scapy layer for the dosa wire protocol: build, parse and display dosa packets in captures.

The header fields are generated from ``dosa.wire.HEADER_FIELDS`` (names, order and sizes) so this
layer cannot drift from the one definition; only the presentation is chosen here (hex magic, enum
``type``, named ``flags``, ``count`` computed from the entry list when left as None). The payload is
sized by ``count`` alone, exactly as the spec says, and the entry class is chosen by ``type``.

Usage::

    >>> from dosa.scapy_layer import Dosa, DosaSparseEntry
    >>> p = Dosa(type="SPARSE_DATA", job_id=7, entries=[DosaSparseEntry(index=3, value=-5)])
    >>> bytes(p) == dosa.wire.build_packet(Header(job_id=7), np.array([[3, -5]]))
    True

Importing this module binds the layer to UDP ``DEFAULT_PORT`` (source or destination); call
``bind_port(p)`` for a deployment that uses another port. Style follows scapy's contrib layers
(``scapy/contrib/roce.py``).
"""
from __future__ import annotations

from scapy.fields import (ByteEnumField, ByteField, FieldLenField, FlagsField, IntField,
                          PacketListField, ShortField, SignedByteField, SignedIntField, XIntField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_layers

from dosa import wire

#: type value -> name, for ByteEnumField (shows ``SPARSE_DATA`` instead of ``1``).
DOSA_TYPES = {int(t): t.name for t in wire.PacketType}


def _flag_names() -> list[str]:
    """Flag names indexed by bit position (FlagsField's convention), from ``wire.Flags``."""
    bits = {int(f).bit_length() - 1: f.name for f in wire.Flags if int(f)}
    width = max(bits) + 1
    return [bits.get(i, f"bit{i}") for i in range(width)]


class DosaSparseEntry(Packet):
    """(u32 index, s32 value): SPARSE_DATA values and SPARSE_RESULT sums."""

    name = "DosaSparseEntry"
    fields_desc = [IntField("index", 0), SignedIntField("value", 0)]

    def extract_padding(self, s):
        return b"", s


class DosaDenseEntry(Packet):
    """One s32 value of DENSE_DATA / DENSE_RESULT, for index ``base + position``."""

    name = "DosaDenseEntry"
    fields_desc = [SignedIntField("value", 0)]

    def extract_padding(self, s):
        return b"", s


class DosaRetxEntry(Packet):
    """One u32 result sequence number a host asks to be resent (RETX_REQUEST)."""

    name = "DosaRetxEntry"
    fields_desc = [IntField("seq", 0)]

    def extract_padding(self, s):
        return b"", s


class DosaStatusEntry(Packet):
    """One u32 worker_id the DPU is still waiting for (STATUS)."""

    name = "DosaStatusEntry"
    fields_desc = [IntField("worker_id", 0)]

    def extract_padding(self, s):
        return b"", s


ENTRY_CLASSES = {
    wire.PacketType.SPARSE_DATA: DosaSparseEntry,
    wire.PacketType.SPARSE_RESULT: DosaSparseEntry,
    wire.PacketType.DENSE_DATA: DosaDenseEntry,
    wire.PacketType.DENSE_RESULT: DosaDenseEntry,
    wire.PacketType.RETX_REQUEST: DosaRetxEntry,
    wire.PacketType.STATUS: DosaStatusEntry,
}
# Every type with entries has a class, and each class is exactly one wire entry long: a new packet
# type in wire.py fails this import until it gets its entry class here.
assert {t for t, n in wire.ENTRY_LEN.items() if n} == set(ENTRY_CLASSES), "entry class missing"
assert all(len(c()) == wire.ENTRY_LEN[t] for t, c in ENTRY_CLASSES.items())


def _entry(s: bytes, _parent=None) -> Packet:
    """Dissect one entry; its class depends on the enclosing packet's ``type``."""
    cls = ENTRY_CLASSES.get(_parent.type if _parent is not None else None)
    if cls is None:  # HEARTBEAT or an unknown type claiming entries: keep the bytes visible
        from scapy.packet import Raw

        return Raw(s)
    return cls(s)


_SCALAR = {  # numpy dtype of HEADER_FIELDS -> scapy field class with the same size and sign
    ">u4": IntField,
    ">u2": ShortField,
    "u1": ByteField,
    "i1": SignedByteField,
}
_DEFAULTS = {"magic": wire.MAGIC, "version": wire.VERSION, "type": int(wire.PacketType.SPARSE_DATA),
             "job_id": 1, "total": 1}


def _header_field(name: str, dtype: str):
    size = 8 * wire.np.dtype(dtype).itemsize
    default = _DEFAULTS.get(name, 0)
    if name == "magic":
        return XIntField(name, default)
    if name == "type":
        return ByteEnumField(name, default, DOSA_TYPES)
    if name == "flags":
        return FlagsField(name, default, size, _flag_names())
    if name == "count":
        return FieldLenField(name, None, count_of="entries", fmt="!" + wire.np.dtype(dtype).char)
    return _SCALAR[dtype](name, default)


class Dosa(Packet):
    """The dosa v1 header (fields from ``wire.HEADER_FIELDS``) followed by ``count`` entries."""

    name = "DOSA"
    fields_desc = [_header_field(n, t) for n, t, _ in wire.HEADER_FIELDS] + [
        PacketListField("entries", [], _entry, count_from=lambda pkt: pkt.count,
                        max_count=max(wire.MAX_ENTRIES.values())),
    ]

    def extract_padding(self, s):
        # Bytes beyond ``count`` entries are not part of the packet (a count mismatch on the wire).
        return b"", s

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
