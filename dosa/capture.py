"""Read dosa packets out of a capture file, group them per (job, round, partition), and check that
the DPU's result packets carry exactly the sums of the workers' data packets.

Why not scapy's PcapReader: it builds a Python object per packet (~50 us each), so a capture of one
training run (10^5..10^6 packets) would take minutes. Here the file is read once into a numpy buffer;
only the walk over the record headers is a Python loop (a few hundred ns a record); Ethernet/IPv4/UDP
decoding, dosa header validation, entry extraction, deduplication, the int64 sums and the comparison
are vectorized over the whole capture. pcapng files go through scapy's raw reader (bytes only, no
dissection) and then the same path.

Packets are recognised as dosa by their magic (and, with ``port``, by UDP source or destination
port), not by a fixed port, since every deployment may configure its own. See docs/capture.md.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dosa import wire
from dosa.errors import DosaError
from dosa.wire import HDR_LEN, HEADER_DTYPE, Flags, PacketType

# --------------------------------------------------------------------------------------------------
# Capture files -> raw frames
# --------------------------------------------------------------------------------------------------
LINKTYPE_NULL = 0  # BSD loopback: 4-byte address family in host order
LINKTYPE_ETHERNET = 1
LINKTYPE_RAW = 101  # raw IP
LINKTYPE_LOOP = 108  # OpenBSD loopback: 4-byte address family in network order
LINKTYPE_LINUX_SLL = 113  # tcpdump -i any (older)
LINKTYPE_IPV4 = 228
LINKTYPE_LINUX_SLL2 = 276  # tcpdump -i any (4.99+)

_PCAP_MAGICS = {  # first 4 bytes as written -> (byte order, timestamp is nanoseconds)
    b"\xd4\xc3\xb2\xa1": "<", b"\xa1\xb2\xc3\xd4": ">",
    b"\x4d\x3c\xb2\xa1": "<", b"\xa1\xb2\x3c\x4d": ">",
}
_PCAPNG_MAGIC = b"\x0a\x0d\x0d\x0a"
_PAD = 64  # zero bytes after the buffer so fixed-width gathers past a short frame stay in bounds


@dataclass
class Frames:
    """Every record of a capture: frame i is ``buf[off[i] : off[i] + caplen[i]]``."""

    buf: np.ndarray  # uint8, followed by _PAD zero bytes
    off: np.ndarray  # int64
    caplen: np.ndarray  # int64
    linktype: np.ndarray  # int64 per frame (pcapng may mix interfaces)
    truncated_file: bool = False  # the last record was cut short (capture killed mid-write)


def read_frames(path: str | Path) -> Frames:
    """Load a pcap or pcapng file. Raises DosaError if it is missing or not a capture file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DosaError(f"cannot read capture {path}: {e.strerror}") from None
    if data[:4] == _PCAPNG_MAGIC:
        return _read_pcapng(path)
    order = _PCAP_MAGICS.get(data[:4])
    if order is None or len(data) < 24:
        raise DosaError(f"{path} is not a pcap or pcapng capture file")
    linktype = struct.unpack_from(order + "I", data, 20)[0] & 0x0FFFFFFF
    rec = struct.Struct(order + "IIII")
    offs, lens = [], []
    pos, n, truncated = 24, len(data), False
    unpack = rec.unpack_from
    while pos + 16 <= n:  # the one per-record Python loop: variable-length records
        caplen = unpack(data, pos)[2]
        if pos + 16 + caplen > n:
            truncated = True
            break
        offs.append(pos + 16)
        lens.append(caplen)
        pos += 16 + caplen
    if pos != n and not truncated:
        truncated = True
    buf = np.frombuffer(data + bytes(_PAD), np.uint8)
    off = np.array(offs, np.int64)
    return Frames(buf, off, np.array(lens, np.int64), np.full(len(off), linktype, np.int64), truncated)


def _read_pcapng(path) -> Frames:
    from scapy.error import Scapy_Exception
    from scapy.utils import RawPcapNgReader

    chunks, links = [], []
    try:
        with RawPcapNgReader(str(path)) as rd:
            for pkt, meta in rd:
                chunks.append(pkt)
                links.append(meta.linktype)
    except (Scapy_Exception, EOFError, struct.error) as e:
        if not chunks:
            raise DosaError(f"{path} is not a readable pcapng capture: {e}") from None
    lens = np.array([len(c) for c in chunks], np.int64)
    off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if len(lens) else lens
    buf = np.frombuffer(b"".join(chunks) + bytes(_PAD), np.uint8)
    return Frames(buf, off, lens, np.array(links, np.int64))


