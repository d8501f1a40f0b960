# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""What a host's round may send now, and the sending (host_lib/_engine.pyx drives it).

The round's data packets are loaded partition by partition (``load``; a SparseStream loads again as
it grows) and released in order (``release``). :meth:`SendWindow.fill` sends, in partition order,
the released partitions that fit the window (``window`` partitions in flight) and whose gate is
open: partition p shares its DPU's aggregation slot with ``gate[p]`` and may go only once that
partition's result is in (docs/dataplane.md *Slots*). The packets go out through the UDP GSO send
loop of dosa/_net.pyx (``send_core``) straight from the round's buffer, in a random order when the
engine was given a seed (a test aid: reordering), and ``lose_once`` skips chosen sends (a test aid:
loss, like a dataplane's drop simulator).
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from dosa._net cimport C_SEND_CALLS, C_SEND_DGRAMS, C_SENT_BYTES, C_SENT_PACKETS, N_COUNTERS, now, send_core

import numpy as np


cdef class SendWindow:
    """The send side of a round of P partitions (see the module docstring); ``sent``, ``last_tx``
    and ``done`` are the engine's per-partition arrays, shared."""

    # (C pointers of a cdef class start NULL: __dealloc__ frees only what was allocated)
    def __init__(self, Py_ssize_t P, gate, dpu_ip_be, dpu_port_be, Py_ssize_t window, gso, counters,
                 uint64_t seed, sent, last_tx, done):
        self.P, self.window = P, window
        self.gate_v = np.ascontiguousarray(gate, np.int64)
        self.dpu_ip_v = np.ascontiguousarray(dpu_ip_be, np.uint32)
        self.dpu_port_v = np.ascontiguousarray(dpu_port_be, np.uint16)
        if self.gate_v.shape[0] != P:
            raise ValueError("gate needs one entry per partition")
        for p in range(P):
            if self.gate_v[p] >= p:
                raise ValueError("a partition's gate must come before it")
        self.ctr = counters
        self.gso = gso
        if self.ctr.shape[0] < N_COUNTERS or self.gso.shape[0] < 1:
            raise ValueError(f"counters needs the {N_COUNTERS} slots of dosa._net.COUNTERS, gso one")
        # any non-zero 64-bit state for xorshift64 (0 would stay 0)
        self.rng = ((int(seed) * 0x9E3779B97F4A7C15 + 1) & 0xFFFFFFFFFFFFFFFF) or 1 if seed else 0
        self.sent_v, self.last_tx_v, self.done_v = sent, last_tx, done
        self.load(np.zeros((0, 8), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64),
                  np.zeros(P + 1, np.int64))

    def __dealloc__(self):
        free(self.rows); free(self.rip); free(self.rport)

    cdef void reset(self, Py_ssize_t released):
        """A new round: nothing sent, partitions [0, released) released."""
        self.released = min(max(released, 0), self.P)
        self.next = self.inflight = 0

    def load(self, data, lengths, dest, pk_start):
        """The round's data packets: packet i is ``data[i, :lengths[i]]`` to DPU ``dest[i]``;
        partition p's are rows ``pk_start[p]:pk_start[p + 1]`` (a SparseStream loads again as it
        grows: rows of partitions already sent must stay where they were)."""
        data = np.ascontiguousarray(data, np.uint8)
        lengths = np.ascontiguousarray(lengths, np.int64)
        dest = np.ascontiguousarray(dest, np.int64)
        pk_start = np.ascontiguousarray(pk_start, np.int64)
        n = len(lengths)
        if data.ndim != 2 or data.shape[0] != n or len(dest) != n or len(pk_start) != self.P + 1:
            raise ValueError("load: one slot, length and destination per packet, P + 1 starts")
        if n and (lengths.min() < 0 or lengths.max() > data.shape[1] or dest.min() < 0
                  or dest.max() >= self.dpu_ip_v.shape[0]):
            raise ValueError("load: a packet is longer than its slot or goes to an unknown DPU")
        if pk_start[0] != 0 or np.any(np.diff(pk_start) < 0) or pk_start[self.P] > n:
            raise ValueError("load: pk_start must ascend from 0 within the packets")
        self.tx_data, self.tx_len, self.tx_dest, self.tx_start = data, lengths, dest, pk_start
        self.txd_v = data if data.shape[0] else np.zeros((1, max(data.shape[1], 8)), np.uint8)
        self.txl_v, self.txdest_v, self.txs_v = lengths, dest, pk_start
        self.tx_lose = np.zeros(max(n, 1), np.uint8)
        self.lose_v = self.tx_lose
        if n > self.rows_cap:
            free(self.rows); free(self.rip); free(self.rport)
            self.rows = <int64_t*>malloc(n * sizeof(int64_t))
            self.rip = <uint32_t*>malloc(n * sizeof(uint32_t))
            self.rport = <uint16_t*>malloc(n * sizeof(uint16_t))
            if not (self.rows and self.rip and self.rport):
                self.rows_cap = 0
                raise MemoryError()
            self.rows_cap = n

    def lose_once(self, rows):
        """The next send of each packet row in ``rows`` is skipped, as if the wire had lost it;
        later sends (retransmissions) go out."""
        r = np.asarray(rows, np.int64)
        if len(r) and (r.min() < 0 or r.max() >= len(self.tx_len)):
            raise ValueError("lose_once: rows outside the loaded packets")
        self.tx_lose[r] = 1

    def release(self, Py_ssize_t upto):
        """Partitions [0, upto) may be sent (a SparseStream hands them over in order)."""
        if upto < self.released or upto > self.P:
            raise ValueError(f"release: {upto} is outside {self.released}..{self.P}")
        self.released = upto

    cdef void partition_done(self, Py_ssize_t part) noexcept nogil:
        """Partition ``part``'s result is in: a sent one leaves the window."""
        if self.sent_v[part]:
            self.inflight -= 1

    cdef int fill(self, int fd, bint* gso_off) noexcept nogil:
        """Send the partitions the window and the slots allow; 0 or an errno (-1: the socket stayed
        full for 2 s). ``gso_off`` set when the path refused GSO in this call."""
        cdef Py_ssize_t lo = self.next, hi, p, g
        cdef int err
        cdef double t
        if self.inflight >= self.window or lo >= self.released:
            return 0
        hi = lo + (self.window - self.inflight)
        if hi > self.released:
            hi = self.released
        for p in range(lo, hi):
            g = self.gate_v[p]
            if g >= 0 and not self.done_v[g]:
                hi = p  # in order: stop at the first partition whose slot is still held
                break
        if hi <= lo:
            return 0
        err = self._send_rows(fd, self.txs_v[lo], self.txs_v[hi], gso_off)
        if err:
            return err
        t = now()
        for p in range(lo, hi):
            self.sent_v[p] = 1
            self.last_tx_v[p] = t
            if not self.done_v[p]:
                self.inflight += 1
        self.next = hi
        return 0

    cdef int _send_rows(self, int fd, Py_ssize_t r0, Py_ssize_t r1, bint* gso_off) noexcept nogil:
        """Send packets r0..r1-1 (in a random order with ``rng``)."""
        cdef Py_ssize_t n = r1 - r0, k, j, done_n = 0
        cdef int64_t t
        cdef int err = 0
        cdef bint had_gso
        cdef uint64_t x
        if n <= 0:
            return 0
        k = 0
        for j in range(r0, r1):
            if self.lose_v[j]:
                self.lose_v[j] = 0  # lose_once: this send of it is "lost"
                continue
            self.rows[k] = j
            k += 1
        n = k
        if self.rng:
            for k in range(n - 1, 0, -1):  # Fisher-Yates with xorshift64
                x = self.rng
                x ^= x << 13
                x ^= x >> 7
                x ^= x << 17
                self.rng = x
                j = <Py_ssize_t>(x % <uint64_t>(k + 1))
                t = self.rows[k]
                self.rows[k] = self.rows[j]
                self.rows[j] = t
        for k in range(n):
            self.rip[k] = self.dpu_ip_v[self.txdest_v[self.rows[k]]]
            self.rport[k] = self.dpu_port_v[self.txdest_v[self.rows[k]]]
        had_gso = self.gso[0] > 1
        done_n = send_core(fd, &self.txd_v[0, 0], self.txd_v.shape[1], &self.txl_v[0], self.rows,
                           n, self.rip, self.rport, 2.0, &self.gso[0], &self.ctr[C_SEND_CALLS],
                           &self.ctr[C_SEND_DGRAMS], &err)
        if had_gso and self.gso[0] <= 1:
            gso_off[0] = True
        if not err and done_n < n:
            err = -1
        for k in range(done_n):
            self.ctr[C_SENT_BYTES] += self.txl_v[self.rows[k]]
        self.ctr[C_SENT_PACKETS] += done_n
        return err
