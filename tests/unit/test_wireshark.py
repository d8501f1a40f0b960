"""The generated Wireshark dissector, run by Debian's tshark on packets of every type and on one
packet per header rule: tshark's fields equal dosa.wire's parse, its verdict (``dosa.drop_reason``)
equals ``wire.header_verdicts``' reason and its expert message equals ``wire.rule_error``'s sentence.
A rule, type or field added to wire.py without the dissector following fails here."""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from dataplane import reasons
from dosa import wire, wireshark

pytestmark = pytest.mark.timeout(60)
T = wire.PacketType
PS = wire.DEFAULT_PARTITION_SIZE
FIELDS = [*wireshark.header_field_names(), *wireshark.entry_field_names(), "dosa.drop_reason",
          "_ws.expert.message"]


def _valid_packets() -> list[bytes]:
    rng = np.random.default_rng(5)
    out = []
    for t in T:
        counts = sorted({0, 1, 2, 3, wire.entries_per_packet(t)}) if wire.ENTRY_LEN[t] else [0]
        for n in counts:
            p = 2
            lo = p * PS
            h = wire.Header(type=t, job_id=77, partition=p, round=9, scale_exp=-7,
                            worker_id=wire.DPU_SENDER_ID if t in (T.SPARSE_RESULT, T.DENSE_RESULT, T.STATUS) else 3,
                            seq=1, total=2, flags=int(wire.Flags.LAST), base=lo + 100)
            if t in (T.SPARSE_DATA, T.SPARSE_RESULT):
                idx = np.sort(rng.choice(PS - 100, n, replace=False)) + lo + 100
                e = np.stack([idx, rng.integers(-2**31, 2**31, n)], axis=1)
            elif t in (T.DENSE_DATA, T.DENSE_RESULT):
                e = rng.integers(-2**31, 2**31, n).astype(np.int32)
            elif t in (T.RETX_REQUEST, T.STATUS):
                h = replace(h, seq=0, total=1, flags=0)
                e = rng.integers(0, 64 if t == T.STATUS else 2**32, n).astype(np.uint32)
            else:
                h, e = replace(h, seq=0, total=1, flags=0), None
            out.append(wire.build_packet(h, e))
    return out


def _with(pkt: bytes, **fields) -> bytes:
    h = replace(wire.Header.unpack(pkt), **fields)
    return h.pack() + pkt[wire.HDR_LEN:]


def _broken_packets() -> list[bytes]:
    """At least one packet breaking each header rule (the first broken rule names the verdict)."""
    good = wire.build_packet(wire.Header(type=T.SPARSE_DATA, job_id=5, partition=1, base=PS, seq=0,
                                         total=1, flags=int(wire.Flags.LAST)),
                             np.array([[PS + 1, 4], [PS + 9, -4], [PS + 30, 1]]))
    last = int(wire.Flags.LAST)
    return [
        b"DOSA\0\0\0\0",
        _with(good, magic=0x12345678), _with(good, version=wire.VERSION + 1), _with(good, type=99),
        _with(good, count=60000), _with(good, count=2), good + b"\0\0\0\0",
        _with(good, flags=0x8000 | last), _with(good, reserved=1), _with(good, total=0),
        _with(good, seq=5, total=2), _with(good, seq=0, total=2, flags=last),
        _with(good, scale_exp=-40), _with(good, base=2**32 - 100), _with(good, worker_id=64),
        _with(good, partition=65535),
    ]


def _out_of_partition() -> list[bytes]:
    sp = wire.build_packet(wire.Header(type=T.SPARSE_DATA, partition=0, base=65000, flags=1),
                           np.array([[65001, 1], [66000, 2]]))
    de = wire.build_packet(wire.Header(type=T.DENSE_DATA, partition=0, base=PS - 6, flags=1),
                           np.arange(10, dtype=np.int32))
    return [sp, de]


def _pcap(path, payloads, port=wire.DEFAULT_PORT):
    wrpcap(str(path), [Ether(src="02:d0:5a:01:00:00", dst="02:d0:5a:02:00:00") /
                       IP(src="10.77.0.10", dst="10.77.0.200") / UDP(sport=port, dport=port) / Raw(p)
                       for p in payloads])
    return path


@pytest.fixture(scope="module")
def lua(tmp_path_factory):
    if not shutil.which("tshark"):
        pytest.fail("tshark is not installed: run `make setup` (it installs Debian's tshark)")
    return wireshark.write(tmp_path_factory.mktemp("ws") / "dosa.lua")


def _int(s: str) -> int:
    return int(s, 0)


