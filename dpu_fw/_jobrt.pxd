# One job as the DPU worker's compiled code holds it (dpu_fw/_completion.pyx's table of jobs, read
# by the shadow copy's functions in dpu_fw/_shadow.pyx and the userspace merge in _softmerge.pyx).
from libc.stdint cimport int64_t, uint16_t, uint32_t

from ._results cimport Writer
from ._state cimport JobGeo

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
