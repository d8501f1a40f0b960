"""The dosa wire protocol, version 2: the one definition every component uses.

The packetizer and parser (``dosa.packetizer``: hosts' data, DPU workers' results), the scapy layer
(``dosa.scapy_layer``), the Wireshark dissector (``dosa.wireshark``), the capture reader and the
tests take field names, sizes, offsets, constants and the header rules from here; ``dosa/dosa_wire.h``
is generated from it (``python -m dosa.gen_headers``), the XDP program's header check included,
and ``tests/unit/test_wire_c_header.py`` fails when they drift.
The spec in prose is ``docs/protocol.md``.

One definition, four modules, each with one job; import the names from here (``from dosa import
wire``, ``from dosa.wire import PacketType``), which re-exports them all:

* ``dosa.wire_format``: the layout (constants, MTU sizes, packet types and flags, the payload
  blocks, the header fields and their dtypes, ``Header``, ``build_packet``, the errors);
* ``dosa.wire_rules``: when a header is well formed (``HEADER_RULES``, evaluated vectorized by
  ``header_verdicts``; ``validate_header``, ``parse_packet``);
* ``dosa.wire_batch``: the index space cut into partitions (``PartitionMap``) and many packets in one
  buffer (``PacketBatch``);
* ``dosa.wire_c``: the C rendering (``c_header``, and ``c_pxd``, its Cython declarations).
"""
from dosa.wire_format import (  # noqa: F401
    MAGIC, VERSION, DEFAULT_PORT, IPV4_HDR_LEN, UDP_HDR_LEN, ETH_HDR_LEN, HDR_LEN,
    PACKET_OVERHEAD, DEFAULT_MTU, MIN_MTU, MAX_MTU, MTU, max_udp_payload, check_mtu,
    stride_for_mtu, MAX_UDP_PAYLOAD, MAX_BODY, MAX_PACKETS_PER_CONTRIBUTION, MAX_WORKERS,
    MAX_PARTITIONS, MAX_PARTITION_SIZE, MAX_SPARSE_BASE, DPU_SENDER_ID, SCALE_EXP_MIN,
    SCALE_EXP_MAX, INT32_MAX, PacketType, Flags, FLAGS_VALID_MASK, PAYLOAD_BLOCKS, ENTRY_LEN,
    ODD_PAD, SPARSE_ENTRY_LEN, DENSE_ENTRY_LEN, RETX_ENTRY_LEN, STATUS_ENTRY_LEN, SPARSE_TYPES,
    DENSE_TYPES, SEQUENCED_TYPES, payload_length, value_offset, entries_per_packet,
    encoded_bytes, MAX_SPARSE_ENTRIES, MAX_DENSE_ENTRIES, MAX_RETX_ENTRIES, MAX_ENTRIES,
    RX_MAX_SPARSE_ENTRIES, RX_MAX_DENSE_ENTRIES, HEADER_FIELDS, HEADER_DTYPE,
    SPARSE_ENTRY_DTYPE, SPARSE_OFFSET_DTYPE, VALUE_DTYPE, DENSE_ENTRY_DTYPE, RETX_ENTRY_DTYPE,
    ProtocolError, TruncatedPacket, BadMagic, BadVersion, BadType, CountMismatch, BadField,
    Header, build_packet,
)
from dosa.wire_rules import (  # noqa: F401
    HeaderRule, RULE_CONSTANTS, TYPE_TABLES, HEADER_RULES, RULE_REASONS, header_verdicts,
    header_ok, validate_header, rule_error, parse_packet,
)
from dosa.wire_batch import (  # noqa: F401
    DEFAULT_PARTITION_SIZE, PartitionMap, STRIDE, PacketBatch,
)
from dosa.wire_c import (  # noqa: F401
    c_header, c_pxd,
)
