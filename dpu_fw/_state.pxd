# The C view of the DPU's state for the worker's compiled code: the structs of
# dataplane/dosa_state.h (the same header the XDP program includes, so the layouts cannot drift),
# the wire header of dosa/dosa_wire.h, and the geometry of one job as the compiled code reads it.
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "dosa_wire.h":
    struct dosa_hdr:
        uint32_t magic
        uint8_t version
        uint8_t type
        uint16_t flags
        uint32_t job_id
        uint16_t worker_id
        uint16_t partition
        uint32_t round
        uint16_t seq
        uint16_t count
        uint16_t total
        int8_t scale_exp
        uint8_t reserved
        uint32_t base
    int dosa_check_header(const dosa_hdr* h, uint32_t plen) nogil
    enum:
        DOSA_HDR_LEN, DOSA_MAGIC, DOSA_VERSION, DOSA_DPU_SENDER_ID, DOSA_MAX_PACKETS_PER_CONTRIBUTION
        DOSA_T_SPARSE_DATA, DOSA_T_DENSE_DATA, DOSA_T_SPARSE_RESULT, DOSA_T_DENSE_RESULT
        DOSA_T_RETX_REQUEST, DOSA_T_HEARTBEAT, DOSA_T_STATUS
        DOSA_F_LAST, DOSA_F_GTOPK
        DOSA_RX_MAX_SPARSE_ENTRIES, DOSA_RX_MAX_DENSE_ENTRIES, DOSA_MAX_PARTITION_SIZE
    enum:  # enum dosa_counter (dosa/counters.py)
        DOSA_C_SHORT_PACKET, DOSA_C_BAD_TYPE, DOSA_C_UNKNOWN_JOB, DOSA_C_UNKNOWN_WORKER
        DOSA_C_BAD_SOURCE, DOSA_C_NOT_OWNER, DOSA_C_INDEX_OUT_OF_PARTITION, DOSA_C_ROUND_TOO_OLD
        DOSA_C_ROUND_TOO_NEW, DOSA_C_DUPLICATE, DOSA_C_SCALE_MISMATCH, DOSA_C_TOTAL_MISMATCH
        DOSA_C_INTERNAL, DOSA_C_BAD_FIELD, DOSA_C_MERGED, DOSA_C_PASS_CONTROL, DOSA_C_WRONG_SHARD
        DOSA_C_PASS_DUP_OF_COMPLETE, DOSA_C_MERGED_ENTRIES, DOSA_C_COMPLETIONS, DOSA_C_SATURATED_SUMS
        DOSA_NUM_COUNTERS
    uint16_t dosa_ntohs(uint16_t x) nogil
    uint32_t dosa_ntohl(uint32_t x) nogil
    uint16_t dosa_htons(uint16_t x) nogil

cdef extern from "dosa_state.h":
    enum:
        DOSA_BUF_SUMS, DOSA_LIST_WORDS, DOSA_MAX_SHARDS, DOSA_SCALE_TAG_BIAS
    uint64_t DOSA_TOUCHED_SORTED, DOSA_TOUCHED_WRITING, DOSA_TOUCHED_COMPACT, DOSA_TOUCHED_ZEROED
    struct dosa_pstate:
        uint64_t base_gen
        uint64_t workers_done[2]
        uint64_t scale_tag[2]
        uint64_t touched[2]
    struct dosa_wstate:
        uint64_t seen[4]
        uint64_t received
        uint64_t total
    struct dosa_buf:
        int32_t sums[1]   # DOSA_BUF_SUMS of them
        uint64_t list[1]  # DOSA_LIST_WORDS of them
    struct dosa_completion:
        uint32_t job_id
        uint32_t round
        uint16_t partition
        int8_t scale_exp
    struct dosa_settings:
        uint32_t shards
        uint64_t asleep[1]  # DOSA_MAX_SHARDS of them

cdef enum:
    SUM_LIMIT = 2147483647  # sums saturate at +-(2^31 - 1) (dataplane/layout.py SUM_LIMIT)

# One job on this DPU as the compiled code sees it: its geometry (dataplane.maps.JobInfo) and
# where its state lies. ``bufs`` is its first pool buffer, ``ps`` its first slot state, ``ws`` its
# first worker state: in XDP mode inside the dataplane's pinned maps, in userspace mode in the
# worker's own memory laid out the same way.
cdef struct JobGeo:
    uint32_t job_id
    uint32_t workers, partition_size, numel, num_partitions, dpu_index, num_dpus, num_owned
    uint32_t slots, stride, list_cap
    dosa_buf* bufs
    dosa_pstate* ps
    dosa_wstate* ws

cdef inline uint64_t occupant(const JobGeo* j, uint32_t local, uint32_t rnd, uint32_t* slot) noexcept nogil:
    """Slot and occupant number (generation) of the job's owned partition ``local`` in round
    ``rnd`` (docs/dataplane.md *Slots*; dosa_xdp.c locate() computes the same)."""
    cdef uint32_t s = local % j.slots
    cdef uint64_t per_round = (j.num_owned - s + j.slots - 1) // j.slots
    slot[0] = s
    return <uint64_t>rnd * per_round + local // j.slots
