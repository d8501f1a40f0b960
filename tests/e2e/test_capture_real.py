"""`dosa capture verify` on REAL captures (root): a namespace testbed with the XDP dataplane runs a
few allreduce rounds (tests/netns/allreduce_host.py, which checks every result itself) while
`Testbed.capture` records the fabric bridge; the real CLI must verify that capture, and must fail on
a copy where one sum in one SPARSE_RESULT packet is changed, naming its (round, partition, index).

The synthetic pcaps of tests/unit only show that verify agrees with itself; this shows it agrees
with what the DPU really sent (and that the testbed's capture is complete enough to be verified).
Sum and gtopk mode share one testbed (the mode is chosen by the first joiner of each job).

tcpdump on the bridge does lose packets in bursts with its default buffer (libpcap sizes ring
frames by the 256 KiB snap length because br0 has offloads on, so 2 MiB hold only a few frames;
`-B 32768` loses none). When its counter says it dropped some, exactly the groups those touch may
be incomplete: no more of them than packets dropped, and all others must verify.
"""
from __future__ import annotations

import json
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dosa import wire
from dosa.capture import read_frames

REPO = Path(__file__).resolve().parents[2]
HOST = REPO / "tests" / "netns" / "allreduce_host.py"
HOSTS, ROUNDS, NNZ = 3, 4, 1500
SHAPE = {"numel": 20000, "partition_size": 5000, "scale_exp": 16}


# ------------------------------------------------------------------------------------ pcap editing
def _udp(buf: bytes, frame: int, length: int):
    """(ip offset, udp offset) of an untagged Ethernet/IPv4/UDP frame, else None."""
    if length < 14 + 20 + 8 or buf[frame + 12:frame + 14] != b"\x08\x00":
        return None
    ip = frame + 14
    if buf[ip] >> 4 != 4 or buf[ip + 9] != 17:
        return None
    return ip, ip + (buf[ip] & 0x0F) * 4


def _udp_checksum(buf: bytes, ip: int, udp: int) -> int:
    ulen = struct.unpack(">H", buf[udp + 4:udp + 6])[0]
    seg = bytearray(buf[udp:udp + ulen])
    seg[6:8] = b"\0\0"
    data = bytes(buf[ip + 12:ip + 20]) + struct.pack(">BBH", 0, 17, ulen) + bytes(seg)
    if len(data) % 2:
        data += b"\0"
    s = int(np.frombuffer(data, ">u2").astype(np.uint64).sum())
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    c = (~s) & 0xFFFF
    return c or 0xFFFF


def _result_packets(buf: bytes, frames) -> list:
    """Every SPARSE_RESULT in the capture: (ip offset, udp offset, header, entries). ``frames``
    (dosa.capture.read_frames) locates the records: the project's one pcap reader."""
    assert (frames.linktype == 1).all(), "expected Ethernet link type"
    out = []
    for frame, length in zip(frames.off.tolist(), frames.caplen.tolist()):
        loc = _udp(buf, frame, length)
        if loc is None:
            continue
        ip, udp = loc
        payload = bytes(buf[udp + 8:frame + length])
        if payload[:4] != b"DOSA":
            continue
        h, ent = wire.parse_packet(payload)
        if h.type == wire.PacketType.SPARSE_RESULT and h.count:
            out.append((ip, udp, h, ent))
    return out


def flip_one_result_value(src: Path, dst: Path, prefer_gtopk: bool, skip=frozenset()) -> dict:
    """Copy ``src`` to ``dst`` with one sum of one SPARSE_RESULT packet moved one step away from 0
    (|sum| grows, so a gtopk result's set stays the k largest and only the value is wrong), UDP
    checksum recomputed. The packet chosen is one whose (job, round, partition, seq) occurs only
    once in the capture, so the change is not also a conflict between copies, and whose
    (job, round, partition) is not in ``skip`` (groups verify could not check)."""
    buf = bytearray(src.read_bytes())
    pkts = _result_packets(buf, read_frames(src))
    assert pkts, "the capture has no SPARSE_RESULT packet"
    keys = [(h.job_id, h.round, h.partition, h.seq) for _, _, h, _ in pkts]
    single = [p for p, k in zip(pkts, keys) if keys.count(k) == 1 and k[:3] not in skip
              and bool(p[2].flags & wire.Flags.GTOPK) == prefer_gtopk]
    assert single, "every result packet of the capture occurs more than once"
    ip, udp, h, ent = single[len(single) // 2]
    i = len(ent) // 2
    index, old = int(ent["index"][i]), int(ent["value"][i])
    new = old + 1 if old > 0 else old - 1
    assert -2**31 <= new < 2**31
    at = udp + 8 + wire.value_offset(h.count) + 4 * i  # the value block follows the u16 offsets
    assert struct.unpack(">i", buf[at:at + 4])[0] == old
    buf[at:at + 4] = struct.pack(">i", new)
    buf[udp + 6:udp + 8] = struct.pack(">H", _udp_checksum(buf, ip, udp))
    # the edited frame is a valid UDP packet: scapy recomputes the same checksum
    from scapy.layers.inet import UDP
    from scapy.layers.l2 import Ether

    frame = Ether(bytes(buf[ip - 14:udp + struct.unpack(">H", buf[udp + 4:udp + 6])[0]]))
    sent = frame[UDP].chksum
    del frame[UDP].chksum
    assert Ether(bytes(frame))[UDP].chksum == sent
    dst.write_bytes(bytes(buf))
    return {"job": h.job_id, "round": h.round, "partition": h.partition, "index": index,
            "expected": old, "got": new}


# ------------------------------------------------------------------------------------------ helpers
def verify(pcap: Path) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "dosa", "capture", "verify", str(pcap), "--json"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"verify exit {p.returncode}, no JSON: {p.stdout!r} {p.stderr!r}")


