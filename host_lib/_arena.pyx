# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Where a host's round keeps the result entries it took (host_lib/_engine.pyx takes them).

Result packets are decoded once, the moment they are taken, into one growing arena of (index,
value) pairs; packet (partition p, seq s) keeps where its entries start and how many there are. A
partition's result is then its packets' runs in seq order, gathered by :meth:`ResultArena.gather`
(index order: the DPU sorts a partition's result, which is checked), or written into the caller's
float32 array the moment the partition completes (:meth:`ResultArena.dense_output`), while the
round still waits for the others. A packet's entries are read only through the accessors generated
from dosa.wire (dosa/dosa_wire.h).
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

from dosa.dosa_wire cimport (DOSA_MAX_PACKETS_PER_CONTRIBUTION, dosa_dense_value,
                             dosa_sparse_offset, dosa_sparse_value)

import numpy as np

cdef enum:
    MAXPK = DOSA_MAX_PACKETS_PER_CONTRIBUTION  # result packets of one partition (seq < total)


cdef class ResultArena:
    """The entries of one round's result packets, P partitions of ``partition_size`` indices
    (``numel`` in all); slot ``p * MAXPK + seq`` is packet (p, seq). Reused round after round."""

    # (C pointers of a cdef class start NULL: __dealloc__ frees only what was allocated)
    def __init__(self, Py_ssize_t P, Py_ssize_t partition_size, Py_ssize_t numel):
        self.P, self.partition_size, self.numel = P, partition_size, numel
        self.pos = <int32_t*>malloc(P * MAXPK * sizeof(int32_t))
        self.cnt = <uint16_t*>malloc(P * MAXPK * sizeof(uint16_t))
        if not (self.pos and self.cnt):
            raise MemoryError()

    def __dealloc__(self):
        free(self.a_idx); free(self.a_val); free(self.pos); free(self.cnt)

    cdef void reset(self):
        """A new round: no entries, no dense output."""
        self.a_used = 0
        self.has_dense = False
        self.dense_obj = self.dclear_obj = self.dstart_obj = None

    cdef Py_ssize_t store(self, const uint8_t* pk, bint sparse, uint32_t count, uint32_t base,
                          Py_ssize_t slot) noexcept nogil:
        """Keep the ``count`` entries of result packet ``pk`` (checked by the caller) in ``slot``;
        a dense run's zero sums are no entries. Returns the entries kept, -1 out of memory."""
        cdef uint32_t j, m = 0
        cdef int32_t v
        cdef Py_ssize_t at = self.a_used
        if at + count > self.a_cap and not self._grow(at + count):
            return -1
        if sparse:
            for j in range(count):
                self.a_idx[at + j] = base + dosa_sparse_offset(pk, count, j)
                self.a_val[at + j] = dosa_sparse_value(pk, count, j)
            m = count
        else:
            for j in range(count):
                v = dosa_dense_value(pk, count, j)
                self.a_idx[at + m] = base + j
                self.a_val[at + m] = v
                m += v != 0
        self.a_used += m
        self.pos[slot] = <int32_t>at
        self.cnt[slot] = <uint16_t>m
        return m

    cdef int _grow(self, Py_ssize_t need) noexcept nogil:
        cdef Py_ssize_t cap = self.a_cap * 2 if self.a_cap else 1 << 16
        cdef uint32_t* ni
        cdef int32_t* nv
        while cap < need:
            cap *= 2
        if cap > 0x7FFFFFFF:
            return 0
        ni = <uint32_t*>realloc(self.a_idx, cap * sizeof(uint32_t))
        if ni == NULL:
            return 0
        self.a_idx = ni
        nv = <int32_t*>realloc(self.a_val, cap * sizeof(int32_t))
        if nv == NULL:
            return 0
        self.a_val = nv
        self.a_cap = cap
        return 1

    def dense_output(self, out, clear, int scale_exp):
        """Write every partition's result into ``out`` (float32, numel entries) the moment the
        partition completes: first ``out[i] = 0`` for the indices of ``clear`` inside it (ascending:
        what the previous round wrote there), then ``out[index] = sum * 2^-scale_exp`` for its
        entries (the float64 product rounded to float32, as host_lib.quantize.dequantize). The
        entries were checked inside their partition when they came in. For this round only."""
        out = np.asarray(out)
        if out.dtype != np.float32 or out.ndim != 1 or len(out) != self.numel or \
                not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"dense_output: out must be a writable contiguous float32 array of "
                             f"{self.numel} entries")
        clear = np.ascontiguousarray(clear, np.uint32)
        cdef const uint32_t[::1] cv = clear
        cdef Py_ssize_t i, nc = len(clear)
        cdef bint bad = False
        with nogil:  # one pass, no temporaries (this runs every round on 650k indices)
            for i in range(nc):
                if cv[i] >= <uint64_t>self.numel or (i and cv[i] <= cv[i - 1]):
                    bad = True
                    break
        if bad:
            raise ValueError("dense_output: clear must be ascending unique indices below numel")
        bounds = np.minimum(np.arange(self.P + 1, dtype=np.int64) * self.partition_size, self.numel)
        self.dense_obj, self.dclear_obj = out, clear
        self.dstart_obj = np.searchsorted(clear, bounds).astype(np.int64)
        self.dense_v = out
        self.dclear_v = clear if len(clear) else np.zeros(1, np.uint32)
        self.dstart_v = self.dstart_obj
        self.dscale = 2.0 ** -scale_exp
        self.has_dense = True

    cdef void write_dense(self, uint32_t part, Py_ssize_t total) noexcept nogil:
        """Partition ``part``'s result (its ``total`` packets) into the dense output."""
        cdef Py_ssize_t i, s, j, at, c
        cdef double f = self.dscale
        for i in range(self.dstart_v[part], self.dstart_v[part + 1]):
            self.dense_v[self.dclear_v[i]] = 0
        for s in range(total):
            at = self.pos[part * MAXPK + s]
            c = self.cnt[part * MAXPK + s]
            for j in range(c):
                self.dense_v[self.a_idx[at + j]] = <float>(<double>self.a_val[at + j] * f)

    def gather(self, Py_ssize_t lo, Py_ssize_t hi, const int64_t[::1] res_total):
        """(indices u32, sums int32) of partitions [lo, hi), each complete with ``res_total[p]``
        packets, in index order: the packets' runs in seq order (a DPU sorts a partition's
        result, which is checked; sorted here if not)."""
        cdef Py_ssize_t p, s, m = 0, k = 0, c, at, t
        cdef bint ordered = True
        for p in range(lo, hi):
            for s in range(res_total[p]):
                m += self.cnt[p * MAXPK + s]
        idx = np.empty(m, np.uint32)
        val = np.empty(m, np.int32)
        cdef uint32_t[::1] iv = idx
        cdef int32_t[::1] vv = val
        with nogil:
            for p in range(lo, hi):
                t = res_total[p]
                for s in range(t):
                    c = self.cnt[p * MAXPK + s]
                    at = self.pos[p * MAXPK + s]
                    if c:
                        memcpy(&iv[k], self.a_idx + at, c * sizeof(uint32_t))
                        memcpy(&vv[k], self.a_val + at, c * sizeof(int32_t))
                        k += c
            for k in range(1, m):
                if iv[k] <= iv[k - 1]:
                    ordered = False
                    break
        if not ordered:  # not expected from a DPU
            o = np.argsort(idx, kind="stable")
            idx, val = idx[o], val[o]
        return idx, val
