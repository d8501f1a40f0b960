# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The DPU worker's completion path, compiled: from a completion to the result packets on the wire.

For each completed (job, partition, round) in one nogil loop: settle the slot's previous occupant,
read the completed buffer's entries (gtopk's k of them), write the result packets into an arena,
keep the buffer as its shadow copy (dpu_fw/_shadow.pyx: settle, entries, compact, rebuild), and
every EMIT_CHUNK completions send the arena with UDP GSO to the job's multicast group or to each
host (``dosa._net.send_core``). No Python and no numpy call per completion: Python keeps the policy
(which jobs, their hosts, asks, the NACK scan, stats) and calls ``step`` for the data path.

In XDP mode the completions come from this shard's ring buffer, read through its mmap
(dpu_fw/_ring.pxd) and consumed only after their results are sent, so a worker
that dies mid-batch handles the same completions again when it restarts (the settle is
idempotent, a result sent twice is a duplicate the hosts drop). The shard asks the XDP program for
a wakeup (settings.asleep) only while it blocks: otherwise each completion would cost an IPI.
In userspace mode dpu_fw/_softmerge.pyx calls ``complete_one`` for the completions its merge finds.
"""
import numpy as np

from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memset

from dosa._net cimport (C_SEND_CALLS, C_SEND_DGRAMS, C_SENT_BYTES, C_SENT_PACKETS, N_COUNTERS, POLLIN,
                        now, poll, pollfd, send_core)

from ._jobrt cimport (MAX_JOBS, N_STATS, S_COMPLETION_UNKNOWN, S_COMPLETIONS, S_PACKET_LIMIT,
                      S_RESULT_ENTRIES, S_RESULT_PACKETS, S_SEND_ERRORS, JobRt)
from ._results cimport BITMAP_WORDS, packets_for, write_results
from ._ring cimport RingView, ring_commit, ring_empty, ring_read
from ._shadow cimport compact, entries, needs_scan, rebuild, settle
from ._state cimport (DOSA_BUF_SUMS, DOSA_F_GTOPK, DOSA_MAX_SHARDS, dosa_buf, dosa_completion, dosa_pstate,
                      dosa_settings, dosa_wstate, occupant)

from dosa import wire as _wire

cdef extern from *:
    """
    #define load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
    #define full_fence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
    """
    uint64_t load_acquire(const uint64_t* p) nogil
    void full_fence() nogil

#: the clocks an engine's time counters can run on (``engine.clock``)
CLOCK_WALL = CLOCK_MONOTONIC
CLOCK_THREAD_CPU = CLOCK_THREAD_CPUTIME_ID
#: jobs one engine serves at most
ENGINE_MAX_JOBS = MAX_JOBS
#: the names of a job's engine counters (the S_* slots of _jobrt.pxd), in order
ENGINE_STATS = ("completions", "result_packets", "result_entries", "completion_unknown",
                "settled", "send_errors", "packet_limit")
assert len(ENGINE_STATS) == N_STATS

cdef enum:
    EMIT_CHUNK = 32       # completions whose results are sent together: they reach the hosts
                          # while the next ones are built
    RING_BATCH = 1024     # completion records read from the ring per pass
    SCRATCH = 65536       # one partition's entries at most (DOSA_BUF_SUMS)

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
        self.ring.cons = <uint64_t*><size_t>cons
        self.ring.prod = <const uint64_t*><size_t>prod
        self.ring.data = <const uint8_t*><size_t>data
        self.ring.mask = size - 1
        self.ring.next_cons = load_acquire(self.ring.cons)
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
        """Whether a slot of this shard is in a state the NACK scan acts on (_shadow.needs_scan)."""
        cdef int ji = self._find(job_id)
        return ji >= 0 and needs_scan(&self.jobs[ji], <uint32_t>shard, <uint32_t>shards)

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
        settle(j, slot, gen)
        t1 = _clock_ns(self.clock)
        self.ns_settle += t1 - t0
        b = &j.g.bufs[slot * 2 + par]
        lo = partition * j.g.partition_size
        n = j.g.numel - lo if j.g.numel - lo < j.g.partition_size else j.g.partition_size
        ri = self.ri if j.gtopk else self.oi
        rv = self.rv if j.gtopk else self.ov
        m = entries(j, b, load_acquire(&j.g.ps[slot].touched[par]), lo, n, local, self.oi,
                    self.ov, ri, rv, &m_all, self.bits, self.topk_scratch)
        span = <Py_ssize_t>(ri[m - 1] - ri[0]) + 1 if m else 0
        npk = packets_for(m, span, &j.w, &dense)
        if npk < 0 or not self._room(npk):
            j.stats[S_PACKET_LIMIT] += 1
            return
        j.w.rnd = rnd
        j.w.scale_exp = scale
        write_results(self.arena + self.used * self.stride, self.lengths + self.used, &j.w,
                      partition, lo, ri, rv, m, npk, dense)
        compact(j, b, &j.g.ps[slot].touched[par], lo, ri, rv, m, self.oi, m_all)
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

    cdef Py_ssize_t _drain(self) noexcept nogil:
        """Every record waiting in the ring: handled EMIT_CHUNK at a time, then consumed."""
        cdef dosa_completion recs[RING_BATCH]
        cdef Py_ssize_t n, i, total = 0
        while True:
            n = ring_read(&self.ring, recs, RING_BATCH)
            if n == 0:
                break
            for i in range(n):
                self.complete_one(recs[i].job_id, recs[i].partition, recs[i].round, recs[i].scale_exp)
                if self.used and (i + 1) % EMIT_CHUNK == 0:
                    self.flush()
            self.flush()
            ring_commit(&self.ring)
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
                if ring_empty(&self.ring):
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
        """The result packets of (owned partition ``local``, ``rnd``) rebuilt from its shadow copy
        (dpu_fw/_shadow.pyx ``rebuild``), as (data (npk, stride) uint8, lengths int64); None when
        it cannot be answered now."""
        cdef int ji = self._find(job_id)
        if ji < 0:
            return None
        return rebuild(&self.jobs[ji], local, rnd, self.stride, self.bits, self.topk_scratch)