def capture_run(tb, out_dir: Path, mode: str):
    """A few allreduce rounds of a new job in ``mode`` under tcpdump; every rank checked its results."""
    pcap, res_dir = out_dir / f"{mode}.pcap", out_dir / f"res-{mode}"
    res_dir.mkdir()
    shape = dict(SHAPE, mode=mode, workers=HOSTS,
                 dpus=tb.job_env(0)["DOSA_DPU_ADDRS"].split(","))
    if mode == "gtopk":
        shape["density"] = 0.02
    cmd = (f"exec {shlex.quote(sys.executable)} {shlex.quote(str(HOST))} --worker-id \"$RANK\" "
           f"--job-id \"$DOSA_JOB_ID\" --control \"$DOSA_CONTROL_ADDR:$DOSA_CONTROL_PORT\" "
           f"--shape {shlex.quote(json.dumps(shape))} --rounds {ROUNDS} --nnz {NNZ} --timeout 20 "
           f"--out {shlex.quote(str(res_dir))}/rank\"$RANK\".json")
    stats, run = tb.capture(pcap, ["sh", "-c", cmd], timeout=60, echo=False,
                            log_dir=out_dir / f"logs-{mode}")
    run.check()
    for r in range(HOSTS):
        res = json.loads((res_dir / f"rank{r}.json").read_text())
        assert "error" not in res and res["mismatches"] == [], res
        assert res["rounds_ok"] == ROUNDS, res
    assert stats.packets > 0
    return pcap, stats


def check_capture(tmp: Path, pcap: Path, stats, mode: str) -> None:
    rc, rep = verify(pcap)
    assert rc == 0 and rep["ok"], rep
    assert rep["mismatches"] == [] and rep["verified"] > 0
    groups = ROUNDS * -(-SHAPE["numel"] // SHAPE["partition_size"])
    if not stats.dropped_by_kernel:
        # every (round, partition) of the run was complete in the capture and checked
        assert rep["verified"] == rep["partitions"] == groups, rep
        assert rep["rounds"] == ROUNDS and rep["incomplete"] == [], rep
    else:
        # tcpdump lost packets (its counters say so): exactly those groups cannot be checked
        assert rep["verified"] + len(rep["incomplete"]) == groups, rep
        assert 0 < len(rep["incomplete"]) <= stats.dropped_by_kernel, (rep, stats)
    assert rep["verified"] == rep["partitions"]
    assert rep["gtopk_partitions"] == (rep["partitions"] if mode == "gtopk" else 0)
    assert rep["entries_checked"] > 0 and rep["capture"]["malformed"] == 0

    bad = tmp / f"{mode}-flipped.pcap"
    skip = {(g["job"], g["round"], g["partition"]) for g in rep["incomplete"]}
    want = flip_one_result_value(pcap, bad, prefer_gtopk=mode == "gtopk", skip=skip)
    rc, rep2 = verify(bad)
    assert rc == 1 and not rep2["ok"], rep2
    assert rep2["capture"]["malformed"] == 0  # still a valid packet, checksum and all
    assert len(rep2["mismatches"]) == 1, rep2["mismatches"]
    m = rep2["mismatches"][0]
    assert (m["job"], m["round"], m["partition"], m["mode"]) == \
        (want["job"], want["round"], want["partition"], mode)
    assert m["problems"] == 1 and m["kinds"] == {"wrong_value": 1}, m
    assert m["details"] == [{"kind": "wrong_value", "index": want["index"],
                             "expected": want["expected"], "got": want["got"]}], m
    assert rep2["verified"] == rep["verified"] - 1


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_capture_verify_passes_on_a_real_run_and_names_one_flipped_sum(tmp_path):
    from testbed.testing import scratch_testbed

    with scratch_testbed(hosts=HOSTS, dpus=1, mode="xdp") as tb:
        pcaps = {mode: capture_run(tb, tmp_path, mode) for mode in ("sum", "gtopk")}
    for mode, (pcap, stats) in pcaps.items():
        check_capture(tmp_path, pcap, stats, mode)
