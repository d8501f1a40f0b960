# The shadow copy of a completed buffer (dpu_fw/_shadow.pyx), for the completion path.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from ._jobrt cimport JobRt
from ._state cimport dosa_buf

cdef void settle(JobRt* j, uint32_t slot, uint64_t gen) noexcept nogil
cdef Py_ssize_t entries(JobRt* j, dosa_buf* b, uint64_t touched, uint32_t lo, uint32_t n,
                        uint32_t local, uint32_t* oi, int32_t* ov, uint32_t* ri, int32_t* rv,
                        Py_ssize_t* m_all, uint64_t* bits, int64_t* topk_scratch) noexcept nogil
cdef void compact(JobRt* j, dosa_buf* b, uint64_t* touched, uint32_t lo,
                  const uint32_t* ri, const int32_t* rv, Py_ssize_t m,
                  const uint32_t* oi, Py_ssize_t m_all) noexcept nogil
cdef object rebuild(JobRt* j, uint32_t local, uint32_t rnd, Py_ssize_t stride, uint64_t* bits,
                    int64_t* topk_scratch)
cdef bint needs_scan(JobRt* j, uint32_t shard, uint32_t shards) noexcept nogil
