"""Capture files -> frames -> IPv4/UDP payloads, vectorized: the one pcap/pcapng reader of the project.

Why not scapy's PcapReader: it builds a Python object per packet (~50 us each), so a capture of one
training run (10^5..10^6 packets) would take minutes. Here the file is read once into a numpy buffer;
only the walk over the record headers is a Python loop (a few hundred ns a record); Ethernet / SLL /
raw IPv4 / UDP decoding is vectorized over the whole capture. pcapng files go through scapy's raw
reader (bytes only, no dissection) and then the same path. Knows nothing of dosa.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dosa.errors import DosaError

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
