# cython: language_level=3
"""The compiled part of host_lib/round.py: taking a received batch's result packets into a round's
state (``Round._absorb``) in one pass over the headers, instead of ~60 numpy calls and the header
rules evaluated rule by rule per batch (12 ms of a host's 48 ms round at 25M entries, 1%).

The header rules are the XDP program's: ``dosa_check_header`` of dosa/dosa_wire.h, generated from
dosa.wire.HEADER_RULES (tests/unit/test_wire_c_header.py runs that C against the Python rules;
tests/unit/test_round_absorb.py runs this pass against the numpy one it replaced).
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t

cdef extern from *:
    """
    /* The counters dosa_check_header names (dataplane/reasons.py's enum, whose values only the
     * dataplane needs: here a header is valid or not). A rule reason added to dosa.wire without a
     * name here fails this build, it cannot pass unchecked. */
    enum { DOSA_C_SHORT_PACKET = 1, DOSA_C_BAD_MAGIC, DOSA_C_BAD_VERSION, DOSA_C_BAD_TYPE,
           DOSA_C_COUNT_MISMATCH, DOSA_C_BAD_FIELD };
    #include "dosa_wire.h"

    typedef struct {
        uint32_t job_id, round;
        uint16_t worker_id, partition, seq, total;
        int scale_exp, type;
    } dosa_fields;

    static inline int dosa_check_bytes(const void *p, uint32_t plen)
    {
        return dosa_check_header((const struct dosa_hdr *)p, plen);
    }

    static inline void dosa_read_fields(const void *p, dosa_fields *f)
    {
        const struct dosa_hdr *h = (const struct dosa_hdr *)p;
        f->job_id = dosa_ntohl(h->job_id);
        f->round = dosa_ntohl(h->round);
        f->worker_id = dosa_ntohs(h->worker_id);
        f->partition = dosa_ntohs(h->partition);
        f->seq = dosa_ntohs(h->seq);
        f->total = dosa_ntohs(h->total);
        f->scale_exp = h->scale_exp;
        f->type = h->type;
    }
    """
    ctypedef struct dosa_fields:
        uint32_t job_id
        uint32_t round
        uint16_t worker_id
        uint16_t partition
        uint16_t seq
        uint16_t total
        int scale_exp
        int type
    int dosa_check_bytes(const void *p, uint32_t plen) nogil
    void dosa_read_fields(const void *p, dosa_fields *f) nogil
    int DOSA_T_SPARSE_RESULT, DOSA_T_DENSE_RESULT, DOSA_T_STATUS, DOSA_HDR_LEN
    int DOSA_DPU_SENDER_ID, DOSA_MAX_PACKETS_PER_CONTRIBUTION


def absorb(const uint8_t[:, ::1] data, const int64_t[::1] lengths, Py_ssize_t n,
           uint32_t job_id, uint32_t round, Py_ssize_t P, int scale_exp,
           uint8_t[:, ::1] got, uint8_t[::1] done, int64_t[::1] res_total, int64_t[::1] res_got,
           int64_t[::1] new_rows, int64_t[::1] new_keys, int64_t[::1] status_rows,
           int64_t[::1] completed):
    """Take packets ``0..n-1`` of a receive buffer into a round's state, in arrival order.

    A packet is this round's when it comes from a DPU (worker_id DPU_SENDER_ID) for job ``job_id``,
    round ``round`` and a partition below ``P``. Of those, STATUS packets go to ``status_rows``
    (parsed by the caller); result packets (SPARSE_RESULT, DENSE_RESULT) of scale ``scale_exp``
    whose header keeps every rule of dosa.wire and whose (partition, seq) is new (not ``got``, the
    partition not ``done``, not already taken from this batch) are taken: ``got`` set,
    ``res_total[p]`` = their total, ``res_got[p]`` counted, their rows and keys (partition *
    MAX_PACKETS_PER_CONTRIBUTION + seq) written to ``new_rows``/``new_keys``; a partition whose
    count reaches its total is marked ``done`` and listed in ``completed``. Every output array holds
    at least ``n``. Returns (taken, statuses, completed)."""
    cdef Py_ssize_t i, nn = 0, ns = 0, nc = 0, stride = data.shape[1]
    cdef dosa_fields f
    cdef int64_t length
    if n > data.shape[0] or n > lengths.shape[0] or n > new_rows.shape[0] or n > new_keys.shape[0] \
            or n > status_rows.shape[0] or n > completed.shape[0]:
        raise ValueError("absorb: output arrays shorter than the batch")
    if P > got.shape[0] or P > done.shape[0] or P > res_total.shape[0] or P > res_got.shape[0] \
            or got.shape[1] < DOSA_MAX_PACKETS_PER_CONTRIBUTION:
        raise ValueError("absorb: state arrays smaller than the round's partitions")
    if stride < DOSA_HDR_LEN:
        return 0, 0, 0
    with nogil:
        for i in range(n):
            length = lengths[i]
            if length < DOSA_HDR_LEN or length > stride:
                continue
            dosa_read_fields(&data[i, 0], &f)
            if f.job_id != job_id or f.round != round or f.partition >= P \
                    or f.worker_id != DOSA_DPU_SENDER_ID:
                continue
            if f.type == DOSA_T_STATUS:
                status_rows[ns] = i
                ns += 1
                continue
            if (f.type != DOSA_T_SPARSE_RESULT and f.type != DOSA_T_DENSE_RESULT) \
                    or f.scale_exp != scale_exp:
                continue
            if dosa_check_bytes(&data[i, 0], <uint32_t>length) != -1:
                continue
            # the rules hold: 1 <= total <= MAX_PACKETS_PER_CONTRIBUTION and seq < total
            if done[f.partition] or got[f.partition, f.seq]:
                continue
            got[f.partition, f.seq] = 1
            res_total[f.partition] = f.total
            res_got[f.partition] += 1
            new_rows[nn] = i
            new_keys[nn] = <int64_t>f.partition * DOSA_MAX_PACKETS_PER_CONTRIBUTION + f.seq
            nn += 1
            if res_got[f.partition] >= res_total[f.partition]:
                done[f.partition] = 1
                completed[nc] = f.partition
                nc += 1
    return nn, ns, nc
