# The DPU worker's compiled completion path (dpu_fw/_completion.pyx), declared for the userspace
# merge (dpu_fw/_softmerge.pyx), which hands it the completions it finds.
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from ._results cimport Writer
from ._state cimport JobGeo, dosa_buf, dosa_completion, dosa_settings

cdef enum:
    MAX_JOBS = 64
    # a job's counters in the engine, in this order (ENGINE_STATS in the .pyx names them)
    S_COMPLETIONS = 0, S_RESULT_PACKETS, S_RESULT_ENTRIES, S_COMPLETION_UNKNOWN, S_SETTLED, \
        S_SEND_ERRORS, S_PACKET_LIMIT, N_STATS

cdef struct JobRt:
    JobGeo g
    bint used
    bint gtopk
    const int64_t* k          # gtopk: k of each owned partition (local index)
    Py_ssize_t nhosts
    const uint32_t* host_ip   # network order
    const uint16_t* host_port
    bint group                # results go to the job's multicast group (else fan-out to hosts)
    uint32_t group_ip
    uint16_t group_port
    double* emitted           # per slot * 2 + parity: when its result was last fanned out
    int64_t max_key           # latest round * num_owned + local completed here (NACK evidence)
    int64_t stats[N_STATS]
    Writer w

cdef class CompletionEngine:
    cdef JobRt jobs[MAX_JOBS]
    cdef dict _keep
    cdef int sock_fd
    cdef int64_t* counters
    cdef int64_t* gso
    cdef object _counters_ref, _gso_ref
    # the ring of this shard (XDP mode)
    cdef int ring_fd
    cdef uint64_t* cons
    cdef const uint64_t* prod
    cdef const uint8_t* data
    cdef uint64_t mask
    cdef uint64_t next_cons
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
    cdef void _settle(self, JobRt* j, uint32_t slot, uint64_t gen) noexcept nogil
    cdef bint _room(self, Py_ssize_t npk) noexcept nogil
    cdef bint _send_space(self, Py_ssize_t n) noexcept nogil
    cdef Py_ssize_t _read_ring(self, dosa_completion* out, Py_ssize_t limit) noexcept nogil
    cdef Py_ssize_t _drain(self) noexcept nogil
    cdef Py_ssize_t _entries(self, JobRt* j, dosa_buf* b, uint64_t touched, uint32_t lo, uint32_t n,
                             uint32_t local, uint32_t* oi, int32_t* ov, uint32_t* ri, int32_t* rv,
                             Py_ssize_t* m_all) noexcept nogil
    cdef void _compact(self, JobRt* j, dosa_buf* b, uint64_t* touched, uint32_t lo,
                       const uint32_t* ri, const int32_t* rv, Py_ssize_t m,
                       const uint32_t* oi, Py_ssize_t m_all) noexcept nogil
    cdef void complete_one(self, uint32_t job_id, uint32_t partition, uint32_t rnd,
                           int8_t scale) noexcept nogil
    cdef int flush(self) noexcept nogil
