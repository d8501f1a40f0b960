"""dosa.wire: header encoding, the validation rules of docs/protocol.md, packet parsing, PacketBatch
and PartitionMap. Every rule of validate_header has a test that breaks exactly that rule."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dosa import wire
from dosa.wire import (DPU_SENDER_ID, HDR_LEN, Flags, Header, PacketBatch, PacketType, PartitionMap,
                       build_packet, parse_packet, validate_header)

pytestmark = pytest.mark.timeout(60)


def _uint(dtype: str):
    bits = 8 * np.dtype(dtype).itemsize
    if np.dtype(dtype).kind == "i":
        return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return st.integers(0, 2**bits - 1)


#: Any header at all (valid or not): every field over its full range, from HEADER_FIELDS.
any_header = st.builds(Header, **{n: _uint(t) for n, t, _ in wire.HEADER_FIELDS})


@settings(max_examples=200, deadline=None)
@given(any_header)
def test_header_pack_unpack_round_trip_over_full_field_ranges(h):
    b = h.pack()
    assert len(b) == HDR_LEN
    assert Header.unpack(b) == h


def test_header_is_big_endian_at_documented_offsets():
    b = Header(job_id=0x01020304, round=0x0A0B0C0D, base=0xDEADBEEF, scale_exp=-3).pack()
    assert b[:4] == b"DOSA"
    assert b[8:12] == bytes([1, 2, 3, 4])
    assert b[16:20] == bytes([0x0A, 0x0B, 0x0C, 0x0D])
    assert b[26] == 0xFD  # s8 -3
    assert b[28:32] == bytes.fromhex("deadbeef")


def test_unpack_rejects_short_buffer():
    with pytest.raises(wire.TruncatedPacket):
        Header.unpack(b"\0" * (HDR_LEN - 1))
    with pytest.raises(wire.TruncatedPacket):
        parse_packet(b"DOSA")


def _valid(**kw) -> tuple[Header, int]:
    h = Header(**kw)
    return h, wire.payload_length(h.type, h.count)


@pytest.mark.parametrize("ptype", list(PacketType))
def test_default_headers_of_every_type_are_valid(ptype):
    h, n = _valid(type=ptype, flags=Flags.LAST)
    validate_header(h, n)


# (description, header changes, expected exception). Each case breaks exactly one rule.
BAD = [
    ("magic", dict(magic=0x444F5342), wire.BadMagic),
    ("version 0", dict(version=0), wire.BadVersion),
    ("version 1", dict(version=1), wire.BadVersion),  # v1's 8-byte entries are not read
    ("version 3", dict(version=3), wire.BadVersion),
    ("type 0", dict(type=0), wire.BadType),
    ("type 8", dict(type=8), wire.BadType),
    ("count over max sparse", dict(count=wire.RX_MAX_SPARSE_ENTRIES + 1), wire.CountMismatch),
    ("unknown flag bit", dict(flags=Flags.LAST | 0x0008), wire.BadField),
    ("reserved", dict(reserved=1), wire.BadField),
    ("total 0", dict(total=0, seq=0, flags=0), wire.BadField),
    ("total too big", dict(total=wire.MAX_PACKETS_PER_CONTRIBUTION + 1,
                           seq=wire.MAX_PACKETS_PER_CONTRIBUTION, flags=Flags.LAST), wire.BadField),
    ("seq == total", dict(seq=1, total=1, flags=Flags.LAST), wire.BadField),
    ("LAST missing on last", dict(seq=0, total=1, flags=0), wire.BadField),
    ("LAST on non-last", dict(seq=0, total=2, flags=Flags.LAST), wire.BadField),
    ("scale too small", dict(scale_exp=wire.SCALE_EXP_MIN - 1), wire.BadField),
    ("scale too big", dict(scale_exp=wire.SCALE_EXP_MAX + 1), wire.BadField),
    ("sparse base too large", dict(base=wire.MAX_SPARSE_BASE + 1), wire.BadField),
    ("worker out of range", dict(worker_id=wire.MAX_WORKERS), wire.BadField),
    ("partition out of range", dict(partition=wire.MAX_PARTITIONS), wire.BadField),
]


@pytest.mark.parametrize("what,changes,exc", BAD, ids=[b[0] for b in BAD])
def test_validate_header_rejects_each_broken_rule(what, changes, exc):
    good = Header(flags=Flags.LAST)
    h = replace(good, **changes)
    with pytest.raises(exc):
        validate_header(h, wire.payload_length(good.type, h.count))


def test_validate_header_rejects_length_not_matching_count():
    h = Header(flags=Flags.LAST, count=3)
    validate_header(h, HDR_LEN + 3 * 2 + 2 + 3 * 4)  # offsets, pad to 4, values
    for n in (HDR_LEN + 3 * 6, HDR_LEN + 3 * 6 + 1, HDR_LEN + 3 * 8 + 1, HDR_LEN + 2 * 6, HDR_LEN + 4 * 6):
        with pytest.raises(wire.CountMismatch):
            validate_header(h, n)
    validate_header(replace(h, count=4), HDR_LEN + 4 * 6)  # an even count needs no pad


@pytest.mark.parametrize("mtu", [wire.MIN_MTU, 1500, 2000, 3000, wire.MAX_MTU])
def test_entries_per_packet_fill_the_mtu(mtu):
    room = wire.max_udp_payload(mtu)
    for t in PacketType:
        n = wire.entries_per_packet(t, mtu)
        assert wire.payload_length(t, n) <= room
        if wire.ENTRY_LEN[t]:
            assert wire.payload_length(t, n + 1) > room
            assert n <= wire.MAX_ENTRIES[t]  # a receiver accepts every packet of every MTU
    assert wire.stride_for_mtu(mtu) >= room and wire.stride_for_mtu(mtu) % HDR_LEN == 0


def test_entry_counts_at_the_default_and_largest_mtu():
    assert (wire.MAX_SPARSE_ENTRIES, wire.MAX_DENSE_ENTRIES) == (240, 360)  # v1 had 180 sparse
    assert wire.MAX_ENTRIES[PacketType.SPARSE_DATA] == wire.RX_MAX_SPARSE_ENTRIES == 573
    assert wire.MAX_ENTRIES[PacketType.DENSE_DATA] == 860
    for bad in (wire.MIN_MTU - 1, wire.MAX_MTU + 1, 9000):
        with pytest.raises(ValueError, match="MTU"):
            wire.entries_per_packet(PacketType.SPARSE_DATA, bad)


def test_encoded_bytes_break_even():
    """Dense beats sparse once about 2/3 of the span carries entries (6 vs 4 bytes an entry)."""
    span = 60000
    counts = np.arange(0, span + 1, 100)
    sparse, dense = wire.encoded_bytes(counts, np.full(len(counts), span))
    first_dense = counts[np.argmax(dense < sparse)]
    assert 0.6 * span < first_dense < 0.7 * span
    assert (dense[counts > first_dense] < sparse[counts > first_dense]).all()
    s0, d0 = wire.encoded_bytes(0, 0)
    assert s0 == wire.PACKET_OVERHEAD and d0 > s0  # an empty partition is one empty sparse packet


def test_dpu_sender_id_is_accepted_and_non_data_types_skip_seq_rules():
    validate_header(Header(type=PacketType.SPARSE_RESULT, worker_id=DPU_SENDER_ID, flags=Flags.LAST),
                    HDR_LEN)
    # HEARTBEAT / RETX_REQUEST carry no contribution: seq/total/LAST are not checked.
    validate_header(Header(type=PacketType.HEARTBEAT, total=0, seq=5), HDR_LEN)
    validate_header(Header(type=PacketType.RETX_REQUEST, total=0, count=2), HDR_LEN + 8)
    # dense packets may carry a base
    validate_header(Header(type=PacketType.DENSE_DATA, base=1000, flags=Flags.LAST), HDR_LEN)


def test_parse_sparse_packets_round_trip():
    base = 2**32 - 65536
    ent = np.array([[base + 3, -5], [base + 7000, 2**31 - 1], [2**32 - 1, -(2**31)]], np.int64)
    for t in (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT):
        buf = build_packet(Header(type=t, flags=Flags.LAST, count=99, base=base), ent)
        assert len(buf) == HDR_LEN + 3 * 2 + 2 + 3 * 4
        h, e = parse_packet(buf)
        assert h.count == 3 and h.type == t
        assert e.dtype == wire.SPARSE_ENTRY_DTYPE
        assert e["index"].tolist() == ent[:, 0].tolist()
        assert e["value"].tolist() == ent[:, 1].tolist()


def test_parse_dense_retx_and_heartbeat():
    vals = np.array([1, -2, 3, 2**31 - 1], np.int32)
    for t in (PacketType.DENSE_DATA, PacketType.DENSE_RESULT):
        h, e = parse_packet(build_packet(Header(type=t, base=40, flags=Flags.LAST), vals))
        assert (h.base, h.count) == (40, 4) and e.tolist() == vals.tolist()
    h, e = parse_packet(build_packet(Header(type=PacketType.RETX_REQUEST), np.array([0, 7])))
    assert e.dtype == wire.RETX_ENTRY_DTYPE and e.tolist() == [0, 7]
    h, e = parse_packet(build_packet(Header(type=PacketType.HEARTBEAT, worker_id=3)))
    assert h.worker_id == 3 and len(e) == 0


def test_build_packet_accepts_structured_entries():
    e = np.zeros(2, wire.SPARSE_ENTRY_DTYPE)
    e["index"], e["value"] = [1, 2], [-1, -2]
    a = build_packet(Header(flags=Flags.LAST), e)
    b = build_packet(Header(flags=Flags.LAST), np.array([[1, -1], [2, -2]]))
    assert a == b and len(a) == HDR_LEN + 2 * 6
    with pytest.raises(ValueError, match="base"):
        build_packet(Header(base=10, flags=Flags.LAST), np.array([[9, 1]]))
    with pytest.raises(ValueError, match="base"):
        build_packet(Header(base=10, flags=Flags.LAST), np.array([[10 + 65536, 1]]))


def test_parse_rejects_trailing_bytes():
    buf = build_packet(Header(flags=Flags.LAST), np.array([[1, 1]]))
    with pytest.raises(wire.CountMismatch):
        parse_packet(buf + b"\0")
    with pytest.raises(wire.CountMismatch):
        parse_packet(buf[:-1])


def test_packet_batch_from_packets_headers_select():
    pkts = [build_packet(Header(seq=i, total=3, flags=Flags.LAST if i == 2 else 0, worker_id=i),
                         np.array([[i, i]] * (i + 1))) for i in range(3)]
    b = PacketBatch.from_packets(pkts, dest=[0, 1, 0])
    assert len(b) == 3 and b.data.shape == (3, wire.STRIDE)
    assert [b.packet(i) for i in range(3)] == pkts
    h = b.headers()
    assert h["seq"].tolist() == [0, 1, 2] and h["count"].tolist() == [1, 2, 3]
    assert (h["magic"] == wire.MAGIC).all()
    s = b.select(b.dest == 0)
    assert len(s) == 2 and s.packet(1) == pkts[2]
    assert len(PacketBatch.empty(0)) == 0


def test_packet_batch_rejects_oversized_packet():
    with pytest.raises(wire.ProtocolError):
        PacketBatch.from_packets([b"\0" * (wire.STRIDE + 1)], stride=wire.STRIDE)
    big = PacketBatch.from_packets([b"\0" * (wire.STRIDE + 1)])  # the slot grows to fit
    assert big.stride % HDR_LEN == 0 and big.stride > wire.STRIDE


def test_partition_map_bounds_and_owners():
    pm = PartitionMap(numel=10, partition_size=4, num_dpus=2)
    assert pm.num_partitions == 3
    assert [pm.bounds(p) for p in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [pm.owner(p) for p in range(3)] == [0, 1, 0]
    assert pm.owned_by(0).tolist() == [0, 2] and pm.owned_by(1).tolist() == [1]
    assert pm.partition_of(np.arange(10)).tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert PartitionMap(numel=8, partition_size=4).num_partitions == 2
    with pytest.raises(ValueError):
        pm.bounds(3)
    with pytest.raises(ValueError):
        pm.bounds(-1)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**5), st.integers(1, 8))
def test_partition_map_covers_index_space_exactly(numel, size, dpus):
    try:
        pm = PartitionMap(numel=numel, partition_size=size, num_dpus=dpus)
    except ValueError:
        assert -(-numel // size) > wire.MAX_PARTITIONS or size > wire.MAX_PARTITION_SIZE
        return
    b = np.array([pm.bounds(p) for p in (0, pm.num_partitions - 1)])
    assert b[0, 0] == 0 and b[-1, 1] == numel
    assert sum(len(pm.owned_by(d)) for d in range(dpus)) == pm.num_partitions


@pytest.mark.parametrize("kw", [dict(numel=0), dict(numel=10, partition_size=0),
                                dict(numel=10, num_dpus=0),
                                dict(numel=wire.MAX_PARTITIONS + 1, partition_size=1),
                                dict(numel=2**32 + 1, partition_size=2**16),
                                dict(numel=10**6, partition_size=2**16 + 1)])
def test_partition_map_rejects_bad_parameters(kw):
    with pytest.raises(ValueError):
        PartitionMap(**kw)
