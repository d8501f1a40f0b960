# A BPF ring buffer read from user space through its mmap (the layout: dataplane/ring.py): the
# completion records the XDP program writes for one DPU worker shard. Inline: the completion path
# (dpu_fw/_completion.pyx) reads it in its nogil loop.
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from ._state cimport dosa_completion

cdef extern from *:
    """
    #define dosa_ring_load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
    #define dosa_ring_store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
    """
    uint64_t _load64 "dosa_ring_load_acquire"(const uint64_t* p) nogil
    uint32_t _load32 "dosa_ring_load_acquire"(const uint32_t* p) nogil
    void _store64 "dosa_ring_store_release"(uint64_t* p, uint64_t v) nogil

cdef enum:
    RING_BUSY_BIT = 1u << 31     # reserved, not yet submitted
    RING_DISCARD_BIT = 1u << 30  # discarded by its producer
    RING_REC_HEADER = 8

cdef struct RingView:
    uint64_t* cons         # the consumer position the kernel reads (written by commit)
    const uint64_t* prod   # the producer position
    const uint8_t* data    # the records (mapped twice in a row: a record never wraps)
    uint64_t mask          # size - 1 (a power of two)
    uint64_t next_cons     # read up to here, not yet committed


cdef inline Py_ssize_t ring_read(RingView* r, dosa_completion* out, Py_ssize_t limit) noexcept nogil:
    """Committed records after the read position, up to ``limit``, into ``out`` (not yet consumed:
    ``ring_commit`` does that once their results are sent, so a worker that dies in between reads
    them again)."""
    cdef uint64_t pos = r.next_cons, prod = _load64(r.prod)
    cdef Py_ssize_t n = 0
    cdef const uint8_t* rec
    cdef uint32_t length
    while pos < prod and n < limit:
        rec = r.data + (pos & r.mask)
        length = _load32(<const uint32_t*>rec)
        if length & RING_BUSY_BIT:
            break  # reserved, not yet submitted: later records wait for it
        if not (length & RING_DISCARD_BIT) and \
                (length & ~(RING_BUSY_BIT | RING_DISCARD_BIT)) >= sizeof(dosa_completion):
            out[n] = (<const dosa_completion*>(rec + RING_REC_HEADER))[0]
            n += 1
        pos += (RING_REC_HEADER + (length & ~(RING_BUSY_BIT | RING_DISCARD_BIT)) + 7) & ~(<uint64_t>7)
    r.next_cons = pos
    return n


cdef inline void ring_commit(RingView* r) noexcept nogil:
    """Consume what ``ring_read`` returned: the kernel may reuse that space."""
    _store64(r.cons, r.next_cons)


cdef inline bint ring_empty(RingView* r) noexcept nogil:
    return _load64(r.prod) == r.next_cons
