"""UDP payloads of a capture -> validated dosa packets and their entries, flattened (vectorized).

Packets are recognised as dosa by their magic (and, with ``port``, by UDP source or destination
port), not by a fixed port, since every deployment may configure its own. Headers are checked by
the one validator, :func:`dosa.wire.header_verdicts`. See docs/capture.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dosa import wire
from dosa.capture_pcap import _be16, _be32, read_frames, udp_payloads
from dosa.errors import DosaError
from dosa.wire import HDR_LEN, HEADER_DTYPE, PacketType

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

_SEQUENCED = np.zeros(256, bool)
_SPARSE = np.zeros(256, bool)
_DENSE = np.zeros(256, bool)
_SEQUENCED[list(SEQUENCED_TYPES)] = True
_SPARSE[list(SPARSE_TYPES)] = True
_DENSE[list(DENSE_TYPES)] = True


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


def _entries(buf, hdr, start, rows, sparse: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packet row, absolute index, value) of every entry of packets ``rows``, all sparse (u16
    offsets from base, then the s32 values at wire.value_offset) or all dense (s32 values of
    base + position)."""
    counts = hdr["count"][rows].astype(np.int64)
    pkt = np.repeat(rows, counts)
    pos = np.arange(len(pkt)) - np.repeat(np.cumsum(counts) - counts, counts)
    base = hdr["base"][pkt].astype(np.int64)
    if sparse:
        index = base + _be16(buf, start[pkt] + HDR_LEN + 2 * pos)
        value = _words(buf, start[pkt] + wire.value_offset(counts[np.searchsorted(rows, pkt)]) + 4 * pos)
    else:
        index, value = base + pos, _words(buf, start[pkt] + HDR_LEN + 4 * pos)
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
    code = wire.header_verdicts(hdr, length)
    old = (hdr["version"] < wire.VERSION) & (hdr["magic"] == wire.MAGIC)
    if old.any() and not (code == 0).any():
        raise DosaError(f"{path} holds dosa protocol v{int(hdr['version'][old].max())} packets "
                        f"({int(old.sum())} of them) and none of v{wire.VERSION}, the only version this "
                        "dosa reads (v1's 8-byte absolute entries became v2's 6-byte partition-relative "
                        "ones): read it with a dosa from before protocol v2")
    stats["malformed"] = int((code != 0).sum())
    by_reason: dict[str, int] = {}
    for c, n in zip(*np.unique(code, return_counts=True)):
        if c:
            by_reason[wire.RULE_REASONS[c]] = by_reason.get(wire.RULE_REASONS[c], 0) + int(n)
    stats["malformed_by_reason"] = by_reason
    ok = code == 0
    hdr = hdr[ok].astype(NATIVE_HDR)
    start, length, frame = start[ok], length[ok], frame[ok]
    stats["dosa_packets"] = len(hdr)
    stats["by_type"] = {PacketType(t).name: int(n)
                        for t, n in zip(*np.unique(hdr["type"], return_counts=True))}

    t = hdr["type"].astype(np.int64)
    parts = [_entries(buf, hdr, start, np.flatnonzero(_SPARSE[t]), True),
             _entries(buf, hdr, start, np.flatnonzero(_DENSE[t]), False)]
    entry_pkt, entry_index, entry_value = (np.concatenate(x) for x in zip(*parts))
    return DosaCapture(hdr, frame, start, length, buf, entry_pkt, entry_index, entry_value, stats)
