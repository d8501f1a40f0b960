# The result arena of a host's round (host_lib/_arena.pyx), cimported by its engine (_engine.pyx).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t


cdef class ResultArena:
    cdef readonly Py_ssize_t P, partition_size, numel
    # packet (p, seq)'s entries are at pos[slot], cnt[slot] of them (slot = p * MAXPK + seq)
    cdef uint32_t* a_idx
    cdef int32_t* a_val
    cdef Py_ssize_t a_cap, a_used
    cdef int32_t* pos
    cdef uint16_t* cnt
    # the round's dense output, written partition by partition as they complete (dense_output)
    cdef object dense_obj, dclear_obj, dstart_obj
    cdef float[::1] dense_v
    cdef const uint32_t[::1] dclear_v
    cdef int64_t[::1] dstart_v
    cdef readonly bint has_dense
    cdef double dscale

    cdef void reset(self)
    cdef Py_ssize_t store(self, const uint8_t* pk, bint sparse, uint32_t count, uint32_t base,
                          Py_ssize_t slot) noexcept nogil
    cdef void write_dense(self, uint32_t part, Py_ssize_t total) noexcept nogil
    cdef int _grow(self, Py_ssize_t need) noexcept nogil
