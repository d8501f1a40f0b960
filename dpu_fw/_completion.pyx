# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The DPU worker's completion path, compiled: from a completion to the result packets on the wire.

For each completed (job, partition, round) in one nogil loop: settle the slot's previous occupant
(``base_gen`` first, then clear its sums at its touched list, its dedup state and counters: the
slot is free for the next-but-one occupant), extract the completed buffer's non-zero sums,
select gtopk's k, write the result packets into an arena, and every EMIT_CHUNK completions send the
arena with UDP GSO to the job's multicast group or to each host (``dosa._net.send_core``). No
Python and no numpy call per completion: Python keeps the policy (which jobs, their hosts, asks,
the NACK scan, stats) and calls ``step`` for the data path.

In XDP mode the completions come from this shard's ring buffer, read through its mmap
(dataplane/ring.py has the layout) and consumed only after their results are sent, so a worker
that dies mid-batch handles the same completions again when it restarts (the settle is
idempotent, a result sent twice is a duplicate the hosts drop). The shard asks the XDP program for
a wakeup (settings.asleep) only while it blocks: otherwise each completion would cost an IPI.
In userspace mode dpu_fw/_softmerge.pyx calls ``complete_one`` for the completions its merge finds.

The buffer stays untouched until the slot's next occupant completes: it is the shadow copy a
retransmission is answered from (``result``).
"""
import numpy as np

from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memset

from dosa._net cimport (C_SEND_CALLS, C_SEND_DGRAMS, C_SENT_BYTES, C_SENT_PACKETS, N_COUNTERS, POLLIN,
                        now, poll, pollfd, send_core)

from ._results cimport BITMAP_WORDS, Writer, extract, packets_for, top_k, write_results
from ._state cimport (DOSA_BUF_SUMS, DOSA_F_GTOPK, DOSA_LIST_WORDS, DOSA_MAX_SHARDS,
                      DOSA_SCALE_TAG_BIAS, DOSA_TOUCHED_COMPACT, DOSA_TOUCHED_SORTED,
                      DOSA_TOUCHED_WRITING,
                      DOSA_TOUCHED_ZEROED, JobGeo, dosa_buf,
                      dosa_completion, dosa_pstate, dosa_settings, dosa_wstate, occupant)

from dosa import wire as _wire

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
    uint32_t load_acquire32 "load_acquire"(const uint32_t* p) nogil
    void store_release(uint64_t* p, uint64_t v) nogil
    void store_seq_cst(uint64_t* p, uint64_t v) nogil
    void full_fence() nogil

#: the clocks an engine's time counters can run on (``engine.clock``)
CLOCK_WALL = CLOCK_MONOTONIC
CLOCK_THREAD_CPU = CLOCK_THREAD_CPUTIME_ID
#: jobs one engine serves at most
ENGINE_MAX_JOBS = MAX_JOBS
#: the names of a job's engine counters (the S_* slots of _completion.pxd), in order
ENGINE_STATS = ("completions", "result_packets", "result_entries", "completion_unknown",
                "settled", "send_errors", "packet_limit")
assert len(ENGINE_STATS) == N_STATS

cdef enum:
    EMIT_CHUNK = 32       # completions whose results are sent together: they reach the hosts
                          # while the next ones are built
    RING_BATCH = 1024     # completion records read from the ring per pass
    BUSY_BIT = 1u << 31
    DISCARD_BIT = 1u << 30
    REC_HEADER = 8
    SCRATCH = 65536       # one partition's entries at most (DOSA_BUF_SUMS)
    SETTLE_PREFETCH = 16  # listed sums the settle prefetches ahead
    COMPACT_MAX = DOSA_LIST_WORDS * 8 // 6  # result entries the list area holds compacted
    SORTED_MAX = DOSA_LIST_WORDS * 4        # non-zero offsets it holds sorted

cdef uint64_t COUNT_MASK = 0xFFFFFFFF

cdef Py_ssize_t ARENA_STRIDE = _wire.stride_for_mtu(_wire.MAX_MTU)


cdef extern from "<time.h>" nogil:
    enum: CLOCK_MONOTONIC, CLOCK_THREAD_CPUTIME_ID
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)


cdef inline int64_t _clock_ns(int clk) noexcept nogil:
    cdef timespec ts
    clock_gettime(clk, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class CompletionEngine:
    """The data path of one DPU worker shard. ``sock_fd``: its UDP socket; ``counters`` and
    ``gso``: its endpoint's counter array and GSO setting (dosa.transport.UdpEndpoint)."""

    def __cinit__(self, int sock_fd, int64_t[::1] counters, int64_t[::1] gso):
        if counters.shape[0] < N_COUNTERS or gso.shape[0] < 1:
            raise ValueError("counters or gso array too short")
        self.sock_fd = sock_fd
        self._counters_ref, self._gso_ref = counters, gso
        self.counters = &counters[0]
        self.gso = &gso[0]
        self._keep = {}
        memset(self.jobs, 0, sizeof(self.jobs))
        self.ring_fd = -1
        self.stride = ARENA_STRIDE
        self.cap = 256
        self.send_cap = 0
        self.unknown_cap = 4096
        self.oi = <uint32_t*>malloc(SCRATCH * sizeof(uint32_t))
        self.ov = <int32_t*>malloc(SCRATCH * sizeof(int32_t))
        self.ri = <uint32_t*>malloc(SCRATCH * sizeof(uint32_t))
        self.rv = <int32_t*>malloc(SCRATCH * sizeof(int32_t))
        self.topk_scratch = <int64_t*>malloc(SCRATCH * sizeof(int64_t))
        self.bits = <uint64_t*>calloc(BITMAP_WORDS, sizeof(uint64_t))
        self.arena = <uint8_t*>malloc(self.cap * self.stride)
        self.lengths = <int64_t*>malloc(self.cap * sizeof(int64_t))
        self.pkjob = <int16_t*>malloc(self.cap * sizeof(int16_t))
        self.unknown = <dosa_completion*>malloc(self.unknown_cap * sizeof(dosa_completion))
        if not (self.oi and self.ov and self.ri and self.rv and self.topk_scratch and self.bits and self.arena and
                self.lengths and self.pkjob and self.unknown):
            raise MemoryError()
        self.send_timeout = 2.0
        self.clock = CLOCK_MONOTONIC

    def __dealloc__(self):
        free(self.oi); free(self.ov); free(self.ri); free(self.rv); free(self.topk_scratch); free(self.bits); free(self.arena)
        free(self.lengths); free(self.pkjob); free(self.unknown); free(self.send_rows)
        free(self.send_ip); free(self.send_port)

    # ------------------------------------------------------------------ set-up (Python)
    def set_ring(self, ring, settings=None, int shard=0):
        """Read completions from ``ring`` (dataplane.ring.Ring, XDP mode); ``settings``: the
        dataplane's settings array (layout.SETTINGS_DTYPE, one element) where this shard says it
        sleeps."""
        if not 0 <= shard < DOSA_MAX_SHARDS:
            raise ValueError(f"shard {shard} outside 0..{DOSA_MAX_SHARDS - 1}")
        cons, prod, data, size = ring.addresses()
        if size & (size - 1):
            raise ValueError("ring size is not a power of two")
        self._ring_ref = ring
        self.ring_fd = ring.fd
        self.cons = <uint64_t*><size_t>cons
        self.prod = <const uint64_t*><size_t>prod
        self.data = <const uint8_t*><size_t>data
        self.mask = size - 1
        self.next_cons = load_acquire(self.cons)
        self.shard = shard
        if settings is not None:
            self._settings_ref = settings
            self.settings = <dosa_settings*><size_t>settings.ctypes.data

    def add_job(self, int job_id, geometry, int64_t bufs, int64_t ps, int64_t ws, *, hosts,
                group=None, bint gtopk=False, k=None, int mtu=_wire.DEFAULT_MTU):
        """Serve a job: ``geometry`` a dataplane.maps.JobInfo (or any object with its fields);
        ``bufs``/``ps``/``ws`` the addresses of its first pool buffer, slot state and worker state;
        ``hosts``: (ip_be uint32 array, port_be uint16 array) of its workers; ``group``: the same
        for its multicast group (or None: unicast fan-out); ``k``: gtopk's k per owned partition."""
        cdef int i = self._find(job_id)
        if i < 0:
            for i in range(MAX_JOBS):
                if not self.jobs[i].used:
                    break
            else:
                raise ValueError(f"the engine serves at most {MAX_JOBS} jobs")
        cdef JobRt* j = &self.jobs[i]
        memset(j, 0, sizeof(JobRt))
        g = geometry
        if not 1 <= g.slots <= g.num_owned or g.stride > DOSA_BUF_SUMS or g.num_dpus < 1:
            raise ValueError(f"job {job_id}: bad geometry {g}")
        j.g.job_id = job_id
        j.g.workers, j.g.partition_size, j.g.numel = g.workers, g.partition_size, g.numel
        j.g.num_partitions, j.g.dpu_index, j.g.num_dpus = g.num_partitions, g.dpu_index, g.num_dpus
        j.g.num_owned, j.g.slots, j.g.stride, j.g.list_cap = g.num_owned, g.slots, g.stride, g.list_cap
        j.g.bufs = <dosa_buf*><size_t>bufs
        j.g.ps = <dosa_pstate*><size_t>ps
        j.g.ws = <dosa_wstate*><size_t>ws
        keep = self._keep[job_id] = {}
        ip = keep["ip"] = np.ascontiguousarray(hosts[0], np.uint32)
        port = keep["port"] = np.ascontiguousarray(hosts[1], np.uint16)
        if len(ip) != len(port) or not len(ip):
            raise ValueError(f"job {job_id}: hosts need as many addresses as ports, at least one")
        cdef uint32_t[::1] ipv = ip
        cdef uint16_t[::1] portv = port
        j.nhosts = len(ip)
        j.host_ip = &ipv[0]
        j.host_port = &portv[0]
        if group is not None:
            j.group = True
            j.group_ip = int(group[0])
            j.group_port = int(group[1])
        em = keep["emitted"] = np.zeros(2 * g.slots, np.float64)
        cdef double[::1] emv = em
        j.emitted = &emv[0]
        cdef int64_t[::1] kv
        if gtopk:
            kk = keep["k"] = np.ascontiguousarray(k, np.int64)
            if len(kk) < g.num_owned:
                raise ValueError(f"job {job_id}: gtopk needs k for each of {g.num_owned} partitions")
            kv = kk
            j.k = &kv[0]
        j.gtopk = gtopk
        j.max_key = -1
        j.w.job_id = job_id
        j.w.flags = DOSA_F_GTOPK if gtopk else 0
        j.w.per_sparse = _wire.entries_per_packet(_wire.PacketType.SPARSE_RESULT, mtu)
        j.w.per_dense = _wire.entries_per_packet(_wire.PacketType.DENSE_RESULT, mtu)
        j.w.stride = self.stride
        j.used = True

    def drop_job(self, int job_id):
        cdef int i = self._find(job_id)
        if i >= 0:
            self.jobs[i].used = False
        self._keep.pop(job_id, None)

    def use_unicast(self, int job_id):
        """Fan results out to each host from now on (the group could not be sent to)."""
        cdef int i = self._find(job_id)
        if i >= 0:
            self.jobs[i].group = False

    def uses_group(self, int job_id) -> bool:
        cdef int i = self._find(job_id)
        return i >= 0 and bool(self.jobs[i].group)

    def emitted(self, int job_id):
        """Per slot * 2 + parity: when (time.monotonic()) its result was last fanned out."""
        return self._keep[job_id]["emitted"]

    def slot_of(self, int job_id) -> int:
        """The job's row in the engine's tables (-1: not served)."""
        return self._find(job_id)

    def max_key(self, int job_id) -> int:
        cdef int i = self._find(job_id)
        return self.jobs[i].max_key if i >= 0 else -1

    def stats(self, int job_id) -> dict:
        cdef int i = self._find(job_id)
        if i < 0:
            return {}
        return {name: int(self.jobs[i].stats[s]) for s, name in enumerate(ENGINE_STATS)}

    def needs_scan(self, int job_id, int shard=0, int shards=1) -> bool:
        """Whether a slot of this shard holds an occupant some but not all workers delivered, or
        a complete one not handled: the only states the NACK scan acts on (a cheap check, so an
        idle worker does not run the scan in Python every few milliseconds)."""
        cdef int ji = self._find(job_id)
        cdef JobRt* j
        cdef uint32_t s, W
        cdef uint64_t d0, d1
        if ji < 0:
            return False
        j = &self.jobs[ji]
        W = j.g.workers
        s = <uint32_t>shard
        while s < j.g.slots:
            d0 = j.g.ps[s].workers_done[0]
            d1 = j.g.ps[s].workers_done[1]
            if (0 < d0 < W) or (0 < d1 < W) or \
                    j.g.ps[s].workers_done[(j.g.ps[s].base_gen + 1) & 1] >= W:
                return True
            s += <uint32_t>shards
        return False

    def take_unknown(self):
        """Completions of jobs this engine does not serve (yet), as (job_id, partition, round,
        scale_exp) records (what ``handle`` takes) for the worker to park."""
        out = [(self.unknown[i].job_id, self.unknown[i].partition, self.unknown[i].round,
                self.unknown[i].scale_exp) for i in range(self.nunknown)]
        self.nunknown = 0
        return out

    # ------------------------------------------------------------------ the data path
    cdef int _find(self, uint32_t job_id) noexcept nogil:
        cdef int i
        for i in range(MAX_JOBS):
            if self.jobs[i].used and self.jobs[i].g.job_id == job_id:
                return i
        return -1

    cdef void _settle(self, JobRt* j, uint32_t slot, uint64_t gen) noexcept nogil:
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

    cdef bint _room(self, Py_ssize_t npk) noexcept nogil:
        cdef Py_ssize_t cap = self.cap
        cdef uint8_t* a
        cdef int64_t* l
        cdef int16_t* pj
        if self.used + npk <= cap:
            return True
        while self.used + npk > cap:
            cap *= 2
        a = <uint8_t*>realloc(self.arena, cap * self.stride)
        if a == NULL:
            return False
        self.arena = a
        l = <int64_t*>realloc(self.lengths, cap * sizeof(int64_t))
        if l == NULL:
            return False
        self.lengths = l
        pj = <int16_t*>realloc(self.pkjob, cap * sizeof(int16_t))
        if pj == NULL:
            return False
        self.pkjob = pj
        self.cap = cap
        return True

    cdef Py_ssize_t _entries(self, JobRt* j, dosa_buf* b, uint64_t touched, uint32_t lo, uint32_t n,
                             uint32_t local, uint32_t* oi, int32_t* ov, uint32_t* ri, int32_t* rv,
                             Py_ssize_t* m_all) noexcept nogil:
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
            m = extract(b.sums, n, <const uint16_t*>b.list, touched, j.g.list_cap, self.bits, lo, oi, ov)
        m_all[0] = m
        if not j.gtopk:
            return m
        if ri != oi:
            for i in range(m):
                ri[i] = oi[i]
                rv[i] = ov[i]
        return top_k(ri, rv, m, j.k[local], self.topk_scratch)

    cdef void _compact(self, JobRt* j, dosa_buf* b, uint64_t* touched, uint32_t lo,
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

    cdef void complete_one(self, uint32_t job_id, uint32_t partition, uint32_t rnd,
                           int8_t scale) noexcept nogil:
        """One completion: settle the slot, build the result into the arena (sent by flush)."""
        cdef int ji = self._find(job_id)
        cdef JobRt* j
        cdef uint32_t local, slot = 0, par, lo, n
        cdef uint64_t gen
        cdef Py_ssize_t m, m_all, span, npk, i
        cdef bint dense
        cdef dosa_buf* b
        cdef int64_t t0, t1, key
        cdef uint32_t* ri
        cdef int32_t* rv
        if ji < 0:
            if self.nunknown < self.unknown_cap:
                self.unknown[self.nunknown].job_id = job_id
                self.unknown[self.nunknown].round = rnd
                self.unknown[self.nunknown].partition = <uint16_t>partition
                self.unknown[self.nunknown].scale_exp = scale
                self.nunknown += 1
            return
        j = &self.jobs[ji]
        if partition >= j.g.num_partitions or partition % j.g.num_dpus != j.g.dpu_index \
                or partition / j.g.num_dpus >= j.g.num_owned:
            j.stats[S_COMPLETION_UNKNOWN] += 1
            return
        t0 = _clock_ns(self.clock)
        local = partition / j.g.num_dpus
        gen = occupant(&j.g, local, rnd, &slot)
        par = gen & 1
        self._settle(j, slot, gen)
        t1 = _clock_ns(self.clock)
        self.ns_settle += t1 - t0
        b = &j.g.bufs[slot * 2 + par]
        lo = partition * j.g.partition_size
        n = j.g.numel - lo if j.g.numel - lo < j.g.partition_size else j.g.partition_size
        ri = self.ri if j.gtopk else self.oi
        rv = self.rv if j.gtopk else self.ov
        m = self._entries(j, b, load_acquire(&j.g.ps[slot].touched[par]), lo, n, local, self.oi,
                          self.ov, ri, rv, &m_all)
        span = <Py_ssize_t>(ri[m - 1] - ri[0]) + 1 if m else 0
        npk = packets_for(m, span, &j.w, &dense)
        if npk < 0 or not self._room(npk):
            j.stats[S_PACKET_LIMIT] += 1
            return
        j.w.rnd = rnd
        j.w.scale_exp = scale
        write_results(self.arena + self.used * self.stride, self.lengths + self.used, &j.w,
                      partition, lo, ri, rv, m, npk, dense)
        self._compact(j, b, &j.g.ps[slot].touched[par], lo, ri, rv, m, self.oi, m_all)
        for i in range(npk):
            self.pkjob[self.used + i] = <int16_t>ji
        self.used += npk
        j.emitted[slot * 2 + par] = now()
        key = <int64_t>rnd * j.g.num_owned + local
        if key > j.max_key:
            j.max_key = key
        j.stats[S_COMPLETIONS] += 1
        j.stats[S_RESULT_PACKETS] += npk
        j.stats[S_RESULT_ENTRIES] += m
        self.completions += 1
        self.ns_build += _clock_ns(self.clock) - t1

    cdef bint _send_space(self, Py_ssize_t n) noexcept nogil:
        cdef int64_t* r
        cdef uint32_t* ip
        cdef uint16_t* port
        if n <= self.send_cap:
            return True
        r = <int64_t*>realloc(self.send_rows, n * sizeof(int64_t))
        if r == NULL:
            return False
        self.send_rows = r
        ip = <uint32_t*>realloc(self.send_ip, n * sizeof(uint32_t))
        if ip == NULL:
            return False
        self.send_ip = ip
        port = <uint16_t*>realloc(self.send_port, n * sizeof(uint16_t))
        if port == NULL:
            return False
        self.send_port = port
        self.send_cap = n
        return True

    cdef int flush(self) noexcept nogil:
        """Send the arena: per job, to its group, or host-major to each host (each host's copy of
        a partition is one GSO run). A job whose group send fails falls back to its hosts for
        good (Python sees it in uses_group). Returns the packets sent."""
        cdef Py_ssize_t r, h, n, total = 0, sent
        cdef int ji, err
        cdef JobRt* j
        cdef int64_t t0 = _clock_ns(self.clock)
        cdef int64_t calls = 0, dgrams = 0
        if self.used == 0:
            return 0
        for ji in range(MAX_JOBS):
            j = &self.jobs[ji]
            if not j.used:
                continue
            n = 0
            for r in range(self.used):
                n += self.pkjob[r] == ji
            if n == 0:
                continue
            if not self._send_space(n * (j.nhosts if j.nhosts > 1 else 1)):
                j.stats[S_SEND_ERRORS] += 1
                continue
            while True:
                n = 0
                if j.group:
                    for r in range(self.used):
                        if self.pkjob[r] == ji:
                            self.send_rows[n] = r
                            self.send_ip[n] = j.group_ip
                            self.send_port[n] = j.group_port
                            n += 1
                else:
                    for h in range(j.nhosts):
                        for r in range(self.used):
                            if self.pkjob[r] == ji:
                                self.send_rows[n] = r
                                self.send_ip[n] = j.host_ip[h]
                                self.send_port[n] = j.host_port[h]
                                n += 1
                sent = send_core(self.sock_fd, self.arena, self.stride, self.lengths, self.send_rows,
                                 n, self.send_ip, self.send_port, self.send_timeout, self.gso,
                                 &calls, &dgrams, &err)
                for r in range(sent):
                    self.counters[C_SENT_BYTES] += self.lengths[self.send_rows[r]]
                self.counters[C_SENT_PACKETS] += sent
                total += sent
                if sent < n:
                    j.stats[S_SEND_ERRORS] += 1
                    if j.group and err != 0:
                        j.group = False  # the group is unreachable: fan out from now on
                        continue
                break
        self.counters[C_SEND_CALLS] += calls
        self.counters[C_SEND_DGRAMS] += dgrams
        self.used = 0
        self.ns_send += _clock_ns(self.clock) - t0
        return <int>total

    cdef Py_ssize_t _read_ring(self, dosa_completion* out, Py_ssize_t limit) noexcept nogil:
        """Committed records after the read position, up to ``limit``, into ``out`` (not yet
        consumed: commit_ring does that once their results are sent)."""
        cdef uint64_t pos = self.next_cons, prod = load_acquire(self.prod)
        cdef Py_ssize_t n = 0
        cdef const uint8_t* rec
        cdef uint32_t length
        while pos < prod and n < limit:
            rec = self.data + (pos & self.mask)
            length = load_acquire32(<const uint32_t*>rec)
            if length & BUSY_BIT:
                break  # reserved, not yet submitted: later records wait for it
            if not (length & DISCARD_BIT) and (length & ~(BUSY_BIT | DISCARD_BIT)) >= sizeof(dosa_completion):
                out[n] = (<const dosa_completion*>(rec + REC_HEADER))[0]
                n += 1
            pos += (REC_HEADER + (length & ~(BUSY_BIT | DISCARD_BIT)) + 7) & ~(<uint64_t>7)
        self.next_cons = pos
        return n

    cdef Py_ssize_t _drain(self) noexcept nogil:
        """Every record waiting in the ring: handled EMIT_CHUNK at a time, then consumed."""
        cdef dosa_completion recs[RING_BATCH]
        cdef Py_ssize_t n, i, total = 0
        while True:
            n = self._read_ring(recs, RING_BATCH)
            if n == 0:
                break
            for i in range(n):
                self.complete_one(recs[i].job_id, recs[i].partition, recs[i].round, recs[i].scale_exp)
                if self.used and (i + 1) % EMIT_CHUNK == 0:
                    self.flush()
            self.flush()
            store_release(self.cons, self.next_cons)
            total += n
        return total

    def step(self, double timeout, extra_fds=()):
        """Handle the completions waiting in the ring; when there were none, block up to
        ``timeout`` seconds until the ring or one of ``extra_fds`` (the worker's sockets) polls
        readable, then handle what came. Returns (completions handled, whether one of extra_fds is
        readable)."""
        cdef pollfd fds[4]
        cdef int nfds = 1, i, rc, ms
        cdef Py_ssize_t done
        cdef bint readable = False
        if self.ring_fd < 0:
            raise ValueError("no ring: call set_ring first (XDP mode)")
        fds[0].fd = self.ring_fd
        fds[0].events = POLLIN
        for f in list(extra_fds)[:3]:
            fds[nfds].fd = f
            fds[nfds].events = POLLIN
            nfds += 1
        ms = <int>(timeout * 1000 + 0.999) if timeout > 0 else 0  # ceil: a sub-ms wait must wait
        with nogil:
            done = self._drain()
            if done == 0 and ms > 0:
                if self.settings != NULL:
                    self.settings.asleep[self.shard] = 1
                    full_fence()
                if load_acquire(self.prod) == self.next_cons:
                    for i in range(nfds):
                        fds[i].revents = 0
                    rc = poll(fds, nfds, ms)
                    for i in range(1, nfds):
                        readable = readable or (fds[i].revents & POLLIN) != 0
                if self.settings != NULL:
                    self.settings.asleep[self.shard] = 0
                done = self._drain()
        return done, readable

    def handle(self, records):
        """Handle completions given by Python (parked ones of a job served now; a slot found
        complete but not handled): ``records`` of (job_id, partition, round, scale_exp)."""
        for job_id, partition, rnd, scale in records:
            self.complete_one(job_id, partition, rnd, scale)
        with nogil:
            self.flush()

    # ------------------------------------------------------------------ answers (Python, rare)
    def result(self, int job_id, uint32_t local, uint32_t rnd):
        """The result packets of (owned partition ``local``, ``rnd``) rebuilt from its buffer, as
        (data (npk, stride) uint8, lengths int64), when it is its slot's base occupant and complete;
        None otherwise (not complete, settled past, or its completion not handled yet). Read-only:
        any shard may answer any slot; a settle racing with the read is caught by reading base_gen
        again (it is stored before anything is cleared)."""
        cdef int ji = self._find(job_id)
        cdef JobRt* j
        cdef uint32_t slot = 0, par, lo, n, partition
        cdef uint64_t gen, base
        cdef Py_ssize_t m, span, npk
        cdef bint dense
        cdef dosa_buf* b
        if ji < 0:
            return None
        j = &self.jobs[ji]
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
        m = self._entries(j, b, touched, lo, n, local, &oiv[0], &ovv[0], &riv[0], &rvv[0], &m_all)
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
        data = np.zeros((npk, self.stride), np.uint8)
        lengths = np.zeros(npk, np.int64)
        cdef uint8_t[:, ::1] dv = data
        cdef int64_t[::1] lv = lengths
        cdef Writer w = j.w
        w.rnd = rnd
        w.scale_exp = <int>j.g.ps[slot].scale_tag[par] - DOSA_SCALE_TAG_BIAS if j.g.ps[slot].scale_tag[par] else 0
        write_results(&dv[0, 0], &lv[0], &w, partition, lo, &oiv[0], &ovv[0], m, npk, dense)
        return data, lengths
