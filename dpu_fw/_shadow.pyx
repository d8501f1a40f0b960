# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A completed buffer's life as a shadow copy: what retransmissions are answered from until its
slot's next occupant completes.

The completion path (dpu_fw/_completion.pyx) reads a completed buffer's entries (``entries``: from
its touched list, its sorted offsets or its compacted result), then ``compact``s it while it is
hot: a sparse result replaces the touched list in the buffer's list area and the sums are zeroed,
a denser one keeps its sums with their non-zero offsets sorted. ``settle`` frees the slot's
previous occupant when the next one completes (clearing exactly what it touched), and ``rebuild``
answers an ask from whichever form the shadow copy has (docs/dpu_worker.md *Shadow copies*).
Every step is flagged in the slot's ``touched`` word before the next, so a worker that dies in
between leaves a state the next one reads right, and a read racing with a step is detected.
"""
import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from ._jobrt cimport S_SETTLED, JobRt
from ._results cimport Writer, extract, packets_for, top_k, write_results
from ._state cimport (DOSA_LIST_WORDS, DOSA_SCALE_TAG_BIAS, DOSA_TOUCHED_COMPACT, DOSA_TOUCHED_SORTED,
                      DOSA_TOUCHED_WRITING, DOSA_TOUCHED_ZEROED, dosa_buf, dosa_pstate, dosa_wstate,
                      occupant)

cdef extern from *:
    void __builtin_prefetch(const void*, int) nogil

cdef extern from *:
    """
    #define load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
    #define store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
    #define store_seq_cst(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
    #define full_fence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
    """
    uint64_t load_acquire(const uint64_t* p) nogil
    void store_release(uint64_t* p, uint64_t v) nogil
    void store_seq_cst(uint64_t* p, uint64_t v) nogil
    void full_fence() nogil

cdef enum:
    SETTLE_PREFETCH = 16  # listed sums the settle prefetches ahead
    COMPACT_MAX = DOSA_LIST_WORDS * 8 // 6  # result entries the list area holds compacted
    SORTED_MAX = DOSA_LIST_WORDS * 4        # non-zero offsets it holds sorted

cdef uint64_t COUNT_MASK = 0xFFFFFFFF


cdef void settle(JobRt* j, uint32_t slot, uint64_t gen) noexcept nogil:
    """Occupant ``gen`` of ``slot`` completed: when it is the one after the slot's base, every
    host holds the base's result (a host sends a slot's next occupant only then), so clear the
    base and make ``gen`` the base (dataplane.maps.DataplaneMaps.advance does the same in
    Python). base_gen is stored first, with a full barrier: from then on a late packet of the
    old occupant is round_too_old in XDP and touches nothing cleared here."""
    cdef dosa_pstate* ps = &j.g.ps[slot]
    cdef uint64_t base = load_acquire(&ps.base_gen)
    cdef uint32_t par, i, o
    cdef uint64_t cnt
    cdef dosa_buf* b
    cdef const uint16_t* lst
    if gen != base + 1:
        return
    par = base & 1
    store_seq_cst(&ps.base_gen, gen)
    b = &j.g.bufs[slot * 2 + par]
    cnt = ps.touched[par]
    if cnt & DOSA_TOUCHED_ZEROED:
        pass  # zeroed when its result went out (_compact)
    elif cnt & DOSA_TOUCHED_SORTED:
        # exactly its non-zero sums, in ascending order (_compact): streams, no duplicates
        lst = <const uint16_t*>b.list
        for i in range(<uint32_t>(cnt & COUNT_MASK)):
            b.sums[lst[i]] = 0
    elif cnt & (DOSA_TOUCHED_COMPACT | DOSA_TOUCHED_WRITING) or not j.g.list_cap \
            or cnt > j.g.list_cap:
        memset(b.sums, 0, j.g.stride * sizeof(int32_t))  # no list to read: all of it
    else:
        # the sums are cold (the slot's later occupants ran since): prefetch for writing
        # SETTLE_PREFETCH ahead so their misses overlap
        lst = <const uint16_t*>b.list
        for i in range(<uint32_t>cnt):
            if i + SETTLE_PREFETCH < cnt:
                __builtin_prefetch(&b.sums[lst[i + SETTLE_PREFETCH]], 1)
            o = lst[i]
            if o < j.g.stride:
                b.sums[o] = 0
    memset(&j.g.ws[(slot * 2 + par) * j.g.workers], 0, j.g.workers * sizeof(dosa_wstate))
    ps.workers_done[par] = 0
    ps.scale_tag[par] = 0
    ps.touched[par] = 0
    j.stats[S_SETTLED] += 1


cdef Py_ssize_t entries(JobRt* j, dosa_buf* b, uint64_t touched, uint32_t lo, uint32_t n,
                        uint32_t local, uint32_t* oi, int32_t* ov, uint32_t* ri, int32_t* rv,
                        Py_ssize_t* m_all, uint64_t* bits, int64_t* topk_scratch) noexcept nogil:
    """The result entries of a completed buffer into ri/rv (ascending), returning how many;
    its non-zero sums into oi/ov (``m_all`` of them; -1 when they are not known because the
    buffer was compacted). ri/rv may be oi/ov in sum mode."""
    cdef Py_ssize_t m, i, vo
    cdef const uint16_t* co
    cdef const int32_t* cv
    if touched & DOSA_TOUCHED_COMPACT:
        m = <Py_ssize_t>(touched & COUNT_MASK)
        co = <const uint16_t*>b.list
        vo = (2 * m + 3) & ~3
        cv = <const int32_t*>((<const uint8_t*>b.list) + vo)
        for i in range(m):
            ri[i] = lo + co[i]
            rv[i] = cv[i]
        m_all[0] = -1
        return m
    if touched & DOSA_TOUCHED_SORTED:
        m = <Py_ssize_t>(touched & COUNT_MASK)
        co = <const uint16_t*>b.list
        for i in range(m):
            oi[i] = lo + co[i]
            ov[i] = b.sums[co[i]]
    else:
        if touched & DOSA_TOUCHED_WRITING:
            touched = <uint64_t>j.g.list_cap + 1  # the list was being overwritten: scan
        m = extract(b.sums, n, <const uint16_t*>b.list, touched, j.g.list_cap, bits, lo, oi, ov)
    m_all[0] = m
    if not j.gtopk:
        return m
    if ri != oi:
        for i in range(m):
            ri[i] = oi[i]
            rv[i] = ov[i]
    return top_k(ri, rv, m, j.k[local], topk_scratch)

cdef void compact(JobRt* j, dosa_buf* b, uint64_t* touched, uint32_t lo,
                  const uint32_t* ri, const int32_t* rv, Py_ssize_t m,
                  const uint32_t* oi, Py_ssize_t m_all) noexcept nogil:
    """Once a result is built: when it fits, the result's entries, compacted (u16 offsets, then
    s32 values 4-aligned), replace the touched list in the buffer's list area, and the
    buffer's non-zero sums are zeroed while they are still in cache. The compacted result is
    the shadow copy asks are answered from and a restarted worker rebuilds from; the slot's
    settle then has nothing to clear but counters. A larger result (a dense partition) keeps
    its sums as the shadow copy, and the list area gets the offsets of its non-zero sums,
    sorted: answers read them without deduplicating a list, the settle clears exactly them.
    Each step is flagged in ``touched`` before the next, so a worker that dies in between
    leaves a state the next one reads right (WRITING: the list is no longer whole, scan the
    sums; COMPACT: the result is in the list area; ZEROED: the sums are clear; SORTED: the
    list area holds the sorted offsets)."""
    cdef Py_ssize_t i, vo = (2 * m + 3) & ~3
    cdef uint16_t* co = <uint16_t*>b.list
    cdef int32_t* cv = <int32_t*>((<uint8_t*>b.list) + vo)
    cdef uint64_t t = load_acquire(touched)
    if t & (DOSA_TOUCHED_COMPACT | DOSA_TOUCHED_SORTED) or m_all < 0:
        return
    if m <= COMPACT_MAX:
        store_release(touched, DOSA_TOUCHED_WRITING | t)
        for i in range(m):
            co[i] = <uint16_t>(ri[i] - lo)
            cv[i] = rv[i]
        store_release(touched, DOSA_TOUCHED_COMPACT | <uint64_t>m)
        for i in range(m_all):
            b.sums[oi[i] - lo] = 0
        store_release(touched, DOSA_TOUCHED_COMPACT | DOSA_TOUCHED_ZEROED | <uint64_t>m)
    elif m_all <= SORTED_MAX:
        # too many to compact: the offsets of every non-zero sum, sorted, replace the list
        # (the sums stay, the shadow copy; the settle then clears exactly them, in order)
        store_release(touched, DOSA_TOUCHED_WRITING | t)
        for i in range(m_all):
            co[i] = <uint16_t>(oi[i] - lo)
        store_release(touched, DOSA_TOUCHED_SORTED | <uint64_t>m_all)


cdef object rebuild(JobRt* j, uint32_t local, uint32_t rnd, Py_ssize_t stride, uint64_t* bits,
                    int64_t* topk_scratch):
    """The result packets of (owned partition ``local``, ``rnd``) rebuilt from its buffer, as
    (data (npk, stride) uint8, lengths int64), when it is its slot's base occupant and complete;
    None otherwise (not complete, settled past, or its completion not handled yet). Read-only:
    any shard may answer any slot; a settle racing with the read is caught by reading base_gen
    again (it is stored before anything is cleared)."""
    cdef uint32_t slot = 0, par, lo, n, partition
    cdef uint64_t gen, base
    cdef Py_ssize_t m, span, npk
    cdef bint dense
    cdef dosa_buf* b
    if local >= j.g.num_owned:
        return None
    gen = occupant(&j.g, local, rnd, &slot)
    par = gen & 1
    base = load_acquire(&j.g.ps[slot].base_gen)
    if gen != base or j.g.ps[slot].workers_done[par] < j.g.workers:
        return None
    partition = local * j.g.num_dpus + j.g.dpu_index
    b = &j.g.bufs[slot * 2 + par]
    lo = partition * j.g.partition_size
    n = j.g.numel - lo if j.g.numel - lo < j.g.partition_size else j.g.partition_size
    oi = np.empty(max(n, 1), np.uint32)
    ov = np.empty(max(n, 1), np.int32)
    ri_ = np.empty(max(n, 1), np.uint32)
    rv_ = np.empty(max(n, 1), np.int32)
    cdef uint32_t[::1] oiv = oi
    cdef int32_t[::1] ovv = ov
    cdef uint32_t[::1] riv = ri_
    cdef int32_t[::1] rvv = rv_
    cdef Py_ssize_t m_all
    cdef uint64_t touched = load_acquire(&j.g.ps[slot].touched[par])
    if not j.gtopk:
        # sum mode: the result is the non-zero sums themselves (complete_one passes one pair
        # of arrays too; the compacted path fills ri/rv, the others oi/ov)
        ri_, rv_, riv, rvv = oi, ov, oiv, ovv
    m = entries(j, b, touched, lo, n, local, &oiv[0], &ovv[0], &riv[0], &rvv[0], &m_all, bits,
                topk_scratch)
    oi, ov = ri_, rv_
    oiv, ovv = riv, rvv
    full_fence()
    # the owning shard may have settled the slot or compacted the buffer meanwhile: a read
    # across either is not trusted (the caller answers later)
    if load_acquire(&j.g.ps[slot].base_gen) != base or \
            load_acquire(&j.g.ps[slot].touched[par]) != touched:
        return None
    span = <Py_ssize_t>(oi[m - 1] - oi[0]) + 1 if m else 0
    npk = packets_for(m, span, &j.w, &dense)
    if npk < 0:
        return None
    data = np.zeros((npk, stride), np.uint8)
    lengths = np.zeros(npk, np.int64)
    cdef uint8_t[:, ::1] dv = data
    cdef int64_t[::1] lv = lengths
    cdef Writer w = j.w
    w.rnd = rnd
    w.scale_exp = <int>j.g.ps[slot].scale_tag[par] - DOSA_SCALE_TAG_BIAS if j.g.ps[slot].scale_tag[par] else 0
    write_results(&dv[0, 0], &lv[0], &w, partition, lo, &oiv[0], &ovv[0], m, npk, dense)
    return data, lengths


cdef bint needs_scan(JobRt* j, uint32_t shard, uint32_t shards) noexcept nogil:
    """Whether a slot of this shard (slot % shards == shard) holds an occupant some but not all
    workers delivered, or a complete one not handled: the only states the NACK scan acts on (a
    cheap check, so an idle worker does not run the scan in Python every few milliseconds)."""
    cdef uint32_t s = shard, W = j.g.workers
    cdef uint64_t d0, d1
    while s < j.g.slots:
        d0 = j.g.ps[s].workers_done[0]
        d1 = j.g.ps[s].workers_done[1]
        if (0 < d0 < W) or (0 < d1 < W) or \
                j.g.ps[s].workers_done[(j.g.ps[s].base_gen + 1) & 1] >= W:
            return True
        s += shards
    return False
