# The DPU worker's compiled completion path (dpu_fw/_completion.pyx), declared for the userspace
# merge (dpu_fw/_softmerge.pyx), which hands it the completions it finds.
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from ._jobrt cimport MAX_JOBS, N_STATS, JobRt
from ._ring cimport RingView
from ._state cimport dosa_buf, dosa_completion, dosa_settings

cdef class CompletionEngine:
    cdef JobRt jobs[MAX_JOBS]
    cdef dict _keep
    cdef int sock_fd
    cdef int64_t* counters
    cdef int64_t* gso
    cdef object _counters_ref, _gso_ref
    # the ring of this shard (XDP mode)
    cdef int ring_fd
    cdef RingView ring
    cdef dosa_settings* settings
    cdef int shard
    cdef object _ring_ref, _settings_ref
    # scratch of one completion and the arena of result packets waiting to be sent
    cdef uint32_t* oi
    cdef int32_t* ov
    cdef uint32_t* ri
    cdef int32_t* rv
    cdef int64_t* topk_scratch
    cdef uint64_t* bits
    cdef uint8_t* arena
    cdef int64_t* lengths
    cdef int16_t* pkjob
    cdef Py_ssize_t cap, used, stride
    cdef int64_t* send_rows
    cdef uint32_t* send_ip
    cdef uint16_t* send_port
    cdef Py_ssize_t send_cap
    # completions of jobs not in the table, for Python to park
    cdef dosa_completion* unknown
    cdef Py_ssize_t nunknown, unknown_cap
    cdef public double send_timeout
    # nanoseconds spent in each part (dosa bench dpu, docs/dpu_worker.md)
    cdef public int64_t ns_settle, ns_build, ns_send, completions
    cdef public int clock


    cdef int _find(self, uint32_t job_id) noexcept nogil
    cdef bint _room(self, Py_ssize_t npk) noexcept nogil
    cdef bint _send_space(self, Py_ssize_t n) noexcept nogil
    cdef Py_ssize_t _drain(self) noexcept nogil
    cdef void complete_one(self, uint32_t job_id, uint32_t partition, uint32_t rnd,
                           int8_t scale) noexcept nogil
    cdef int flush(self) noexcept nogil
