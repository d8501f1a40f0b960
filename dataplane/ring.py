"""A BPF ring buffer (BPF_MAP_TYPE_RINGBUF) read through its mmap, without libbpf.

The kernel maps a ring buffer map as one read-write page holding the consumer position, then one
read-only page holding the producer position, then the data area mapped twice in a row (so a record
never wraps in the mapping). A record is an 8-byte header (u32 length with a BUSY and a DISCARD bit,
u32 page offset) and its payload, padded to 8 bytes. libbpf's ring_buffer__consume walks the same
layout but calls back once per record and advances the consumer position as it goes; here records
are read in bulk (``read``) and the position is advanced only on ``commit``, so a DPU worker that
dies between reading and handling a batch finds it again when it restarts. The DPU worker's
compiled completion path reads the same mapping through ``addresses()``.
"""
from __future__ import annotations

import mmap
import select

import numpy as np

from . import layout, libbpf

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HEADER = 8
PAGE = mmap.PAGESIZE


def wait_readable(fds: list[int], timeout_ms: int) -> bool:
    """Block until one of ``fds`` polls readable or ``timeout_ms`` passed."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout_ms))))


class Ring:
    """One ring buffer map, mapped. ``fd`` polls readable while records wait (when the producer
    asked for a wakeup)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.size = libbpf.map_info(fd).max_entries
        self._cons_mm = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._data_mm = mmap.mmap(fd, PAGE + 2 * self.size, mmap.MAP_SHARED, mmap.PROT_READ, offset=PAGE)
        self._cons = np.frombuffer(self._cons_mm, np.uint64, count=1)
        self._prod = np.frombuffer(self._data_mm, np.uint64, count=1)
        self._data = np.frombuffer(self._data_mm, np.uint8)[PAGE:]
        self._next: int | None = None

    def addresses(self) -> tuple[int, int, int, int]:
        """(address of the consumer position, of the producer position, of the data area, data
        size): what a compiled reader needs. Valid while this Ring is open."""
        return (self._cons.ctypes.data, self._prod.ctypes.data, self._data.ctypes.data, self.size)

    def read(self, limit: int = 1 << 20) -> np.ndarray:
        """Up to ``limit`` committed records (layout.COMPLETION_DTYPE) after the consumer
        position, not consumed until ``commit()``; a second read without a commit reads on."""
        cons = int(self._cons[0]) if self._next is None else self._next
        prod = int(self._prod[0])
        recs = []
        mask = self.size - 1
        while cons < prod and len(recs) < limit:
            off = cons & mask
            length = int(self._data[off:off + 4].view(np.uint32)[0])
            if length & BUSY_BIT:
                break  # reserved, not yet submitted: later records wait for it
            n = length & ~(BUSY_BIT | DISCARD_BIT)
            if not length & DISCARD_BIT and n >= layout.COMPLETION_DTYPE.itemsize:
                recs.append(self._data[off + HEADER:off + HEADER + layout.COMPLETION_DTYPE.itemsize])
            cons += (HEADER + n + 7) & ~7
        self._next = cons
        if not recs:
            return np.zeros(0, layout.COMPLETION_DTYPE)
        return np.concatenate(recs).view(layout.COMPLETION_DTYPE)

    def commit(self) -> None:
        """Consume everything read so far: the producer may reuse its space."""
        if self._next is not None:
            self._cons[0] = self._next
            self._next = None

    def pending(self) -> bool:
        """Records (or a reservation) wait after the consumer position."""
        return int(self._prod[0]) > int(self._cons[0])

    def close(self) -> None:
        self._cons = self._prod = self._data = None
        for mm in (self._cons_mm, self._data_mm):
            try:
                mm.close()
            except BufferError:
                pass  # a compiled reader still holds a view; the mapping goes with it