def test_every_packet_type_dissects_to_the_fields_wire_parses(lua, tmp_path):
    pkts = _valid_packets()
    rows = wireshark.tshark_fields(_pcap(tmp_path / "valid.pcap", pkts), FIELDS, lua)
    assert len(rows) == len(pkts)
    blocks = wireshark.payload_blocks()
    for pkt, row in zip(pkts, rows):
        h, entries = wire.parse_packet(pkt)
        where = f"frame {row['frame.number']} ({T(h.type).name}, count {h.count})"
        assert row["dosa.drop_reason"] == ["ok"] and row["_ws.expert.message"] == [], where
        for n, _, _ in wire.HEADER_FIELDS:
            assert [_int(x) for x in row[f"dosa.{n}"]] == [getattr(h, n)], f"{where}: {n}"
        got = {k: [_int(x) for x in v] for k, v in row.items() if k.startswith("dosa.entry.")}
        if h.type in (T.SPARSE_DATA, T.SPARSE_RESULT):
            assert got["dosa.entry.index"] == entries["index"].tolist(), where
            assert got["dosa.entry.value"] == entries["value"].tolist(), where
        elif blocks[h.type]:
            name = blocks[h.type][0][0]
            assert got[f"dosa.entry.{name}"] == entries.tolist(), where
            if name == "value":  # dense: index = base + position
                assert got["dosa.entry.index"] == list(range(h.base, h.base + h.count)), where
        else:
            assert not any(got.values()), where


def test_every_header_rule_gives_the_dataplanes_verdict_and_wires_sentence(lua, tmp_path):
    pkts = _broken_packets()
    lengths = [len(p) for p in pkts]
    hdrs = np.zeros(len(pkts), wire.HEADER_DTYPE)
    for i, p in enumerate(pkts):
        if len(p) >= wire.HDR_LEN:
            hdrs[i] = np.frombuffer(p[:wire.HDR_LEN], wire.HEADER_DTYPE)[0]
    codes = wire.header_verdicts(hdrs, lengths).tolist()
    missing = [f"{i}: {r.reason} {r.expr}" for i, r in enumerate(wire.HEADER_RULES, 1) if i not in codes]
    assert not missing, f"no test packet breaks rule(s) {missing}: add one to _broken_packets"
    rows = wireshark.tshark_fields(_pcap(tmp_path / "broken.pcap", pkts), FIELDS, lua)
    assert len(rows) == len(pkts)
    for pkt, code, row in zip(pkts, codes, rows):
        fields = {n: int(hdrs[int(row["frame.number"][0]) - 1][n]) for n, _, _ in wire.HEADER_FIELDS}
        assert row["dosa.drop_reason"] == [wire.RULE_REASONS[code]], row
        assert row["_ws.expert.message"] == [str(wire.rule_error(code, fields, len(pkt)))], row


def test_index_outside_its_partition_is_flagged_with_the_dataplanes_counter(lua, tmp_path):
    assert wireshark.INDEX_REASON in {reasons.name(c) for c in reasons.DROP_REASONS}
    pcap = _pcap(tmp_path / "oop.pcap", _out_of_partition())
    rows = wireshark.tshark_fields(pcap, FIELDS, lua)
    assert [r["dosa.drop_reason"] for r in rows] == [[wireshark.INDEX_REASON]] * 2
    assert "index 66000 outside partition 0" in rows[0]["_ws.expert.message"][0]
    assert "index 65536 outside partition 0" in rows[1]["_ws.expert.message"][0]
    # the job's partition size is a preference: with 2^17 both indices are inside partition 0
    argv = ["tshark", "-n", "-r", str(pcap), "-X", f"lua_script:{lua}", "-o",
            f"dosa.partition_size:{2 * PS}", "-T", "fields", "-e", "dosa.drop_reason"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert p.stdout.split() == ["ok", "ok"], p.stderr


def test_port_is_a_preference(lua, tmp_path):
    pcap = _pcap(tmp_path / "port.pcap", _valid_packets()[:3], port=9999)
    assert wireshark.tshark_fields(pcap, ["dosa.type"], lua) == []
    rows = wireshark.tshark_fields(pcap, ["dosa.type"], lua, port=9999)
    assert [r["dosa.type"] for r in rows] == [[str(int(T.SPARSE_DATA))]] * 3


def test_dissector_command_prints_the_path_of_the_current_dissector(tmp_path):
    out = tmp_path / "d.lua"
    p = subprocess.run([sys.executable, "-m", "dosa", "capture", "dissector", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == str(out), p.stderr
    assert out.read_text() == wireshark.lua()