# --------------------------------------------------------------------------------------------------
# Frames -> UDP payloads (vectorized Ethernet / SLL / raw IPv4 / UDP decoding)
# --------------------------------------------------------------------------------------------------
def _be16(buf, at):
    return (buf[at].astype(np.int64) << 8) | buf[at + 1]


def _be32(buf, at):
    return (_be16(buf, at) << 16) | _be16(buf, at + 2)


@dataclass
class UdpPayloads:
    frame: np.ndarray  # record number in the file
    start: np.ndarray  # offset of the UDP payload in buf
    length: np.ndarray  # UDP payload length (from the UDP header)
    sport: np.ndarray
    dport: np.ndarray
    truncated: np.ndarray  # bool: the capture snap length cut the payload


def udp_payloads(fr: Frames) -> tuple[UdpPayloads, int]:
    """IPv4/UDP payloads of all frames (non-fragmented only), and the number of other frames."""
    buf, off, cap, lt = fr.buf, fr.off, fr.caplen, fr.linktype
    n = len(off)
    l3 = np.full(n, -1, np.int64)  # offset of the IPv4 header, -1 = not IPv4
    eth = (lt == LINKTYPE_ETHERNET) & (cap >= 14)
    et = np.where(eth, _be16(buf, np.where(eth, off + 12, 0)), 0)
    vlan = eth & ((et == 0x8100) | (et == 0x88A8)) & (cap >= 18)
    et = np.where(vlan, _be16(buf, np.where(vlan, off + 16, 0)), et)
    l3 = np.where(eth & (et == 0x0800), off + np.where(vlan, 18, 14), l3)
    sll = (lt == LINKTYPE_LINUX_SLL) & (cap >= 16)
    l3 = np.where(sll & (_be16(buf, np.where(sll, off + 14, 0)) == 0x0800), off + 16, l3)
    sll2 = (lt == LINKTYPE_LINUX_SLL2) & (cap >= 20)
    l3 = np.where(sll2 & (_be16(buf, np.where(sll2, off, 0)) == 0x0800), off + 20, l3)
    raw = (lt == LINKTYPE_RAW) | (lt == LINKTYPE_IPV4)
    l3 = np.where(raw, off, l3)
    null = ((lt == LINKTYPE_NULL) | (lt == LINKTYPE_LOOP)) & (cap >= 4)
    fam = _be32(buf, np.where(null, off, 0))
    l3 = np.where(null & ((fam == 2) | (fam == 0x02000000)), off + 4, l3)

    end = off + cap
    ip = (l3 >= 0) & (l3 + 20 <= end)
    idx = np.flatnonzero(ip)
    l3, end = l3[idx], end[idx]
    b0 = buf[l3]
    ihl = (b0 & 15).astype(np.int64) * 4
    frag = _be16(buf, l3 + 6) & 0x3FFF  # MF flag or fragment offset: not a whole datagram
    ok = ((b0 >> 4) == 4) & (ihl >= 20) & (buf[l3 + 9] == 17) & (frag == 0) & (l3 + ihl + 8 <= end)
    idx, l3, ihl, end = idx[ok], l3[ok], ihl[ok], end[ok]
    l4 = l3 + ihl
    ulen = _be16(buf, l4 + 4) - 8
    good = ulen >= 0
    idx, l4, ulen, end = idx[good], l4[good], ulen[good], end[good]
    start = l4 + 8
    p = UdpPayloads(frame=idx, start=start, length=ulen, sport=_be16(buf, l4), dport=_be16(buf, l4 + 2),
                    truncated=start + ulen > end)
    return p, n - len(idx)


# --------------------------------------------------------------------------------------------------
# UDP payloads -> validated dosa packets
# --------------------------------------------------------------------------------------------------
NATIVE_HDR = np.dtype([(n, np.dtype(t).newbyteorder("=")) for n, t, _ in wire.HEADER_FIELDS])
SPARSE_TYPES = (PacketType.SPARSE_DATA, PacketType.SPARSE_RESULT)
DENSE_TYPES = (PacketType.DENSE_DATA, PacketType.DENSE_RESULT)
DATA_TYPES = (PacketType.SPARSE_DATA, PacketType.DENSE_DATA)
RESULT_TYPES = (PacketType.SPARSE_RESULT, PacketType.DENSE_RESULT)
#: types that are part of a (round, partition) contribution: seq/total/LAST/scale are checked
SEQUENCED_TYPES = DATA_TYPES + RESULT_TYPES

