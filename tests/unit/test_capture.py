"""dosa.capture and ``dosa capture show|verify`` on synthetic captures written with scapy: a few
jobs/rounds/partitions/workers with the results a correct DPU would send, then one fault at a time
(wrong sum, missing index, lost result packet, duplicated data, wrong top-k set...)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import ARP, CookedLinux, Ether
from scapy.packet import Raw
from scapy.utils import PcapNgWriter, RawPcapWriter, wrpcap

from dosa import wire
from dosa.capture import read_capture, summarize, verify
from dosa.app.cli import main as dosa_main
from dosa.errors import DosaError
from dosa.wire import DPU_SENDER_ID, Flags, Header, PacketType, PartitionMap

pytestmark = pytest.mark.timeout(120)

PSIZE = 1000
JOB = 7
PORT = wire.DEFAULT_PORT


def _chunks(n: int, per: int) -> list[np.ndarray]:
    """Packet slices of n entries, at least one (empty) packet, as the protocol requires."""
    return [np.arange(n)[k:k + per] for k in range(0, max(n, 1), per)]


@dataclass
class Fabric:
    """Builds the packets of a job: workers' SPARSE_DATA and the DPU's SPARSE_RESULT copies."""

    seed: int = 0
    frames: list = field(default_factory=list)  # (label, scapy packet)
    truth: dict = field(default_factory=dict)  # (job, round, part) -> {index: sum}

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def _udp(self, src, payload: bytes, dport=PORT, sport=40000):
        return Ether() / IP(src=src, dst="10.0.9.1") / UDP(sport=sport, dport=dport) / Raw(payload)

    def data(self, job, rnd, part, worker, idx, val, *, dense_base=None, scale=8):
        per = wire.MAX_SPARSE_ENTRIES if dense_base is None else wire.MAX_DENSE_ENTRIES
        ch = _chunks(len(val), per)
        sums = self.truth.setdefault((job, rnd, part), {})
        for i, v in zip(idx, val):
            sums[int(i)] = sums.get(int(i), 0) + int(v)
        for s, c in enumerate(ch):
            h = Header(type=PacketType.SPARSE_DATA if dense_base is None else PacketType.DENSE_DATA,
                       job_id=job, worker_id=worker, partition=part, round=rnd, seq=s, total=len(ch),
                       flags=Flags.LAST if s == len(ch) - 1 else 0, scale_exp=scale,
                       base=part * PSIZE if dense_base is None else dense_base + int(c[0]) if len(c) else dense_base)
            ent = np.stack([idx[c], val[c]], 1) if dense_base is None else val[c]
            self.frames.append((("data", job, rnd, part, worker, s),
                                self._udp(f"10.0.0.{worker + 1}", wire.build_packet(h, ent))))

    def result(self, job, rnd, part, idx, val, *, gtopk=False, copies=2, scale=8, dense_base=None):
        per = wire.MAX_SPARSE_ENTRIES if dense_base is None else wire.MAX_DENSE_ENTRIES
        ch = _chunks(len(val), per)
        for copy in range(copies):  # the DPU sends the result to every host
            for s, c in enumerate(ch):
                flags = (Flags.LAST if s == len(ch) - 1 else 0) | (Flags.GTOPK if gtopk else 0)
                h = Header(type=PacketType.SPARSE_RESULT if dense_base is None else PacketType.DENSE_RESULT,
                           job_id=job, worker_id=DPU_SENDER_ID, partition=part, round=rnd, seq=s,
                           total=len(ch), flags=flags, scale_exp=scale,
                           base=part * PSIZE if dense_base is None else dense_base + (int(c[0]) if len(c) else 0))
                ent = np.stack([idx[c], val[c]], 1) if dense_base is None else val[c]
                self.frames.append((("result", job, rnd, part, copy, s),
                                    self._udp("10.0.9.1", wire.build_packet(h, ent), dport=40000,
                                              sport=PORT)))

    def round(self, job, rnd, parts, workers, *, density=0.3, gtopk_k=None):
        for p in parts:
            lo = p * PSIZE
            for w in workers:
                n = int(self.rng.binomial(PSIZE, density))
                idx = np.sort(self.rng.choice(PSIZE, n, replace=False)) + lo
                self.data(job, rnd, p, w, idx, self.rng.integers(-20, 20, n))
            self.correct_result(job, rnd, p, gtopk_k=gtopk_k)

    def correct_result(self, job, rnd, p, gtopk_k=None, **kw):
        s = self.truth[(job, rnd, p)]
        idx = np.array(sorted(i for i, v in s.items() if v), np.int64)
        val = np.array([s[i] for i in idx], np.int64)
        if gtopk_k is not None:
            keep = np.sort(np.argsort(-np.abs(val), kind="stable")[:gtopk_k])
            idx, val = idx[keep], val[keep]
        self.result(job, rnd, p, idx, val, gtopk=gtopk_k is not None, **kw)
        return idx, val

    def write(self, path, drop=lambda label: False, extra=()):
        pk = [f for label, f in self.frames if not drop(label)]
        pk += list(extra)
        wrpcap(str(path), pk)
        return path


def _standard(seed=0, **kw) -> Fabric:
    f = Fabric(seed)
    for r in range(3):
        f.round(JOB, r, parts=range(3), workers=range(3), **kw)
    return f


NOISE = [Ether() / ARP(), Ether() / IP() / TCP(dport=80), Ether() / IP() / UDP(dport=53) / Raw(b"x" * 40)]


def test_correct_capture_verifies(tmp_path):
    f = _standard()
    cap = read_capture(f.write(tmp_path / "ok.pcap", extra=NOISE))
    assert cap.stats["non_dosa"] == 3 and cap.stats["malformed"] == 0
    rep = verify(cap)
    assert rep["ok"], rep
    assert (rep["verified"], rep["partitions"], rep["rounds"]) == (9, 9, 3)
    assert rep["mismatches"] == [] and rep["incomplete"] == []
    nz = sum(sum(1 for v in s.values() if v) for s in f.truth.values())
    assert rep["entries_checked"] == nz  # one copy of each result entry, after dedup


def _result_frame(f: Fabric, rnd, part, copy=0, seq=0):
    for k, (label, pkt) in enumerate(f.frames):
        if label == ("result", JOB, rnd, part, copy, seq):
            return k, pkt
    raise KeyError


def test_flipped_result_value_is_named(tmp_path):
    f = _standard()
    k, pkt = _result_frame(f, 1, 2)
    b = bytearray(bytes(pkt[Raw]))
    h = Header.unpack(bytes(b))
    index = h.base + int.from_bytes(b[wire.HDR_LEN + 2 * 3:wire.HDR_LEN + 2 * 4], "big")  # 4th entry
    at = wire.value_offset(h.count) + 4 * 3
    old = int.from_bytes(b[at:at + 4], "big", signed=True)
    b[at:at + 4] = (old + 1).to_bytes(4, "big", signed=True)
    # corrupt every copy of that result packet, as a buggy DPU would
    for c in range(2):
        kk, p = _result_frame(f, 1, 2, copy=c)
        f.frames[kk] = (f.frames[kk][0], p.copy())
        f.frames[kk][1][Raw].load = bytes(b)
    rep = verify(read_capture(f.write(tmp_path / "flip.pcap")))
    assert not rep["ok"] and rep["verified"] == 8
    (m,) = rep["mismatches"]
    assert (m["job"], m["round"], m["partition"], m["mode"]) == (JOB, 1, 2, "sum")
    assert m["kinds"] == {"wrong_value": 1}
    assert m["details"][0] == {"kind": "wrong_value", "index": index, "expected": old, "got": old + 1}


def test_missing_and_extra_entries_are_mismatches(tmp_path):
    f = Fabric(1)
    f.round(JOB, 0, parts=[0], workers=range(2))
    # partition 1: the DPU forgets the largest index and adds a zero entry
    f.data(JOB, 0, 1, 0, np.array([1000, 1001, 1002]), np.array([5, 0, 7]))
    f.data(JOB, 0, 1, 1, np.array([1001, 1002]), np.array([0, -7]))  # 1002 cancels: zero sum
    f.result(JOB, 0, 1, np.array([1001, 1002]), np.array([0, 0]))
    rep = verify(read_capture(f.write(tmp_path / "m.pcap")))
    (m,) = rep["mismatches"]
    assert m["partition"] == 1
    assert m["kinds"] == {"missing_index": 1, "zero_sum_entry": 2}
    assert {"kind": "missing_index", "index": 1000, "expected": 5} in m["details"]


def test_zero_sums_are_absent_from_a_correct_result(tmp_path):
    f = Fabric(2)
    f.data(JOB, 0, 0, 0, np.array([1, 2, 3]), np.array([4, -4, 1]))
    f.data(JOB, 0, 0, 1, np.array([1, 2]), np.array([-4, 4]))
    f.result(JOB, 0, 0, np.array([3]), np.array([1]))
    assert verify(read_capture(f.write(tmp_path / "z.pcap")))["ok"]


def test_dropped_result_packet_is_incomplete_not_a_mismatch(tmp_path):
    f = _standard()
    total = sum(1 for label, _ in f.frames if label[:4] == ("result", JOB, 2, 1) and label[4] == 0)
    assert total >= 2, "the scenario should need several result packets"
    path = f.write(tmp_path / "drop.pcap", drop=lambda label: label[0] == "result" and label[2:4] == (2, 1)
                   and label[5] == 1)  # seq 1 lost, in both copies
    rep = verify(read_capture(path))
    assert not rep["ok"] and rep["verified"] == 8 and rep["mismatches"] == []  # fails closed
    (inc,) = rep["incomplete"]
    assert (inc["round"], inc["partition"], inc["edge"]) == (2, 1, True)  # the last round
    assert inc["missing"] == [f"result: {total - 1} of {total} packets"]
    assert verify(read_capture(path), partial_edges=True)["ok"]


def test_an_incomplete_round_between_complete_ones_fails_even_with_partial_edges(tmp_path, capsys):
    f = _standard()
    path = f.write(tmp_path / "hole.pcap", drop=lambda label: label[0] == "result" and label[2:4] == (1, 1)
                   and label[5] == 0)  # round 1 of 0..2: a hole, not an edge
    for pe in (False, True):
        rep = verify(read_capture(path), partial_edges=pe)
        assert not rep["ok"] and rep["incomplete_inner"] == 1 and not rep["incomplete"][0]["edge"]
    rc, out = _cli("capture", "verify", "--partial-edges", str(path), capsys=capsys)
    assert rc == 1 and "1 incomplete partition(s) between complete rounds" in out.out


def test_capture_show_into_a_closed_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys

    f = Fabric(0)
    for r in range(150):  # ~2400 lines, far more than a pipe buffer: the writer meets the closed pipe
        f.round(JOB, r, parts=range(4), workers=range(3), density=0.01)
    path = f.write(tmp_path / "many.pcap")
    p = subprocess.run(f"set -o pipefail; {sys.executable} -m dosa capture show {path} | head -n 2",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert p.returncode == 141 and len(p.stdout.splitlines()) == 2 and p.stderr == "", p.stderr


def test_missing_worker_data_is_incomplete(tmp_path):
    f = _standard()
    path = f.write(tmp_path / "w.pcap", drop=lambda label: label[0] == "data" and label[2:5] == (0, 0, 2))
    rep = verify(read_capture(path))
    assert rep["verified"] == 8 and rep["mismatches"] == []
    (inc,) = rep["incomplete"]
    assert (inc["round"], inc["partition"]) == (0, 0) and inc["missing"] == ["no data from worker(s) [2]"]


def test_duplicate_data_packets_are_counted_once(tmp_path):
    f = _standard()
    dups = []
    for label, pkt in f.frames:
        if label[0] == "data" and label[4] == 1:  # worker 1 retransmits everything
            p = pkt.copy()
            b = bytearray(bytes(p[Raw]))
            b[6:8] = (int.from_bytes(b[6:8], "big") | Flags.RETRANSMIT).to_bytes(2, "big")
            p[Raw].load = bytes(b)
            dups.append(p)
    cap = read_capture(f.write(tmp_path / "dup.pcap", extra=dups))
    rep = verify(cap)
    assert rep["ok"] and rep["verified"] == 9, rep["mismatches"]
    w1 = [w for gr in summarize(cap)["groups"] for w in gr["workers"] if w["worker"] == 1]
    assert all(w["duplicates"] == w["packets"] // 2 and w["seqs"] == w["total"] for w in w1)


def test_a_result_that_double_counts_a_duplicate_fails(tmp_path):
    f = Fabric(3)
    f.data(JOB, 0, 0, 0, np.array([5, 6]), np.array([1, 2]))
    f.data(JOB, 0, 0, 1, np.array([6]), np.array([3]))
    f.frames.append(f.frames[0])  # worker 0's packet twice
    f.result(JOB, 0, 0, np.array([5, 6]), np.array([2, 4]))  # what np.add of both copies gives
    rep = verify(read_capture(f.write(tmp_path / "dd.pcap")))
    (m,) = rep["mismatches"]
    assert m["kinds"] == {"wrong_value": 2}


def test_conflicting_copies_of_a_data_packet_are_reported(tmp_path):
    f = Fabric(4)
    f.data(JOB, 0, 0, 0, np.array([5]), np.array([1]))
    f.data(JOB, 0, 0, 1, np.array([6]), np.array([3]))
    f.result(JOB, 0, 0, np.array([5, 6]), np.array([1, 3]))
    h = Header(job_id=JOB, worker_id=0, flags=Flags.LAST | Flags.RETRANSMIT, scale_exp=8)
    other = f._udp("10.0.0.1", wire.build_packet(h, np.array([[5, 2]])))
    rep = verify(read_capture(f.write(tmp_path / "cc.pcap", extra=[other])))
    (m,) = rep["mismatches"]
    assert m["kinds"] == {"conflicting_copies": 1} and m["details"][0]["worker"] == 0


def test_gtopk_result_verifies_and_wrong_set_fails(tmp_path):
    f = Fabric(5)
    f.round(JOB, 0, parts=range(2), workers=range(3), gtopk_k=20)
    rep = verify(read_capture(f.write(tmp_path / "g.pcap")))
    assert rep["ok"] and rep["gtopk_partitions"] == 2 and rep["verified"] == 2
    # partition 2: return a small sum instead of the largest one
    f.data(JOB, 0, 2, 0, np.array([2000, 2001, 2002, 2003]), np.array([50, -40, 3, 2]))
    f.data(JOB, 0, 2, 1, np.array([2000, 2001]), np.array([1, -1]))
    f.data(JOB, 0, 2, 2, np.array([2003]), np.array([1]))
    f.result(JOB, 0, 2, np.array([2000, 2002]), np.array([51, 3]), gtopk=True)
    rep = verify(read_capture(f.write(tmp_path / "g2.pcap")))
    (m,) = rep["mismatches"]
    assert (m["partition"], m["mode"], m["kinds"]) == (2, "gtopk", {"not_top_k": 1})
    assert m["details"][0] == {"kind": "not_top_k", "index": 2001, "sum": -41, "smallest_returned": 3}


def test_gtopk_ties_at_the_boundary_are_accepted(tmp_path):
    f = Fabric(6)
    f.data(JOB, 0, 0, 0, np.array([1, 2, 3]), np.array([9, -4, 4]))
    f.result(JOB, 0, 0, np.array([1, 3]), np.array([9, 4]), gtopk=True)  # |-4| == |4|: either is top-2
    assert verify(read_capture(f.write(tmp_path / "t.pcap")))["ok"]
    f.frames = f.frames[:1]
    f.result(JOB, 0, 0, np.array([1, 3]), np.array([9, 5]), gtopk=True)  # the value must still be exact
    assert verify(read_capture(f.write(tmp_path / "t2.pcap")))["mismatches"][0]["kinds"] == {"wrong_value": 1}


def test_dense_data_and_results_verify_by_base(tmp_path):
    f = Fabric(7)
    base = 3000
    v0 = np.arange(-400, 400)  # 800 values: 3 dense packets
    v1 = np.ones(800, np.int64)
    f.data(JOB, 4, 3, 0, base + np.arange(800), v0, dense_base=base)
    f.data(JOB, 4, 3, 1, base + np.arange(800), v1, dense_base=base)
    f.result(JOB, 4, 3, base + np.arange(800), v0 + v1, dense_base=base)
    cap = read_capture(f.write(tmp_path / "d.pcap"))
    rep = verify(cap)
    assert rep["ok"] and rep["verified"] == 1 and rep["entries_checked"] == 800
    assert summarize(cap)["groups"][0]["result"]["dense"]
    f.frames = [fr for fr in f.frames if fr[0][0] == "data"]
    bad = v0 + v1
    bad[799] += 1
    f.result(JOB, 4, 3, base + np.arange(800), bad, dense_base=base)
    (m,) = verify(read_capture(f.write(tmp_path / "d2.pcap")))["mismatches"]
    assert m["details"][0] == {"kind": "wrong_value", "index": base + 799, "expected": int(bad[799]) - 1,
                               "got": int(bad[799])}


def test_scale_exp_disagreement_is_a_mismatch(tmp_path):
    f = Fabric(8)
    f.data(JOB, 0, 0, 0, np.array([1]), np.array([1]), scale=8)
    f.data(JOB, 0, 0, 1, np.array([2]), np.array([1]), scale=9)
    f.result(JOB, 0, 0, np.array([1, 2]), np.array([1, 1]), scale=8)
    (m,) = verify(read_capture(f.write(tmp_path / "s.pcap")))["mismatches"]
    assert m["kinds"] == {"scale_exp": 1}


def test_several_jobs_are_kept_apart(tmp_path):
    f = Fabric(9)
    f.round(1, 0, parts=range(2), workers=range(2))
    f.round(2, 0, parts=range(2), workers=range(4))
    rep = verify(read_capture(f.write(tmp_path / "j.pcap")))
    assert rep["ok"] and rep["verified"] == 4 and rep["rounds"] == 2


def test_show_groups_workers_and_counts_malformed(tmp_path):
    f = Fabric(10)
    f.round(JOB, 5, parts=[0], workers=range(2))
    bad = bytearray(wire.build_packet(Header(flags=Flags.LAST)))
    bad[4] = 9  # version
    short = wire.build_packet(Header(flags=Flags.LAST), np.array([[1, 1]]))[:-3]
    hb = wire.build_packet(Header(type=PacketType.HEARTBEAT, worker_id=1))
    extra = [f._udp("10.0.0.1", bytes(bad)), f._udp("10.0.0.1", short), f._udp("10.0.0.2", hb)] + NOISE
    cap = read_capture(f.write(tmp_path / "s.pcap", extra=extra))
    s = summarize(cap)
    assert s["malformed"] == 2 and s["malformed_by_reason"] == {"bad_version": 1, "count_mismatch": 1}
    assert s["non_dosa"] == 3 and s["other_packets"] == {"HEARTBEAT": 1}
    (gr,) = s["groups"]
    assert (gr["job"], gr["round"], gr["partition"]) == (JOB, 5, 0)
    assert [w["worker"] for w in gr["workers"]] == [0, 1]
    for w in gr["workers"]:
        assert w["seqs"] == w["total"] == w["packets"] and w["duplicates"] == 0
    assert gr["result"]["packets"] == 2 * gr["result"]["total"] and gr["result"]["duplicates"] == gr["result"]["total"]
    data_entries = sum(Header.unpack(bytes(p[Raw])).count for label, p in f.frames if label[0] == "data")
    assert sum(w["entries"] for w in gr["workers"]) == data_entries > 0


def test_port_filter(tmp_path):
    f = Fabric(11)
    f.round(JOB, 0, parts=[0], workers=range(2))
    path = f.write(tmp_path / "p.pcap")
    assert read_capture(path, port=PORT).stats["dosa_packets"] == len(f.frames)
    c = read_capture(path, port=12345)
    assert c.stats["dosa_packets"] == 0 and c.stats["non_dosa"] == len(f.frames)


def test_linux_cooked_and_pcapng_captures(tmp_path):
    f = Fabric(12)
    f.round(JOB, 0, parts=range(2), workers=range(2))
    sll = [CookedLinux(proto=0x0800) / p[IP] for _, p in f.frames]
    wrpcap(str(tmp_path / "sll.pcap"), sll)
    assert verify(read_capture(tmp_path / "sll.pcap"))["verified"] == 2
    raw_ip = [p[IP] for _, p in f.frames]
    wrpcap(str(tmp_path / "raw.pcap"), raw_ip, linktype=101)
    assert verify(read_capture(tmp_path / "raw.pcap"))["verified"] == 2
    with PcapNgWriter(str(tmp_path / "ng.pcapng")) as w:
        for _, p in f.frames:
            w.write(p)
    assert verify(read_capture(tmp_path / "ng.pcapng"))["verified"] == 2


def test_truncated_snaplen_and_file_are_reported(tmp_path):
    f = Fabric(13)
    f.round(JOB, 0, parts=[0], workers=range(2))
    path = f.write(tmp_path / "t.pcap")
    data = path.read_bytes()
    (tmp_path / "cut.pcap").write_bytes(data[:-10])
    c = read_capture(tmp_path / "cut.pcap")
    assert c.stats["truncated_file"] and c.stats["dosa_packets"] == len(f.frames) - 1
    # a frame cut as tcpdump -s 60 would cut it
    with RawPcapWriter(str(tmp_path / "snap.pcap"), linktype=1) as w:
        raw = bytes(f.frames[0][1])
        w.write_header(None)
        w.write_packet(raw[:60], wirelen=len(raw))
    assert read_capture(tmp_path / "snap.pcap").stats["truncated_by_snaplen"] == 1


def _cli(*argv, capsys):
    rc = dosa_main(list(argv))
    return rc, capsys.readouterr()


def test_cli_exit_codes_and_json(tmp_path, capsys):
    f = _standard()
    ok = f.write(tmp_path / "ok.pcap")
    rc, out = _cli("capture", "verify", str(ok), capsys=capsys)
    assert rc == 0 and "verified 9 of 9" in out.out and out.out.rstrip().endswith("OK")
    rc, out = _cli("capture", "verify", "--json", str(ok), capsys=capsys)
    rep = json.loads(out.out)
    assert rc == 0 and rep["ok"] and rep["verified"] == 9
    assert set(rep) >= {"verified", "mismatches", "incomplete", "rounds", "partitions", "ok"}

    k, pkt = _result_frame(f, 0, 0)
    b = bytearray(bytes(pkt[Raw]))
    b[wire.HDR_LEN + 7] ^= 1
    f.frames = [fr for fr in f.frames if fr[0][0] != "result" or fr[0][2:4] != (0, 0) or fr[0][5] != 0]
    f.frames.append((("x",), f._udp("10.0.9.1", bytes(b), dport=40000, sport=PORT)))
    bad = f.write(tmp_path / "bad.pcap")
    rc, out = _cli("capture", "verify", str(bad), capsys=capsys)
    assert rc == 1 and "MISMATCH job 7 round 0 partition 0" in out.out
    rc, out = _cli("capture", "show", str(bad), capsys=capsys)
    assert rc == 0 and "w2" in out.out and "DPU" in out.out
    rc, out = _cli("capture", "show", "--json", str(bad), capsys=capsys)
    assert rc == 0 and len(json.loads(out.out)["groups"]) == 9

    (tmp_path / "junk").write_bytes(b"not a capture at all")
    rc, out = _cli("capture", "verify", str(tmp_path / "junk"), capsys=capsys)
    assert rc == 2 and "not a pcap" in out.err
    rc, out = _cli("capture", "show", str(tmp_path / "missing.pcap"), capsys=capsys)
    assert rc == 2 and "cannot read capture" in out.err
    empty = tmp_path / "empty.pcap"
    wrpcap(str(empty), NOISE)
    rc, out = _cli("capture", "verify", str(empty), capsys=capsys)
    assert rc == 1 and "nothing could be verified" in out.out


def test_packets_from_host_lib_packetizer_verify(tmp_path):
    """Captures of what the real encoders produce (dosa.packetizer for the workers' data and
    the DPU's results) verify, and a result computed without one worker's data does not."""
    from dosa.packetizer import packetize, packetize_results

    pm = wire.PartitionMap(numel=5000, partition_size=1200, num_dpus=2)
    rng = np.random.default_rng(21)
    batches, total = [], np.zeros(pm.numel, np.int64)
    for w in range(3):
        idx = np.sort(rng.choice(pm.numel, 900, replace=False)).astype(np.uint32)
        val = rng.integers(-3000, 3000, len(idx)).astype(np.int32)
        total[idx] += val
        batches.append(packetize(idx, val, pm, job_id=JOB, worker_id=w, round=11, scale_exp=12))
    nz = np.flatnonzero(total)
    good = packetize_results(nz.astype(np.uint32), total[nz].astype(np.int32), pm, job_id=JOB, round=11,
                             scale_exp=12)

    def write(path, result_batch):
        pk = [Ether() / IP() / UDP(sport=40000, dport=PORT) / Raw(b.packet(i))
              for b in batches + [result_batch] for i in range(len(b))]
        wrpcap(str(path), pk)
        return path

    rep = verify(read_capture(write(tmp_path / "h.pcap", good)))
    assert rep["ok"] and rep["verified"] == pm.num_partitions == 5, rep
    off_by_one = total[nz] + (nz % 7 == 0)  # every 7th index one too high
    wrong = packetize_results(nz.astype(np.uint32), off_by_one.astype(np.int32), pm, job_id=JOB, round=11,
                              scale_exp=12)
    rep = verify(read_capture(write(tmp_path / "h2.pcap", wrong)))
    assert not rep["ok"] and {m["partition"] for m in rep["mismatches"]} == set(range(5))
    assert all(set(m["kinds"]) == {"wrong_value"} for m in rep["mismatches"])


def _v1_packet(job, part, idx_val) -> bytes:
    """A protocol v1 SPARSE_DATA payload as v1 wrote it: the same header with version 1, then
    8-byte (u32 absolute index, s32 value) entries."""
    h = Header(job_id=job, partition=part, flags=Flags.LAST, count=len(idx_val), version=1)
    return h.pack() + b"".join(int(i).to_bytes(4, "big") + int(v).to_bytes(4, "big", signed=True)
                               for i, v in idx_val)


def test_v1_capture_is_refused_in_one_sentence(tmp_path, capsys):
    f = Fabric(3)
    pk = [f._udp("10.0.0.1", _v1_packet(JOB, 0, [(1, 2), (5, -3)])) for _ in range(3)]
    path = tmp_path / "v1.pcap"
    wrpcap(str(path), pk)
    with pytest.raises(DosaError, match=r"protocol v1 packets \(3 of them\).*only version this dosa reads"):
        read_capture(path)
    rc, out = _cli("capture", "verify", str(path), capsys=capsys)
    assert rc == 2 and "protocol v1" in out.err and "Traceback" not in out.err
    assert len(out.err.strip().splitlines()) == 1
    # mixed with v2 traffic, v1 packets are malformed (bad_version) and the rest is read
    g = _standard()
    cap = read_capture(g.write(tmp_path / "mixed.pcap", extra=pk))
    assert cap.stats["malformed_by_reason"] == {"bad_version": 3} and verify(cap)["ok"]


@pytest.mark.parametrize("mtu", [wire.DEFAULT_MTU, wire.MAX_MTU])
def test_packetizer_rounds_with_dense_runs_verify(tmp_path, mtu):
    """What dosa.packetizer sends (sparse partitions, a dense run, results both ways) at any
    MTU reads back and verifies; a wrong sum in a dense result is named."""
    from dosa.packetizer import packetize, packetize_results

    pm = PartitionMap(numel=150000, partition_size=65536)
    rng = np.random.default_rng(5)
    f = Fabric(0)
    total = np.zeros(pm.numel, np.int64)
    pkts = []
    for w in range(2):
        idx = np.unique(np.r_[rng.choice(131072, 2000, replace=False), np.arange(131072, 140000)])
        val = rng.integers(-100, 100, len(idx)).astype(np.int32)
        np.add.at(total, idx, val)
        b = packetize(idx.astype(np.uint32), val, pm, job_id=JOB, worker_id=w, round=0, scale_exp=4, mtu=mtu)
        pkts += [f._udp(f"10.0.0.{w + 1}", b.packet(i)) for i in range(len(b))]
    nz = np.flatnonzero(total)
    r = packetize_results(nz.astype(np.uint32), total[nz].astype(np.int32), pm, job_id=JOB, round=0,
                          scale_exp=4, mtu=mtu)
    types = set(r.headers()["type"].tolist())
    assert types == {PacketType.SPARSE_RESULT, PacketType.DENSE_RESULT}
    res = [f._udp("10.0.9.1", r.packet(i), dport=40000, sport=PORT) for i in range(len(r))]
    path = tmp_path / "v2.pcap"
    wrpcap(str(path), pkts + res)
    rep = verify(read_capture(path))
    assert rep["ok"] and rep["verified"] == pm.num_partitions, rep
    d = int(np.flatnonzero(r.headers()["type"] == PacketType.DENSE_RESULT)[0])
    bad = bytearray(r.packet(d))
    bad[wire.HDR_LEN + 3] ^= 1  # the first dense sum
    res[d] = f._udp("10.0.9.1", bytes(bad), dport=40000, sport=PORT)
    wrpcap(str(path), pkts + res)
    rep = verify(read_capture(path))
    assert not rep["ok"] and rep["mismatches"][0]["kinds"] == {"wrong_value": 1}
