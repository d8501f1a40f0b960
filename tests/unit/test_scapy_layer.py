"""dosa.scapy_layer: packets built with scapy are byte-identical to dosa.wire.build_packet, and scapy
dissects what dosa.wire and host_lib.packetizer produce, field for field."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Padding

from dosa import wire
from dosa.scapy_layer import ENTRY_CLASSES, Dosa, DosaSparseEntry, bind_port
from dosa.wire import Flags, Header, PacketType, PartitionMap
from host_lib.packetizer import packetize

pytestmark = pytest.mark.timeout(60)

HEADER_NAMES = [n for n, _, _ in wire.HEADER_FIELDS]


SPARSE = (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT)
DENSE = (PacketType.DENSE_DATA, PacketType.DENSE_RESULT)


def _scapy_entries(ptype, entries):
    if ptype in SPARSE:
        return [DosaSparseEntry(index=int(i), value=int(v)) for i, v in entries]
    if ptype not in ENTRY_CLASSES:
        return []
    cls = ENTRY_CLASSES[ptype]  # one 4-byte field: dense value, retx seq, status worker_id
    (field,) = [f.name for f in cls.fields_desc]
    return [cls(**{field: int(v)}) for v in entries]


def _entries_for(ptype, n, rng):
    if ptype in SPARSE:
        return np.stack([np.sort(rng.choice(2**32, n, replace=False)),
                         rng.integers(-(2**31), 2**31, n)], axis=1)
    if ptype in DENSE:
        return rng.integers(-(2**31), 2**31, n)
    if wire.ENTRY_LEN[ptype]:
        return rng.integers(0, 2**32, n)
    return None


@settings(max_examples=60, deadline=None)
@given(ptype=st.sampled_from(list(PacketType)), n=st.integers(0, 180), seed=st.integers(0, 2**32 - 1),
       job=st.integers(1, 2**32 - 1), worker=st.integers(0, 63), part=st.integers(0, 65534),
       rnd=st.integers(0, 2**32 - 1), scale=st.integers(-32, 62), base=st.integers(0, 2**32 - 1),
       flags=st.sampled_from([0, 1, 2, 3, 4, 5, 7]))
def test_scapy_build_is_byte_identical_to_wire(ptype, n, seed, job, worker, part, rnd, scale, base, flags):
    rng = np.random.default_rng(seed)
    if not wire.ENTRY_LEN[ptype]:
        n = 0
    ent = _entries_for(ptype, n, rng)
    h = Header(type=ptype, job_id=job, worker_id=worker, partition=part, round=rnd, seq=3, total=9,
               scale_exp=scale, flags=flags, base=base)
    want = wire.build_packet(h, ent)
    fields = {k: getattr(h, k) for k in HEADER_NAMES if k != "count"}
    got = bytes(Dosa(**fields, entries=_scapy_entries(ptype, ent if ent is not None else [])))
    assert got == want
    # and back: scapy parses the wire bytes into the same fields and entries
    p = Dosa(want)
    assert {k: int(getattr(p, k)) for k in HEADER_NAMES} == {**fields, "count": n}
    if ptype in SPARSE:
        assert [(e.index, e.value) for e in p.entries] == [tuple(map(int, r)) for r in ent]
    elif n:
        assert [e.fields[f.name] for e in p.entries for f in e.fields_desc] == ent.tolist()
        assert all(type(e) is ENTRY_CLASSES[ptype] for e in p.entries)
    else:
        assert p.entries == []
    assert not p.haslayer(Padding)


def test_field_names_and_offsets_come_from_wire():
    names = [f.name for f in Dosa.fields_desc]
    assert names == HEADER_NAMES + ["entries"]
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


def test_count_alone_sizes_the_payload():
    buf = wire.build_packet(Header(type=PacketType.DENSE_DATA, flags=Flags.LAST), np.arange(5))
    p = Dosa(buf + b"\xaa\xbb")  # trailing bytes are not entries
    assert len(p.entries) == 5 and bytes(p[Padding]) == b"\xaa\xbb"
    p = Dosa(type="SPARSE_DATA", count=1, entries=[DosaSparseEntry(index=1), DosaSparseEntry(index=2)])
    assert Dosa(bytes(p)).count == 1 and len(Dosa(bytes(p)).entries) == 1


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


def test_scapy_parses_packetizer_output():
    pm = PartitionMap(numel=1000, partition_size=300, num_dpus=2)
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(1000, 400, replace=False)).astype(np.uint32)
    val = rng.integers(-1000, 1000, 400).astype(np.int32)
    batch = packetize(idx, val, pm, job_id=9, worker_id=2, round=4, scale_exp=10)
    got_idx, got_val, parts = [], [], set()
    for i in range(len(batch)):
        p = Dosa(batch.packet(i))
        assert p.sprintf("%type%") == "SPARSE_DATA"
        assert (p.job_id, p.worker_id, p.round, p.scale_exp) == (9, 2, 4, 10)
        assert p.count == len(p.entries) <= wire.MAX_SPARSE_ENTRIES
        assert bool(p.flags.LAST) == (p.seq == p.total - 1)
        parts.add(p.partition)
        lo, hi = pm.bounds(p.partition)
        for e in p.entries:
            assert lo <= e.index < hi
            got_idx.append(e.index)
            got_val.append(e.value)
    assert parts == set(range(pm.num_partitions))
    assert got_idx == idx.tolist() and got_val == val.tolist()