_NTYPES = max(PacketType) + 1
_TYPE_OK = np.zeros(256, bool)
_ENTRY_LEN = np.zeros(256, np.int64)
_MAX_ENTRIES = np.zeros(256, np.int64)
_SEQUENCED = np.zeros(256, bool)
_SPARSE = np.zeros(256, bool)
_DENSE = np.zeros(256, bool)
for _t in PacketType:
    _TYPE_OK[_t], _ENTRY_LEN[_t], _MAX_ENTRIES[_t] = True, wire.ENTRY_LEN[_t], wire.MAX_ENTRIES[_t]
_SEQUENCED[list(SEQUENCED_TYPES)] = True
_SPARSE[list(SPARSE_TYPES)] = True
_DENSE[list(DENSE_TYPES)] = True

#: reason codes of header_reasons, in the order dosa.wire.validate_header checks its rules; the
#: name is the ProtocolError subclass validate_header raises for it.
REASONS = ["ok", "TruncatedPacket", "BadMagic", "BadVersion", "BadType", "CountMismatch", "BadField"]


def header_reasons(hdr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Vectorized dosa.wire.validate_header: per packet the index in REASONS of the first broken rule
    (0 = valid). ``hdr`` is a HEADER_DTYPE (or NATIVE_HDR) array; tests check that this agrees
    with validate_header on random headers, so the two cannot drift silently."""
    g = {n: hdr[n].astype(np.int64) for n in hdr.dtype.names}
    t = np.clip(g["type"], 0, 255)
    seqd = _SEQUENCED[t]
    flags, seq, total, scale = g["flags"], g["seq"], g["total"], g["scale_exp"]
    rules = [
        length < HDR_LEN,
        g["magic"] != wire.MAGIC,
        g["version"] != wire.VERSION,
        ~_TYPE_OK[t],
        (g["count"] > _MAX_ENTRIES[t]) | (length != HDR_LEN + _ENTRY_LEN[t] * g["count"]),
        ((flags & ~wire.FLAGS_VALID_MASK) != 0) | (g["reserved"] != 0)
        | (seqd & ((total < 1) | (total > wire.MAX_PACKETS_PER_CONTRIBUTION) | (seq >= total)
                   | (((flags & int(Flags.LAST)) != 0) != (seq == total - 1))
                   | (scale < wire.SCALE_EXP_MIN) | (scale > wire.SCALE_EXP_MAX)))
        | (_SPARSE[t] & (g["base"] != 0))
        | ((g["worker_id"] >= wire.MAX_WORKERS) & (g["worker_id"] != wire.DPU_SENDER_ID))
        | (g["partition"] >= wire.MAX_PARTITIONS),
    ]
    code = np.zeros(len(length), np.int64)
    for i, bad in reversed(list(enumerate(rules, start=1))):
        code[bad] = i  # reversed: the earliest broken rule wins
    return code


@dataclass
class DosaCapture:
    """The valid dosa packets of a capture (in file order) and their entries, flattened."""

    hdr: np.ndarray  # NATIVE_HDR, one per valid dosa packet
    frame: np.ndarray  # int64 record number in the file
    start: np.ndarray  # int64 offset of the dosa packet (UDP payload) in buf
    length: np.ndarray  # int64 bytes
    buf: np.ndarray
    # entries of data/result packets (sparse: the index; dense: base + position)
    entry_pkt: np.ndarray  # int64 row of hdr
    entry_index: np.ndarray  # int64
    entry_value: np.ndarray  # int64
    stats: dict = field(default_factory=dict)

    def payload(self, row: int) -> bytes:
        s = int(self.start[row])
        return self.buf[s: s + int(self.length[row])].tobytes()


def _gather(buf, at: np.ndarray, width: int) -> np.ndarray:
    return buf[at[:, None] + np.arange(width)] if len(at) else np.zeros((0, width), np.uint8)


def _words(buf, at: np.ndarray) -> np.ndarray:
    """Big-endian u32 at byte offsets ``at`` (int64 result).

    One gather of 4-byte words instead of 4 byte gathers: the buffer is viewed as ``>u4`` at each
    of the 4 byte shifts (views, no copies) and each offset reads from the view of its shift."""
    def view(k):
        n = (len(buf) - k) // 4
        return buf[k: k + 4 * n].view(">u4")

    if not len(at):
        return np.zeros(0, np.int64)
    shift = at & 3
    k0 = int(shift[0])
    if (shift == k0).all():  # the usual case: every frame of a capture has the same headers
        return view(k0)[(at - k0) >> 2].astype(np.int64)
    out = np.empty(len(at), np.int64)
    for k in range(4):
        m = shift == k
        out[m] = view(k)[(at[m] - k) >> 2]
    return out


def _entries(buf, hdr, start, rows, entry_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packet row, absolute index, value) of every entry of packets ``rows``, which all have
    ``entry_len``-byte entries (8: sparse (u32 index, s32 value); 4: dense s32 at base + position)."""
    counts = hdr["count"][rows].astype(np.int64)
    pkt = np.repeat(rows, counts)
    pos = np.arange(len(pkt)) - np.repeat(np.cumsum(counts) - counts, counts)
    at = start[pkt] + HDR_LEN + pos * entry_len
    if entry_len == wire.SPARSE_ENTRY_LEN:
        index, value = _words(buf, at), _words(buf, at + 4)
    else:
        index, value = hdr["base"][pkt].astype(np.int64) + pos, _words(buf, at)
    return pkt, index, np.where(value >= 2**31, value - 2**32, value)  # s32 two's complement


def read_capture(path: str | Path, port: int | None = None) -> DosaCapture:
    """Read every dosa packet of a capture. Raises DosaError for a missing or non-capture file.

    A UDP payload is a dosa packet candidate when it starts with the magic (and, if ``port`` is
    given, when its source or destination port is ``port``; then any other payload on that port
    counts as malformed). Candidates that break a rule of docs/protocol.md are counted by reason in
    ``stats["malformed_by_reason"]`` and left out; so are ones cut by the snap length.
    """
    fr = read_frames(path)
    udp, non_ip_udp = udp_payloads(fr)
    buf = fr.buf
    has4 = udp.length >= 4
    magic = np.where(has4, _be32(buf, udp.start), -1) == wire.MAGIC
    if port is None:
        cand = magic
    else:
        cand = (udp.sport == port) | (udp.dport == port)
    stats = {"frames": len(fr.off), "non_dosa": int(non_ip_udp + (~cand).sum()),
             "truncated_by_snaplen": int((cand & udp.truncated).sum()),
             "truncated_file": fr.truncated_file}
    keep = cand & ~udp.truncated
    start, length, frame = udp.start[keep], udp.length[keep], udp.frame[keep]
    raw = np.ascontiguousarray(_gather(buf, start, HDR_LEN))
    hdr = raw.view(HEADER_DTYPE).reshape(-1)
    code = header_reasons(hdr, length)
    stats["malformed"] = int((code != 0).sum())
    stats["malformed_by_reason"] = {REASONS[c]: int(n) for c, n in zip(*np.unique(code, return_counts=True))
                                    if c != 0}
    ok = code == 0
    hdr = hdr[ok].astype(NATIVE_HDR)
    start, length, frame = start[ok], length[ok], frame[ok]
    stats["dosa_packets"] = len(hdr)
    stats["by_type"] = {PacketType(t).name: int(n)
                        for t, n in zip(*np.unique(hdr["type"], return_counts=True))}

    t = hdr["type"].astype(np.int64)
    parts = [_entries(buf, hdr, start, np.flatnonzero(_SPARSE[t]), wire.SPARSE_ENTRY_LEN),
             _entries(buf, hdr, start, np.flatnonzero(_DENSE[t]), wire.DENSE_ENTRY_LEN)]
    entry_pkt, entry_index, entry_value = (np.concatenate(x) for x in zip(*parts))
    return DosaCapture(hdr, frame, start, length, buf, entry_pkt, entry_index, entry_value, stats)


# --------------------------------------------------------------------------------------------------
# Grouping helpers
# --------------------------------------------------------------------------------------------------
def _runs(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort rows by ``keys`` (first key most significant; ties keep file order).

    Returns (order, run_id per sorted row, first sorted position of each run)."""
    n = len(keys[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort(keys[::-1])
    new = np.zeros(n, bool)
    new[0] = True
    for k in keys:
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    run = np.cumsum(new) - 1
    return order, run, np.flatnonzero(new)


def first_occurrence(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(is_first, first_row): whether each row is the first in file order with its key, and the
    row of that first occurrence."""
    order, run, starts = _runs(keys)
    first_row = np.empty(len(order), np.int64)
    first_row[order] = order[starts][run]
    return first_row == np.arange(len(order)), first_row


@dataclass
class Groups:
    """(job, round, partition) groups of the data and result packets of a capture."""

    keys: np.ndarray  # (g, 3) int64: job, round, partition
    gid: np.ndarray  # per packet row: group id, -1 for packets outside data/result types
    first: np.ndarray  # per packet row: True if first copy of (group, sender, seq)
    first_row: np.ndarray  # per packet row: row of its first copy


def group(cap: DosaCapture) -> Groups:
    h = cap.hdr
    t = h["type"].astype(np.int64)
    rows = np.flatnonzero(_SEQUENCED[t])
    job, rnd, part = (h[f][rows].astype(np.int64) for f in ("job_id", "round", "partition"))
    order, run, starts = _runs([job, rnd, part])
    gid = np.full(len(h), -1, np.int64)
    gid[rows[order]] = run
    keys = np.stack([job[order][starts], rnd[order][starts], part[order][starts]], axis=1) \
        if len(rows) else np.zeros((0, 3), np.int64)
    # the sender of a data packet is its worker; results share one seq space (worker_id 0xFFFF)
    is_first, first_row = first_occurrence([gid[rows], h["worker_id"][rows].astype(np.int64),
                                            h["seq"][rows].astype(np.int64)]) \
        if len(rows) else (np.zeros(0, bool), np.zeros(0, np.int64))
    first = np.zeros(len(h), bool)
    first[rows] = is_first
    frow = np.arange(len(h))
    frow[rows] = rows[first_row]
    return Groups(keys, gid, first, frow)


# --------------------------------------------------------------------------------------------------
# dosa capture show: per (job, round, partition), per sender: packets, seqs, entries
# --------------------------------------------------------------------------------------------------
@dataclass
class SenderStats:
    """Per (group, sender) aggregates; sender = worker_id (DPU_SENDER_ID for results)."""

    gid: np.ndarray
    sender: np.ndarray
    packets: np.ndarray  # every copy
    seqs: np.ndarray  # distinct seqs
    total: np.ndarray  # largest ``total`` seen
    total_min: np.ndarray  # smallest (differs from total: the sender changed it mid-contribution)
    entries: np.ndarray  # entries of distinct packets
    flags_or: np.ndarray  # OR of the flags of all copies
    dense: np.ndarray  # bool: some packet is a dense type
    scale_min: np.ndarray
    scale_max: np.ndarray


def sender_stats(cap: DosaCapture, g: Groups, rows: np.ndarray) -> SenderStats:
    h = cap.hdr
    key = g.gid[rows] * 65536 + h["worker_id"][rows].astype(np.int64)
    uk, inv = np.unique(key, return_inverse=True)
    n = len(uk)
    first = g.first[rows]

    def red(ufunc, vals, init):
        out = np.full(n, init, np.int64)
        ufunc.at(out, inv, vals.astype(np.int64))
        return out

    return SenderStats(
        gid=uk // 65536, sender=uk % 65536,
        packets=np.bincount(inv, minlength=n),
        seqs=np.bincount(inv, weights=first, minlength=n).astype(np.int64),
        total=red(np.maximum, h["total"][rows], 0),
        total_min=red(np.minimum, h["total"][rows], 1 << 30),
        entries=np.bincount(inv, weights=h["count"][rows] * first, minlength=n).astype(np.int64),
        flags_or=red(np.bitwise_or, h["flags"][rows], 0),
        dense=red(np.maximum, _DENSE[h["type"][rows].astype(np.int64)], 0).astype(bool),
        scale_min=red(np.minimum, h["scale_exp"][rows], 1 << 30),
        scale_max=red(np.maximum, h["scale_exp"][rows], -(1 << 30)),
    )


def _rows_of(cap: DosaCapture, types) -> np.ndarray:
    return np.flatnonzero(np.isin(cap.hdr["type"], [int(t) for t in types]))


def summarize(cap: DosaCapture, g: Groups | None = None) -> dict:
    """Everything ``dosa capture show`` prints, as a JSON-ready dict."""
    g = g or group(cap)
    ds = sender_stats(cap, g, _rows_of(cap, DATA_TYPES))
    rs = sender_stats(cap, g, _rows_of(cap, RESULT_TYPES))
    groups = [{"job": int(j), "round": int(r), "partition": int(p), "workers": [], "result": None}
              for j, r, p in g.keys]
    for i in range(len(ds.gid)):
        groups[ds.gid[i]]["workers"].append({
            "worker": int(ds.sender[i]), "packets": int(ds.packets[i]),
            "duplicates": int(ds.packets[i] - ds.seqs[i]), "seqs": int(ds.seqs[i]),
            "total": int(ds.total[i]), "entries": int(ds.entries[i]), "dense": bool(ds.dense[i]),
            "scale_exp": int(ds.scale_min[i])})
    for i in range(len(rs.gid)):
        groups[rs.gid[i]]["result"] = {
            "packets": int(rs.packets[i]), "duplicates": int(rs.packets[i] - rs.seqs[i]),
            "seqs": int(rs.seqs[i]), "total": int(rs.total[i]), "entries": int(rs.entries[i]),
            "gtopk": bool(rs.flags_or[i] & Flags.GTOPK), "dense": bool(rs.dense[i]),
            "scale_exp": int(rs.scale_min[i])}
    other = {k: v for k, v in cap.stats.get("by_type", {}).items()
             if PacketType[k] not in SEQUENCED_TYPES}
    return {**cap.stats, "groups": groups, "other_packets": other,
            "rounds": len({(gr["job"], gr["round"]) for gr in groups}), "partitions": len(groups)}


# --------------------------------------------------------------------------------------------------
# dosa capture verify
# --------------------------------------------------------------------------------------------------
MAX_DETAILS = 5
_SHIFT = 34  # key = gid << 34 | index: room for dense indices up to base + 359 > 2^32


@dataclass
class _Problems:
    """Mismatch details per group, collected from vectorized masks."""

    by_group: dict = field(default_factory=dict)  # gid -> {"count", "kinds", "details"}


def _add_counted(problems: _Problems, gid: np.ndarray, kind: str, rows: dict[str, np.ndarray]):
    """Record one ``kind`` problem per element of ``gid`` with per-element fields ``rows``.

    Counting is vectorized; the Python loop runs over groups and at most MAX_DETAILS details each."""
    if not len(gid):
        return
    order = np.argsort(gid, kind="stable")
    gs = gid[order]
    starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
    counts = np.diff(np.r_[starts, len(gs)])
    for s, c in zip(starts, counts):
        p = problems.by_group.setdefault(int(gs[s]), {"count": 0, "kinds": {}, "details": []})
        p["count"] += int(c)
        p["kinds"][kind] = p["kinds"].get(kind, 0) + int(c)
        for i in order[s: s + min(c, MAX_DETAILS)]:
            if len(p["details"]) < MAX_DETAILS:
                p["details"].append({"kind": kind, **{k: int(v[i]) for k, v in rows.items()}})


def _conflicting_copies(cap: DosaCapture, g: Groups, problems: _Problems) -> None:
    """A later copy of (group, sender, seq) whose bytes (other than flags) differ from the first:
    the receiver kept whichever arrived first, so the capture cannot say what was summed."""
    dup = np.flatnonzero((g.gid >= 0) & ~g.first)
    bad = []
    for r in dup:  # Python only over duplicates, which are rare
        a, b = bytearray(cap.payload(r)), bytearray(cap.payload(int(g.first_row[r])))
        a[6:8] = b[6:8] = b"\0\0"  # flags may differ (RETRANSMIT)
        if a != b:
            bad.append(r)
    bad = np.array(bad, np.int64)
    _add_counted(problems, g.gid[bad], "conflicting_copies",
                 {"worker": cap.hdr["worker_id"][bad], "seq": cap.hdr["seq"][bad],
                  "frame": cap.frame[bad], "first_frame": cap.frame[g.first_row[bad]]})


def verify(cap: DosaCapture, *, strict: bool = False) -> dict:
    """Recompute every (job, round, partition) sum from the data packets and compare with the
    result packets; see docs/capture.md for the rules. Returns the JSON report."""
    g = group(cap)
    h = cap.hdr
    ng = len(g.keys)
    drows = _rows_of(cap, DATA_TYPES)
    rrows = _rows_of(cap, RESULT_TYPES)
    ds = sender_stats(cap, g, drows)
    rs = sender_stats(cap, g, rrows)
    problems = _Problems()
    reasons: dict[int, list[str]] = {}

    # ---- completeness: every worker of the job delivered all its seqs; the result has all its seqs
    job_of = g.keys[:, 0] if ng else np.zeros(0, np.int64)
    jw = np.unique(np.stack([job_of[ds.gid], ds.sender], 1), axis=0) if len(ds.gid) \
        else np.zeros((0, 2), np.int64)
    jobs, nworkers = np.unique(jw[:, 0], return_counts=True)
    want_workers = np.zeros(ng, np.int64)
    if ng and len(jobs):
        pos = np.clip(np.searchsorted(jobs, job_of), 0, len(jobs) - 1)
        want_workers = np.where(jobs[pos] == job_of, nworkers[pos], 0)
    complete_sender = (ds.seqs == ds.total) & (ds.total == ds.total_min)
    have_workers = np.bincount(ds.gid, minlength=ng)
    done_workers = np.bincount(ds.gid, weights=complete_sender, minlength=ng).astype(np.int64)
    data_complete = (have_workers == want_workers) & (done_workers == have_workers) & (have_workers > 0)
    res_complete = np.zeros(ng, bool)
    res_complete[rs.gid] = (rs.seqs == rs.total) & (rs.total == rs.total_min)
    gtopk = np.zeros(ng, bool)
    gtopk[rs.gid] = (rs.flags_or & Flags.GTOPK) != 0
    checked = data_complete & res_complete

    for i in np.flatnonzero(~checked):  # incomplete groups: name what is missing (Python per group)
        r = reasons.setdefault(int(i), [])
        if have_workers[i] == 0:
            r.append("no data packets")
        elif have_workers[i] < want_workers[i]:
            seen = set(ds.sender[ds.gid == i].tolist())
            allw = set(jw[jw[:, 0] == job_of[i], 1].tolist())
            r.append(f"no data from worker(s) {sorted(allw - seen)}")
    for i in np.flatnonzero(~complete_sender & ~checked[ds.gid]):
        reasons.setdefault(int(ds.gid[i]), []).append(
            f"worker {ds.sender[i]}: {ds.seqs[i]} of {ds.total[i]} data packets"
            + (" (total changed)" if ds.total[i] != ds.total_min[i] else ""))
    for i in np.flatnonzero(~res_complete):
        r = reasons.setdefault(int(i), [])
        k = np.flatnonzero(rs.gid == i)
        r.append(f"result: {rs.seqs[k[0]]} of {rs.total[k[0]]} packets" if len(k) else "no result packets")

    # ---- scale: every data packet of a group and its result use one scale_exp
    dmin = np.full(ng, 1 << 30)
    dmax = np.full(ng, -(1 << 30))
    np.minimum.at(dmin, ds.gid, ds.scale_min)
    np.maximum.at(dmax, ds.gid, ds.scale_max)
    rmin = np.full(ng, 1 << 30)
    rmax = np.full(ng, -(1 << 30))
    rmin[rs.gid], rmax[rs.gid] = rs.scale_min, rs.scale_max
    bad_scale = np.flatnonzero(checked & ((dmin != dmax) | (rmin != rmax) | (rmin != dmin)))
    _add_counted(problems, bad_scale, "scale_exp",
                 {"data_min": dmin[bad_scale], "data_max": dmax[bad_scale], "result": rmin[bad_scale]})

    _conflicting_copies(cap, g, problems)
    problems.by_group = {k: v for k, v in problems.by_group.items() if checked[k]}

    # ---- the sums: int64 over the first copy of every data packet of checked groups
    epk = cap.entry_pkt
    egid = g.gid[epk]
    use = g.first[epk] & (egid >= 0)
    use &= checked[np.where(egid >= 0, egid, 0)]
    is_data = np.isin(h["type"][epk], [int(t) for t in DATA_TYPES])
    dsel = use & is_data
    dkey = (egid[dsel] << _SHIFT) | cap.entry_index[dsel]
    dval = cap.entry_value[dsel]
    o = np.argsort(dkey, kind="stable")
    dkey, dval = dkey[o], dval[o]
    st = np.flatnonzero(np.r_[True, dkey[1:] != dkey[:-1]]) if len(dkey) else np.zeros(0, np.int64)
    tkey = dkey[st]
    tsum = np.add.reduceat(dval, st) if len(st) else np.zeros(0, np.int64)

    rsel = use & ~is_data
    rkey = (egid[rsel] << _SHIFT) | cap.entry_index[rsel]
    rval = cap.entry_value[rsel]
    rsparse = _SPARSE[h["type"][epk[rsel]].astype(np.int64)]
    o = np.argsort(rkey, kind="stable")
    rkey, rval, rsparse = rkey[o], rval[o], rsparse[o]
    gidof = lambda k: k >> _SHIFT  # noqa: E731
    idxof = lambda k: k & ((1 << _SHIFT) - 1)  # noqa: E731

    dupk = np.flatnonzero(rkey[1:] == rkey[:-1]) + 1 if len(rkey) else np.zeros(0, np.int64)
    _add_counted(problems, gidof(rkey[dupk]), "duplicate_index",
                 {"index": idxof(rkey[dupk]), "got": rval[dupk]})
    pos = np.clip(np.searchsorted(tkey, rkey), 0, max(len(tkey) - 1, 0))
    found = (tkey[pos] == rkey) if len(tkey) else np.zeros(len(rkey), bool)
    expected = np.where(found, tsum[pos] if len(tsum) else 0, 0)
    wrong = np.flatnonzero(rval != expected)
    _add_counted(problems, gidof(rkey[wrong]), "wrong_value",
                 {"index": idxof(rkey[wrong]), "expected": expected[wrong], "got": rval[wrong]})
    zero = np.flatnonzero(rsparse & (rval == 0) & (expected == 0))
    _add_counted(problems, gidof(rkey[zero]), "zero_sum_entry", {"index": idxof(rkey[zero])})

    # true non-zero sums the result does not carry
    returned = np.zeros(len(tkey), bool)
    returned[pos[found]] = True
    missing = (tsum != 0) & ~returned
    tg = gidof(tkey)
    miss_sum = np.flatnonzero(missing & ~gtopk[tg]) if len(tkey) else np.zeros(0, np.int64)
    _add_counted(problems, tg[miss_sum], "missing_index",
                 {"index": idxof(tkey[miss_sum]), "expected": tsum[miss_sum]})
    # gtopk: the returned set must be the largest |sum| (ties at the boundary allowed)
    rg = gidof(rkey)
    min_ret = np.full(ng, np.iinfo(np.int64).max)
    np.minimum.at(min_ret, rg, np.abs(rval))
    miss_k = np.flatnonzero(missing & gtopk[tg]) if len(tkey) else np.zeros(0, np.int64)
    not_top = miss_k[np.abs(tsum[miss_k]) > min_ret[tg[miss_k]]]
    _add_counted(problems, tg[not_top], "not_top_k",
                 {"index": idxof(tkey[not_top]), "sum": tsum[not_top],
                  "smallest_returned": min_ret[tg[not_top]]})

    # ---- report
    def where(i):
        j, r, p = (int(x) for x in g.keys[i])
        return {"job": j, "round": r, "partition": p}

    mismatches = [{**where(i), "mode": "gtopk" if gtopk[i] else "sum", "problems": v["count"],
                   "kinds": v["kinds"], "details": v["details"]}
                  for i, v in sorted(problems.by_group.items())]
    incomplete = [{**where(i), "missing": reasons.get(int(i), [])} for i in np.flatnonzero(~checked)]
    n_checked = int(checked.sum())
    verified = n_checked - len(mismatches)
    ok = not mismatches and verified > 0 and not (strict and incomplete)
    return {"ok": bool(ok), "verified": verified, "mismatches": mismatches, "incomplete": incomplete,
            "rounds": len({tuple(g.keys[i, :2]) for i in np.flatnonzero(checked)}),
            "partitions": n_checked, "gtopk_partitions": int((checked & gtopk).sum()),
            "entries_checked": int(len(rkey)), "capture": cap.stats}
