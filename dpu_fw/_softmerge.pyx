# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The userspace merge, compiled: the XDP program's rules (dataplane/dosa_xdp.c) run by the DPU
worker on its own socket, for a DPU without XDP (no privilege, another OS) or a GPU machine's
loopback worker.

One ``step`` reads datagrams with recvmmsg (UDP GRO: one datagram may carry many packets), checks
each packet where it lies (``dosa_check_header``, the job, the worker's source, ownership, the
slot's window), claims its seq (dedup), adds its entries into the job's buffer (saturating at
+-(2^31 - 1)), lists its offsets (the touched list), and when the last worker's last packet of a
partition is in, hands the completion to the shard's CompletionEngine, which settles, builds and
sends the result before the step returns. No Python per packet. What the merge does not consume
(RETX_REQUEST, HEARTBEAT, duplicates of a complete round, packets of a job not served yet) is
copied out for the worker's Python policy (``passed``).

The state has the dataplane's layout (dataplane/dosa_state.h: the same buffers, slot and worker
states), in this process's memory, so the completion path, the NACK scan and the answers are the
same code in both modes. A process owns its partitions alone (one shard per partition % shards,
steered by the socket group's reuseport program), so nothing here needs an atomic. The kernel
steers a datagram by its first packet, and a GSO datagram that reaches the DPU unsegmented (veth and
loopback hand them over whole) may carry packets of other shards' partitions: those are dropped and
counted as ``wrong_shard`` (their hosts resend them; a DPU whose shards see many should have its
senders' datagrams segmented before it, as a real NIC does).
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from dosa._net cimport (C_RECV_BYTES, C_RECV_CALLS, C_RECV_DGRAMS, C_RECV_PACKETS, GRO_BUF,
                        CTRL_SPACE, MSG_DONTWAIT, MSG_TRUNC, POLLIN, gro_prepare, gro_segment,
                        iovec, mmsghdr, poll, pollfd, recvmmsg, sockaddr_in)

from ._completion cimport CompletionEngine
from ._jobrt cimport MAX_JOBS, JobRt
from ._state cimport (DOSA_BUF_SUMS, DOSA_C_BAD_SOURCE, DOSA_C_BAD_TYPE, DOSA_C_DUPLICATE,
                      DOSA_C_INDEX_OUT_OF_PARTITION, DOSA_C_MERGED, DOSA_C_MERGED_ENTRIES,
                      DOSA_C_NOT_OWNER, DOSA_C_PASS_CONTROL,
                      DOSA_C_PASS_DUP_OF_COMPLETE, DOSA_C_ROUND_TOO_NEW, DOSA_C_ROUND_TOO_OLD,
                      DOSA_C_SATURATED_SUMS, DOSA_C_SCALE_MISMATCH, DOSA_C_SHORT_PACKET,
                      DOSA_C_TOTAL_MISMATCH, DOSA_C_UNKNOWN_JOB, DOSA_C_WRONG_SHARD, DOSA_C_UNKNOWN_WORKER,
                      DOSA_C_BAD_FIELD, DOSA_HDR_LEN, DOSA_NUM_COUNTERS, DOSA_SCALE_TAG_BIAS,
                      DOSA_T_DENSE_DATA, DOSA_T_DENSE_RESULT, DOSA_T_SPARSE_DATA,
                      DOSA_T_SPARSE_RESULT, DOSA_T_STATUS, DOSA_T_HEARTBEAT, JobGeo, SUM_LIMIT, dosa_buf,
                      dosa_check_header, dosa_hdr, dosa_ntohl, dosa_ntohs, dosa_pstate,
                      dosa_wstate, occupant)

cdef enum:
    NMSG = 64           # datagrams per recvmmsg
    PASS_SLOTS = 1024   # packets handed to Python per step at most (the rest are counted dropped)
    PASS_STRIDE = 3520  # a packet of the largest MTU


cdef inline int64_t _clamp(int64_t t, int64_t* sat) noexcept nogil:
    if t > SUM_LIMIT:
        sat[0] += 1
        return SUM_LIMIT
    if t < -SUM_LIMIT:
        sat[0] += 1
        return -SUM_LIMIT
    return t


cdef class SoftMerge:
    """The merge of one userspace DPU worker shard. ``engine``: its CompletionEngine (which holds
    the jobs, their state and their hosts: add jobs there). ``fds``: the sockets to read."""

    cdef CompletionEngine engine
    cdef int fds[2]
    cdef int nfds
    cdef uint8_t* buf
    cdef uint8_t* ctrl
    cdef mmsghdr* msgs
    cdef iovec* iov
    cdef sockaddr_in* addrs
    cdef int64_t* counters
    cdef int64_t* verdicts     # (MAX_JOBS + 1) x DOSA_NUM_COUNTERS: per engine job slot, the last
                               # row for packets of no job served here
    cdef int row               # the row of the packet _merge is looking at
    cdef object _refs
    # packets for Python
    cdef public object passed_data, passed_lengths, passed_ip, passed_port
    cdef uint8_t* pd
    cdef int64_t* pl
    cdef uint32_t* pip
    cdef uint16_t* pport
    cdef Py_ssize_t npassed
    cdef public int64_t ns_merge, merged_entries
    cdef readonly int shard, shards

    def __cinit__(self, CompletionEngine engine, fds, int64_t[::1] counters, int64_t[:, ::1] verdicts,
                  int shard=0, int shards=1):
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} of {shards}")
        self.shard, self.shards = shard, shards
        if verdicts.shape[0] < MAX_JOBS + 1 or verdicts.shape[1] < DOSA_NUM_COUNTERS:
            raise ValueError("verdicts must hold every dosa counter for every job slot and one more")
        self.engine = engine
        fds = list(fds)[:2]
        self.nfds = len(fds)
        for i, f in enumerate(fds):
            self.fds[i] = f
        self._refs = (counters, verdicts)
        self.counters = &counters[0]
        self.verdicts = &verdicts[0, 0]
        self.buf = <uint8_t*>calloc(NMSG, GRO_BUF)
        self.ctrl = <uint8_t*>calloc(NMSG, CTRL_SPACE)
        self.msgs = <mmsghdr*>calloc(NMSG, sizeof(mmsghdr))
        self.iov = <iovec*>calloc(NMSG, sizeof(iovec))
        self.addrs = <sockaddr_in*>calloc(NMSG, sizeof(sockaddr_in))
        if not (self.buf and self.ctrl and self.msgs and self.iov and self.addrs):
            raise MemoryError()
        self.passed_data = np.zeros((PASS_SLOTS, PASS_STRIDE), np.uint8)
        self.passed_lengths = np.zeros(PASS_SLOTS, np.int64)
        self.passed_ip = np.zeros(PASS_SLOTS, np.uint32)
        self.passed_port = np.zeros(PASS_SLOTS, np.uint16)
        cdef uint8_t[:, ::1] d = self.passed_data
        cdef int64_t[::1] l = self.passed_lengths
        cdef uint32_t[::1] a = self.passed_ip
        cdef uint16_t[::1] p = self.passed_port
        self.pd, self.pl, self.pip, self.pport = &d[0, 0], &l[0], &a[0], &p[0]

    def __dealloc__(self):
        free(self.buf); free(self.ctrl); free(self.msgs); free(self.iov); free(self.addrs)

    cdef void _pass(self, const uint8_t* pk, Py_ssize_t n, uint32_t ip, uint16_t port) noexcept nogil:
        if self.npassed >= PASS_SLOTS or n > PASS_STRIDE:
            return
        memcpy(self.pd + self.npassed * PASS_STRIDE, pk, n)
        self.pl[self.npassed] = n
        self.pip[self.npassed] = ip
        self.pport[self.npassed] = port
        self.npassed += 1

    cdef int _merge(self, const uint8_t* pk, Py_ssize_t n, uint32_t ip, uint16_t port) noexcept nogil:
        """One packet through the dataplane's rules; returns its verdict (a dosa counter)."""
        cdef dosa_hdr h
        cdef int bad, ji
        cdef JobRt* j
        cdef uint32_t w, p, local, slot = 0, par, cnt, seq, total, k, o, lo, hi, base
        cdef uint64_t gen, gbase, bit
        cdef int64_t sat = 0, t
        cdef dosa_pstate* ps
        cdef dosa_wstate* ws
        cdef dosa_buf* b
        cdef const uint8_t* offs
        cdef const uint8_t* vals
        cdef uint64_t pos, words, tag
        cdef uint16_t* lst
        cdef int32_t v
        self.row = MAX_JOBS
        if n < DOSA_HDR_LEN:
            return DOSA_C_SHORT_PACKET
        memcpy(&h, pk, sizeof(dosa_hdr))
        bad = dosa_check_header(&h, <uint32_t>n)
        if bad >= 0:
            return bad
        if h.type == DOSA_T_SPARSE_RESULT or h.type == DOSA_T_DENSE_RESULT or h.type == DOSA_T_STATUS:
            return DOSA_C_BAD_TYPE
        ji = self.engine._find(dosa_ntohl(h.job_id))
        if ji < 0:
            self._pass(pk, n, ip, port)  # the worker looks the job up (discovery) and counts it
            return DOSA_C_UNKNOWN_JOB
        j = &self.engine.jobs[ji]
        self.row = ji
        w = dosa_ntohs(h.worker_id)
        if w >= j.g.workers or w >= j.nhosts:
            return DOSA_C_UNKNOWN_WORKER
        if j.host_ip[w] != ip or j.host_port[w] != port:
            return DOSA_C_BAD_SOURCE
        p = dosa_ntohs(h.partition)
        if self.shards > 1 and h.type != DOSA_T_HEARTBEAT and p % self.shards != self.shard:
            return DOSA_C_WRONG_SHARD  # another shard's partition: its state is not here
        if h.type != DOSA_T_SPARSE_DATA and h.type != DOSA_T_DENSE_DATA:
            self._pass(pk, n, ip, port)
            return DOSA_C_PASS_CONTROL
        # locate
        if p >= j.g.num_partitions:
            return DOSA_C_BAD_FIELD
        if p % j.g.num_dpus != j.g.dpu_index:
            return DOSA_C_NOT_OWNER
        local = p / j.g.num_dpus
        gen = occupant(&j.g, local, dosa_ntohl(h.round), &slot)
        ps = &j.g.ps[slot]
        gbase = ps.base_gen
        if gen < gbase:
            return DOSA_C_ROUND_TOO_OLD
        if gen - gbase > 1:
            return DOSA_C_ROUND_TOO_NEW
        par = gen & 1
        ws = &j.g.ws[(slot * 2 + par) * j.g.workers + w]
        b = &j.g.bufs[slot * 2 + par]
        lo = p * j.g.partition_size
        hi = lo + j.g.partition_size if lo + j.g.partition_size < j.g.numel else j.g.numel
        cnt = dosa_ntohs(h.count)
        base = dosa_ntohl(h.base)
        offs = pk + DOSA_HDR_LEN
        vals = pk + DOSA_HDR_LEN + (2 * cnt + 2 * (cnt & 1) if h.type == DOSA_T_SPARSE_DATA else 0)
        # every index inside the partition
        if h.type == DOSA_T_SPARSE_DATA:
            for k in range(cnt):
                o = base + ((<uint32_t>offs[2 * k] << 8) | offs[2 * k + 1])
                if o < lo or o >= hi:
                    return DOSA_C_INDEX_OUT_OF_PARTITION
        elif base < lo or base + cnt > hi:
            return DOSA_C_INDEX_OUT_OF_PARTITION
        # claim: the worker's total, the round's scale, then the seq's dedup bit
        seq = dosa_ntohs(h.seq)
        total = dosa_ntohs(h.total)
        if ws.total != 0 and ws.total != total:
            return DOSA_C_TOTAL_MISMATCH
        tag = <uint64_t>(<int64_t>h.scale_exp + DOSA_SCALE_TAG_BIAS)
        if ps.scale_tag[par] != 0 and ps.scale_tag[par] != tag:
            return DOSA_C_SCALE_MISMATCH
        bit = (<uint64_t>1) << (seq & 63)
        if ws.seen[(seq >> 6) & 3] & bit:
            if ps.workers_done[par] >= j.g.workers:
                self._pass(pk, n, ip, port)  # the worker answers it with the result
                return DOSA_C_PASS_DUP_OF_COMPLETE
            return DOSA_C_DUPLICATE
        ws.total = total
        ps.scale_tag[par] = tag
        ws.seen[(seq >> 6) & 3] |= bit
        # the adds, saturating, and the touched list
        for k in range(cnt):
            v = <int32_t>((<uint32_t>vals[4 * k] << 24) | (<uint32_t>vals[4 * k + 1] << 16) |
                          (<uint32_t>vals[4 * k + 2] << 8) | vals[4 * k + 3])
            if h.type == DOSA_T_SPARSE_DATA:
                o = base + ((<uint32_t>offs[2 * k] << 8) | offs[2 * k + 1]) - lo
            else:
                o = base + k - lo
            b.sums[o] = <int32_t>_clamp(<int64_t>b.sums[o] + v, &sat)
        if j.g.list_cap:
            if h.type == DOSA_T_SPARSE_DATA and base == lo:
                words = (cnt + 3) / 4
                pos = ps.touched[par]
                ps.touched[par] = pos + 4 * words
                if pos + 4 * words <= j.g.list_cap:
                    lst = <uint16_t*>b.list
                    for k in range(cnt):
                        lst[pos + k] = (<uint16_t>offs[2 * k] << 8) | offs[2 * k + 1]
            else:
                ps.touched[par] += j.g.list_cap + 1
        # finish
        self.verdicts[ji * DOSA_NUM_COUNTERS + DOSA_C_MERGED_ENTRIES] += cnt
        self.verdicts[ji * DOSA_NUM_COUNTERS + DOSA_C_SATURATED_SUMS] += sat
        self.merged_entries += cnt
        ws.received += 1
        if ws.received == total:
            ps.workers_done[par] += 1
            if ps.workers_done[par] == j.g.workers:  # (the engine counts the completion)
                self.engine.complete_one(j.g.job_id, p, dosa_ntohl(h.round), h.scale_exp)
        return DOSA_C_MERGED

    cdef Py_ssize_t _recv_once(self, int fd) noexcept nogil:
        """One recvmmsg on ``fd`` (not waiting): every packet merged or passed. Returns the
        datagrams read (0: nothing waiting, -1: an error)."""
        cdef int rc, k, seg, verdict
        cdef Py_ssize_t dlen, off, l
        cdef uint8_t* d
        cdef uint32_t ip
        cdef uint16_t port
        gro_prepare(self.msgs, self.iov, self.addrs, self.buf, self.ctrl, NMSG)
        rc = recvmmsg(fd, self.msgs, NMSG, MSG_DONTWAIT, NULL)
        if rc <= 0:
            return 0 if rc == 0 else -1
        self.counters[C_RECV_CALLS] += 1
        self.counters[C_RECV_DGRAMS] += rc
        for k in range(rc):
            dlen = self.msgs[k].msg_len
            if self.msgs[k].msg_hdr.msg_flags & MSG_TRUNC:
                continue
            seg = gro_segment(&self.msgs[k])
            if seg <= 0:
                seg = <int>dlen
            d = self.buf + <Py_ssize_t>k * GRO_BUF
            ip = self.addrs[k].sin_addr.s_addr
            port = self.addrs[k].sin_port
            off = 0
            while off < dlen:
                l = dlen - off if dlen - off < seg else seg
                verdict = self._merge(d + off, l, ip, port)
                if verdict >= 0 and verdict < DOSA_NUM_COUNTERS:
                    self.verdicts[self.row * DOSA_NUM_COUNTERS + verdict] += 1
                self.counters[C_RECV_PACKETS] += 1
                self.counters[C_RECV_BYTES] += l
                off += l
        return rc

    def merge_batch(self, const uint8_t[:, ::1] data, const int64_t[::1] lengths,
                    const uint32_t[::1] src_ip_be, const uint16_t[::1] src_port_be):
        """The packets of a PacketBatch (``data``/``lengths``) from the given sources, merged as
        if received (tests, ``dosa bench dpu``); completions are built and sent before it returns.
        Returns each packet's verdict (a dosa.counters.Counter value) and the packets passed up."""
        cdef Py_ssize_t n = lengths.shape[0], i
        verdicts = np.empty(n, np.int64)
        cdef int64_t[::1] vv = verdicts
        cdef int v
        if data.shape[0] < n or src_ip_be.shape[0] < n or src_port_be.shape[0] < n:
            raise ValueError("every packet needs its data row and source")
        self.npassed = 0
        with nogil:
            for i in range(n):
                v = self._merge(&data[i, 0], lengths[i], src_ip_be[i], src_port_be[i])
                vv[i] = v
                if v >= 0 and v < DOSA_NUM_COUNTERS:
                    self.verdicts[self.row * DOSA_NUM_COUNTERS + v] += 1
            self.engine.flush()
        return verdicts, self.npassed

    def step(self, double timeout, int budget=64):
        """Merge what waits on the sockets (up to ``budget`` recvmmsg calls), waiting up to
        ``timeout`` seconds for the first packet; completions are built and sent before it returns.
        Returns the packets passed to Python (``passed_*[:n]``)."""
        cdef pollfd pf[2]
        cdef int i, calls = 0
        cdef Py_ssize_t got, total
        cdef int ms = <int>(timeout * 1000 + 0.999) if timeout > 0 else 0  # ceil: a sub-ms wait must wait
        cdef int64_t t0
        self.npassed = 0
        with nogil:
            while calls < budget:
                total = 0
                for i in range(self.nfds):
                    got = self._recv_once(self.fds[i])
                    if got > 0:
                        total += got
                        calls += 1
                if total == 0:
                    break
                self.engine.flush()
            if calls == 0 and ms > 0:
                for i in range(self.nfds):
                    pf[i].fd = self.fds[i]
                    pf[i].events = POLLIN
                    pf[i].revents = 0
                if poll(pf, self.nfds, ms) > 0:
                    for i in range(self.nfds):
                        self._recv_once(self.fds[i])
                    self.engine.flush()
        return self.npassed
