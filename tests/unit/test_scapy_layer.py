"""dosa.scapy_layer: packets built with scapy are byte-identical to dosa.wire.build_packet, and scapy
dissects what dosa.wire and dosa.packetizer produce, field for field."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Padding

from dosa import wire
from dosa.scapy_layer import BLOCK_FIELDS, Dosa, bind_port
from dosa.wire import Flags, Header, PacketType, PartitionMap
from dosa.packetizer import packetize

pytestmark = pytest.mark.timeout(60)

HEADER_NAMES = [n for n, _, _ in wire.HEADER_FIELDS]
SPARSE = (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT)
DENSE = (PacketType.DENSE_DATA, PacketType.DENSE_RESULT)


def _entries_for(ptype, n, rng, base):
    if ptype in SPARSE:
        return np.stack([base + np.sort(rng.choice(wire.MAX_PARTITION_SIZE, n, replace=False)),
                         rng.integers(-(2**31), 2**31, n)], axis=1)
    if wire.ENTRY_LEN[ptype]:
        return rng.integers(-(2**31), 2**31, n) if ptype in DENSE else rng.integers(0, 2**32, n)
    return None


def _scapy_lists(ptype, ent, base):
    """The scapy list fields that carry ``ent`` (from wire.PAYLOAD_BLOCKS)."""
    if ptype in SPARSE:
        return {"offsets": [int(i) - base for i in ent[:, 0]], "values": [int(v) for v in ent[:, 1]]}
    blocks = wire.PAYLOAD_BLOCKS[ptype]
    return {BLOCK_FIELDS[blocks[0][0]]: [int(v) for v in ent]} if blocks else {}


@settings(max_examples=80, deadline=None)
@given(ptype=st.sampled_from(list(PacketType)), n=st.integers(0, wire.RX_MAX_SPARSE_ENTRIES),
       seed=st.integers(0, 2**32 - 1), job=st.integers(1, 2**32 - 1), worker=st.integers(0, 63),
       part=st.integers(0, 65534), rnd=st.integers(0, 2**32 - 1), scale=st.integers(-32, 62),
       base=st.integers(0, wire.MAX_SPARSE_BASE), flags=st.sampled_from([0, 1, 2, 3, 4, 5, 7]))
def test_scapy_build_is_byte_identical_to_wire(ptype, n, seed, job, worker, part, rnd, scale, base, flags):
    rng = np.random.default_rng(seed)
    if not wire.ENTRY_LEN[ptype]:
        n = 0
    ent = _entries_for(ptype, n, rng, base)
    h = Header(type=ptype, job_id=job, worker_id=worker, partition=part, round=rnd, seq=3, total=9,
               scale_exp=scale, flags=flags, base=base)
    want = wire.build_packet(h, ent)
    fields = {k: getattr(h, k) for k in HEADER_NAMES if k != "count"}
    lists = _scapy_lists(ptype, ent, base) if ent is not None else {}
    got = bytes(Dosa(**fields, **lists))
    assert got == want
    # and back: scapy parses the wire bytes into the same fields and lists
    p = Dosa(want)
    assert {k: int(getattr(p, k)) for k in HEADER_NAMES} == {**fields, "count": n}
    for name, vals in lists.items():
        assert getattr(p, name) == vals
    if ptype in SPARSE:
        assert p.indices() == [int(i) for i in ent[:, 0]]
    assert not p.haslayer(Padding)


def test_field_names_and_offsets_come_from_wire():
    names = [f.name for f in Dosa.fields_desc]
    blocks = {b for bl in wire.PAYLOAD_BLOCKS.values() for b, _ in bl}
    assert names[:len(HEADER_NAMES)] == HEADER_NAMES
    assert {BLOCK_FIELDS[b] for b in blocks} <= set(names[len(HEADER_NAMES):])
    # each field alone changes exactly the bytes at its HEADER_DTYPE offset
    for name, _, _ in wire.HEADER_FIELDS:
        dt, off = wire.HEADER_DTYPE.fields[name]
        a, b = bytes(Dosa(**{name: 1})), bytes(Dosa(**{name: 2}))
        diff = [i for i in range(wire.HDR_LEN) if a[i] != b[i]]
        assert diff and off <= min(diff) and max(diff) < off + dt.itemsize, name


def test_enum_and_flag_names_from_wire():
    p = Dosa(type="SPARSE_RESULT", flags="LAST+GTOPK", worker_id=wire.DPU_SENDER_ID)
    h = Header.unpack(bytes(p))
    assert h.type == PacketType.SPARSE_RESULT and h.flags == Flags.LAST | Flags.GTOPK
    assert Dosa(bytes(p)).sprintf("%type% %flags%") == "SPARSE_RESULT LAST+GTOPK"


def test_count_and_type_alone_size_the_payload():
    buf = wire.build_packet(Header(type=PacketType.DENSE_DATA, flags=Flags.LAST), np.arange(5))
    p = Dosa(buf + b"\xaa\xbb")  # trailing bytes are not entries
    assert len(p.values) == 5 and bytes(p[Padding]) == b"\xaa\xbb"
    # an odd sparse count: offsets, 2 pad bytes, then the values 4-byte aligned
    buf = wire.build_packet(Header(base=100, flags=Flags.LAST), np.array([[101, -1], [102, 7], [150, 9]]))
    assert len(buf) == wire.HDR_LEN + 3 * 2 + 2 + 3 * 4 == wire.payload_length(PacketType.SPARSE_DATA, 3)
    p = Dosa(buf)
    assert p.offsets == [1, 2, 50] and p.values == [-1, 7, 9] and p.indices() == [101, 102, 150]
    p = Dosa(type="DENSE_DATA", count=1, values=[5, 6])  # count, not the list, says what is parsed
    assert Dosa(bytes(p)).count == 1 and Dosa(bytes(p)).values == [5]


def test_udp_binding_default_port_and_bind_port():
    pkt = Ether() / IP() / UDP(sport=40000) / Dosa(job_id=5)
    assert pkt[UDP].dport == wire.DEFAULT_PORT
    again = Ether(bytes(pkt))
    assert again.haslayer(Dosa) and again[Dosa].job_id == 5
    # results come *from* the port
    back = Ether(bytes(Ether() / IP() / UDP(sport=wire.DEFAULT_PORT, dport=40000) / Dosa(job_id=6)))
    assert back[Dosa].job_id == 6
    raw = bytes(Ether() / IP() / UDP(sport=1, dport=23456) / bytes(Dosa(job_id=7)))
    assert not Ether(raw).haslayer(Dosa)
    bind_port(23456)
    assert Ether(raw)[Dosa].job_id == 7


@pytest.mark.parametrize("mtu", [wire.DEFAULT_MTU, wire.MAX_MTU])
def test_scapy_parses_packetizer_output(mtu):
    pm = PartitionMap(numel=100000, partition_size=30000, num_dpus=2)
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(100000, 4000, replace=False)).astype(np.uint32)
    val = rng.integers(-1000, 1000, 4000).astype(np.int32)
    batch = packetize(idx, val, pm, job_id=9, worker_id=2, round=4, scale_exp=10, mtu=mtu)
    got_idx, got_val, parts = [], [], set()
    for i in range(len(batch)):
        p = Dosa(batch.packet(i))
        assert p.sprintf("%type%") == "SPARSE_DATA"
        assert (p.job_id, p.worker_id, p.round, p.scale_exp) == (9, 2, 4, 10)
        assert p.count == len(p.values) <= wire.entries_per_packet(PacketType.SPARSE_DATA, mtu)
        assert bool(p.flags.LAST) == (p.seq == p.total - 1)
        parts.add(p.partition)
        lo, hi = pm.bounds(p.partition)
        assert all(lo <= i < hi for i in p.indices())
        got_idx += p.indices()
        got_val += p.values
    assert parts == set(range(pm.num_partitions))
    assert got_idx == idx.tolist() and got_val == val.tolist()
