# The completion path's kernels (dpu_fw/_results.pyx), for the engine that runs them per completion
# (dpu_fw/_completion.pyx): a completed buffer's non-zero sums, gtopk's selection, and the result
# packets, each a nogil function on raw pointers.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef enum:
    BITMAP_WORDS = 1024  # a 65536-bit scratch bitmap: one bit per u16 offset of a buffer

cdef struct Writer:
    # what every result packet of one (job, round) shares, and the job's packet sizes
    uint32_t job_id
    uint32_t rnd
    int scale_exp
    uint16_t flags
    Py_ssize_t per_sparse    # entries a SPARSE_RESULT packet carries at the job's MTU
    Py_ssize_t per_dense     # values a DENSE_RESULT packet carries
    Py_ssize_t stride        # bytes between packet rows

cdef Py_ssize_t extract(const int32_t* sums, Py_ssize_t n, const uint16_t* lst, uint64_t count,
                        uint32_t list_cap, uint64_t* bits, uint32_t lo, uint32_t* oi,
                        int32_t* ov) noexcept nogil
cdef Py_ssize_t top_k(uint32_t* oi, int32_t* ov, Py_ssize_t n, Py_ssize_t k,
                      int64_t* scratch) noexcept nogil
cdef Py_ssize_t packets_for(Py_ssize_t count, Py_ssize_t span, const Writer* w,
                            bint* dense) noexcept nogil
cdef void write_results(uint8_t* rows, int64_t* lengths, const Writer* w, uint32_t partition,
                        uint32_t lo, const uint32_t* oi, const int32_t* ov, Py_ssize_t n,
                        Py_ssize_t npk, bint dense) noexcept nogil
