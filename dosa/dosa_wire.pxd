# GENERATED from dosa/wire.py by `python -m dosa.gen_headers`; do not edit
# (tests/unit/test_wire_c_header.py fails when this file and wire.py differ). The Cython
# view of dosa/dosa_wire.h: cimport from here (dosa.dosa_wire), never declare by hand.
from libc.stdint cimport int32_t, uint8_t, uint32_t

cdef extern from "dosa_wire.h" nogil:
    enum:
        DOSA_VERSION
        DOSA_HDR_LEN
        DOSA_SPARSE_ENTRY_LEN
        DOSA_DENSE_ENTRY_LEN
        DOSA_RETX_ENTRY_LEN
        DOSA_STATUS_ENTRY_LEN
        DOSA_MAX_SPARSE_ENTRIES
        DOSA_MAX_DENSE_ENTRIES
        DOSA_MAX_RETX_ENTRIES
        DOSA_MAX_MTU
        DOSA_RX_MAX_SPARSE_ENTRIES
        DOSA_RX_MAX_DENSE_ENTRIES
        DOSA_MAX_PARTITION_SIZE
        DOSA_MAX_PACKETS_PER_CONTRIBUTION
        DOSA_MAX_WORKERS
        DOSA_MAX_PARTITIONS
        DOSA_DPU_SENDER_ID
        DOSA_SCALE_EXP_MIN
        DOSA_SCALE_EXP_MAX
        DOSA_T_SPARSE_DATA
        DOSA_T_DENSE_DATA
        DOSA_T_SPARSE_RESULT
        DOSA_T_DENSE_RESULT
        DOSA_T_RETX_REQUEST
        DOSA_T_HEARTBEAT
        DOSA_T_STATUS
        DOSA_F_LAST
        DOSA_F_RETRANSMIT
        DOSA_F_GTOPK
        DOSA_F_VALID_MASK
        DOSA_C_SHORT_PACKET
        DOSA_C_BAD_MAGIC
        DOSA_C_BAD_VERSION
        DOSA_C_BAD_TYPE
        DOSA_C_COUNT_MISMATCH
        DOSA_C_BAD_FIELD
        DOSA_C_UNKNOWN_JOB
        DOSA_C_UNKNOWN_WORKER
        DOSA_C_BAD_SOURCE
        DOSA_C_NOT_OWNER
        DOSA_C_INDEX_OUT_OF_PARTITION
        DOSA_C_ROUND_TOO_OLD
        DOSA_C_ROUND_TOO_NEW
        DOSA_C_DUPLICATE
        DOSA_C_SCALE_MISMATCH
        DOSA_C_TOTAL_MISMATCH
        DOSA_C_IP_FRAGMENT
        DOSA_C_INTERNAL
        DOSA_C_WRONG_SHARD
        DOSA_C_MERGED
        DOSA_C_PASS_NOT_DOSA
        DOSA_C_PASS_CONTROL
        DOSA_C_PASS_DUP_OF_COMPLETE
        DOSA_C_MERGED_ENTRIES
        DOSA_C_COMPLETIONS
        DOSA_C_COMPLETION_LOST
        DOSA_C_SATURATED_SUMS
        DOSA_NUM_COUNTERS
    const uint32_t DOSA_MAGIC
    const uint32_t DOSA_MAX_SPARSE_BASE

    struct dosa_hdr:
        pass

    int dosa_check_header(const dosa_hdr *h, uint32_t plen)
    uint32_t dosa_value_offset "DOSA_VALUE_OFFSET" (uint32_t count)
    uint32_t dosa_type_ok(uint32_t type)
    uint32_t dosa_sequenced(uint32_t type)
    uint32_t dosa_sparse(uint32_t type)
    uint32_t dosa_dense(uint32_t type)
    uint32_t dosa_entry_len(uint32_t type)
    uint32_t dosa_odd_pad(uint32_t type)
    uint32_t dosa_max_entries(uint32_t type)
    uint32_t dosa_hdr_magic(const uint8_t *pk)
    uint32_t dosa_hdr_version(const uint8_t *pk)
    uint32_t dosa_hdr_type(const uint8_t *pk)
    uint32_t dosa_hdr_flags(const uint8_t *pk)
    uint32_t dosa_hdr_job_id(const uint8_t *pk)
    uint32_t dosa_hdr_worker_id(const uint8_t *pk)
    uint32_t dosa_hdr_partition(const uint8_t *pk)
    uint32_t dosa_hdr_round(const uint8_t *pk)
    uint32_t dosa_hdr_seq(const uint8_t *pk)
    uint32_t dosa_hdr_count(const uint8_t *pk)
    uint32_t dosa_hdr_total(const uint8_t *pk)
    int32_t dosa_hdr_scale_exp(const uint8_t *pk)
    uint32_t dosa_hdr_reserved(const uint8_t *pk)
    uint32_t dosa_hdr_base(const uint8_t *pk)
    uint32_t dosa_sparse_offset(const uint8_t *pk, uint32_t count, uint32_t j)
    void dosa_put_sparse_offset(uint8_t *pk, uint32_t count, uint32_t j, uint32_t v)
    int32_t dosa_sparse_value(const uint8_t *pk, uint32_t count, uint32_t j)
    void dosa_put_sparse_value(uint8_t *pk, uint32_t count, uint32_t j, int32_t v)
    void dosa_put_sparse_pad(uint8_t *pk, uint32_t count)
    int32_t dosa_dense_value(const uint8_t *pk, uint32_t count, uint32_t j)
    void dosa_put_dense_value(uint8_t *pk, uint32_t count, uint32_t j, int32_t v)
    uint32_t dosa_retx_seq(const uint8_t *pk, uint32_t count, uint32_t j)
    void dosa_put_retx_seq(uint8_t *pk, uint32_t count, uint32_t j, uint32_t v)
    uint32_t dosa_status_worker_id(const uint8_t *pk, uint32_t count, uint32_t j)
    void dosa_put_status_worker_id(uint8_t *pk, uint32_t count, uint32_t j, uint32_t v)
