# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled core of a host's allreduce round (host_lib/round.py drives it).

A round of a 25M-entry gradient at 1 % is ~760 data packets out and ~1,500 result packets in per
host; the four hosts of the testbed share one core, so every microsecond per packet or per wakeup is
paid four times. ``RoundEngine.pump`` runs the round's steady state without returning to Python:

1. **send**: the window (``window`` partitions in flight, never past a partition whose aggregation
   slot is still held: ``gate``, docs/dataplane.md *Slots*) goes out (host_lib/_window.pyx);
2. **receive**: recvmmsg on the job's multicast socket and the unicast socket (UDP GRO: one
   datagram carries many result packets), without blocking;
3. **intake**: every received packet is checked where it lies in the receive buffer, with the
   header rules the XDP program runs (``dosa_check_header`` of dosa/dosa_wire.h, generated from
   dosa.wire) plus the round's own (job, round, sender, partition, scale, indices inside the
   partition, one ``total`` per partition), and a new result packet's entries are decoded at once
   into the round's entry arena (host_lib/_arena.pyx). No copy of the packet is kept and nothing
   is decoded twice;
4. **wait** in ppoll on both sockets until something arrives or the deadline passes.

It returns to Python only when the round is done, a STATUS packet arrived (kept in ``side`` for
host_lib.round, which handles NACKs), partitions completed and the caller asked to hear about it
(a SparseStream's waiters), the deadline passed (the retransmission timers are Python's), or an
error. ``result(lo, hi)`` gathers partitions [lo, hi)'s entries from the arena in index order.

The numpy arrays ``sent``, ``done``, ``got``, ``res_total``, ``res_got``, ``last_tx``, ``done_at``
are shared with host_lib.round (its retransmission logic reads them and writes ``last_tx``); the
engine writes them only inside its own calls, so a caller that serializes calls (SparseStream's lock)
sees a consistent state.
"""
from libc.errno cimport errno, EAGAIN, EINTR
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

from dosa._net cimport (C_RECV_CALLS, C_RECV_DGRAMS, C_RECV_PACKETS, C_RECV_BYTES, C_TRUNCATED,
                        CTRL_SPACE, GRO_BUF, MSG_DONTWAIT, MSG_TRUNC, POLLIN, EWOULDBLOCK,
                        gro_prepare, gro_segment, iovec, mmsghdr, now, pollfd, recvmmsg, sockaddr_in)
from host_lib._arena cimport ResultArena
from host_lib._window cimport SendWindow

import numpy as np

cdef extern from "<poll.h>":
    int ppoll(pollfd* fds, unsigned long nfds, const timespec* tmo, const void* sigmask) nogil

cdef extern from "<time.h>":
    enum: CLOCK_THREAD_CPUTIME_ID

# a packet's fields and entries: only through the accessors generated from dosa.wire
# (dosa/dosa_wire.h, declared in dosa/dosa_wire.pxd), the header rules the XDP program runs included
from dosa.dosa_wire cimport (DOSA_DPU_SENDER_ID, DOSA_HDR_LEN, DOSA_MAX_PACKETS_PER_CONTRIBUTION,
                             DOSA_T_DENSE_RESULT, DOSA_T_SPARSE_RESULT, DOSA_T_STATUS, dosa_hdr,
                             dosa_check_header, dosa_hdr_base, dosa_hdr_count, dosa_hdr_job_id,
                             dosa_hdr_partition, dosa_hdr_round, dosa_hdr_scale_exp, dosa_hdr_seq,
                             dosa_hdr_total, dosa_hdr_type, dosa_hdr_worker_id, dosa_sparse_offset)


cdef enum:
    # pump() result bits
    F_DONE = 1, F_SIDE = 2, F_COMPLETED = 4, F_DEADLINE = 8, F_GSO_OFF = 16
    # stats slots: what the intake did with packets it did not take
    S_DUPLICATE = 0, S_OTHER, S_MALFORMED, S_SIDE_DROPPED
    # cpu slots: thread CPU seconds of the engine's phases
    CPU_SEND = 0, CPU_RECEIVE, CPU_INTAKE

#: pump() result bits: the round is done; STATUS packets wait in ``side``; partitions completed in
#: this call (``completed[:n_completed]``); the deadline passed; the path refused a GSO datagram
#: (the engine sends one datagram per packet from now on)
DONE, SIDE, COMPLETED, DEADLINE, GSO_OFF = F_DONE, F_SIDE, F_COMPLETED, F_DEADLINE, F_GSO_OFF
#: ``stats`` slots, in order
STATS = ("duplicate", "other", "malformed", "dropped")
#: ``cpu`` slots, in order (thread CPU seconds)
CPU = ("send", "receive", "intake")

cdef enum:
    NMSG = 64           # datagrams per recvmmsg
    MAXPK = DOSA_MAX_PACKETS_PER_CONTRIBUTION  # result packets of one partition (seq < total)
    SIDE_SLOTS = 256


cdef inline double thread_cpu() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class RoundEngine:
    """A host's round state and its send / receive / intake loop (module docstring).

    Args:
        P: partitions of the job; partition_size, numel: the job's index space.
        gate: per partition the one whose result must be in before it may be sent, or -1
            (int64[P]; host_lib.client computes it).
        job_id: the job; dpu_ip_be, dpu_port_be: each DPU's address in network byte order (a
            packet's ``dest`` indexes them).
        window: partitions in flight at most.
        gso: the endpoint's int64[1] GSO setting (dosa.transport.UdpEndpoint.gso: segments a
            datagram, 0 none), set to 0 by the send loop when the path refuses GSO.
        counters: the endpoint's int64 counters (dosa._net.COUNTERS) the engine adds to.
        seed: non-zero: every send goes out in a random order (a test aid: reordering).
    """

    cdef readonly Py_ssize_t P, partition_size, numel, window
    cdef readonly uint32_t job_id
    cdef int64_t[::1] ctr
    cdef SendWindow tx  # what may go out, and the sending
    cdef ResultArena arena  # what came back

    # shared with host_lib.round (numpy arrays) and their views
    cdef readonly object sent, done, got, res_total, res_got, last_tx, done_at, completed
    cdef readonly object stats, cpu
    cdef uint8_t[::1] done_v
    cdef uint8_t[:, ::1] got_v
    cdef int64_t[::1] res_total_v, res_got_v, completed_v, stats_v
    cdef double[::1] done_at_v, cpu_v

    # the round
    cdef readonly uint32_t round
    cdef readonly int scale_exp
    cdef readonly Py_ssize_t n_done, n_completed
    cdef readonly double last_progress
    cdef double t_last_done  # when the last partition completed

    # receiving
    cdef uint8_t* rxbuf
    cdef uint8_t* ctrl
    cdef mmsghdr* msgs
    cdef iovec* iov
    cdef sockaddr_in* addrs

    # STATUS packets for host_lib.round
    cdef readonly object side_data, side_len
    cdef uint8_t[:, ::1] side_v
    cdef int64_t[::1] side_len_v
    cdef readonly Py_ssize_t n_side

    # (C pointers of a cdef class start NULL: __dealloc__ frees only what __init__ allocated)
    def __init__(self, Py_ssize_t P, Py_ssize_t partition_size, Py_ssize_t numel, gate,
                 uint32_t job_id, dpu_ip_be, dpu_port_be, Py_ssize_t window, gso, counters,
                 uint64_t seed=0):
        if P < 1 or partition_size < 1 or numel < 1 or window < 1:
            raise ValueError("RoundEngine needs at least one partition, entry and window slot")
        self.P, self.partition_size, self.numel, self.window = P, partition_size, numel, window
        self.job_id = job_id
        self.ctr = counters
        self.sent = np.zeros(P, np.uint8)
        self.done = np.zeros(P, np.uint8)
        self.got = np.zeros((P, MAXPK), np.uint8)
        self.res_total = np.zeros(P, np.int64)
        self.res_got = np.zeros(P, np.int64)
        self.last_tx = np.zeros(P)
        self.done_at = np.zeros(P)
        self.completed = np.zeros(P, np.int64)
        self.stats = np.zeros(4, np.int64)
        self.cpu = np.zeros(3)
        self.done_v, self.got_v = self.done, self.got
        self.res_total_v, self.res_got_v = self.res_total, self.res_got
        self.done_at_v, self.completed_v = self.done_at, self.completed
        self.stats_v, self.cpu_v = self.stats, self.cpu
        self.tx = SendWindow(P, gate, dpu_ip_be, dpu_port_be, window, gso, counters, seed,
                             self.sent, self.last_tx, self.done)
        self.arena = ResultArena(P, partition_size, numel)
        self.rxbuf = <uint8_t*>malloc(NMSG * GRO_BUF)
        self.ctrl = <uint8_t*>calloc(NMSG, CTRL_SPACE)
        self.msgs = <mmsghdr*>calloc(NMSG, sizeof(mmsghdr))
        self.iov = <iovec*>calloc(NMSG, sizeof(iovec))
        self.addrs = <sockaddr_in*>calloc(NMSG, sizeof(sockaddr_in))
        if not (self.rxbuf and self.ctrl and self.msgs and self.iov and self.addrs):
            raise MemoryError()
        self.side_data = np.zeros((SIDE_SLOTS, 3584), np.uint8)
        self.side_len = np.zeros(SIDE_SLOTS, np.int64)
        self.side_v, self.side_len_v = self.side_data, self.side_len

    def __dealloc__(self):
        free(self.rxbuf); free(self.ctrl); free(self.msgs); free(self.iov); free(self.addrs)

    # ------------------------------------------------------------------ the round's state
    def begin(self, uint32_t round, int scale_exp, Py_ssize_t released):
        """Start round ``round`` (every state array zeroed, the arena emptied); partitions
        [0, released) may be sent once their packets are loaded."""
        self.round = round
        self.scale_exp = scale_exp
        self.tx.reset(released)
        self.arena.reset()
        self.n_done = self.n_completed = self.n_side = 0
        self.sent[:] = 0
        self.done[:] = 0
        self.got[:] = 0
        self.res_total[:] = 0
        self.res_got[:] = 0
        self.last_tx[:] = 0
        self.done_at[:] = 0
        self.last_progress = now()

    def dense_output(self, out, clear):
        """Write every partition's result into ``out`` (float32, numel entries) the moment the
        partition completes, after zeroing there the indices ``clear`` (ResultArena.dense_output).
        For this round only: call after ``begin``, before the first ``pump``."""
        if self.n_done:
            raise ValueError("dense_output: partitions of this round are in already")
        self.arena.dense_output(out, clear, self.scale_exp)

    def load(self, data, lengths, dest, pk_start):
        """The round's data packets (SendWindow.load)."""
        self.tx.load(data, lengths, dest, pk_start)

    def lose_once(self, rows):
        """A test aid (like a drop simulator in a dataplane): the next send of each packet row in
        ``rows`` is skipped, as if the wire had lost it (SendWindow.lose_once)."""
        self.tx.lose_once(rows)

    def release(self, Py_ssize_t upto):
        """Partitions [0, upto) may be sent (a SparseStream hands them over in order)."""
        self.tx.release(upto)

    @property
    def released(self) -> int:
        return self.tx.released

    @property
    def next(self) -> int:
        return self.tx.next

    @property
    def inflight(self) -> int:
        return self.tx.inflight

    @property
    def complete(self) -> bool:
        return self.n_done == self.P

    # ------------------------------------------------------------------ send
    cdef int _fill(self, int fd, int* flags) noexcept nogil:
        """Send what the window allows (module docstring, step 1); GSO_OFF into ``flags``."""
        cdef bint gso_off = False
        cdef int err = self.tx.fill(fd, &gso_off)
        if gso_off:
            flags[0] |= F_GSO_OFF
        return err

    def fill(self, int fd):
        """Send what the window allows now (SparseStream.send); returns the pump() flags."""
        cdef int flags = 0, err
        with nogil:
            err = self._fill(fd, &flags)
        if err:
            self._raise_send(err)
        return flags

    def _raise_send(self, int err):
        import os
        if err == -1:
            raise OSError(0, "the send buffer stayed full for 2 s (the DPU side is not draining)")
        raise OSError(err, f"round I/O failed: {os.strerror(err)}")

    # ------------------------------------------------------------------ intake
    cdef void _take(self, const uint8_t* pk, Py_ssize_t plen) noexcept nogil:
        """One received packet (module docstring, step 3)."""
        cdef uint32_t typ, part, seq, total, count, base, idx, j
        cdef int64_t lo, hi
        cdef bint sparse
        if plen < DOSA_HDR_LEN:
            self.stats_v[S_MALFORMED] += 1
            return
        part = dosa_hdr_partition(pk)
        if dosa_hdr_job_id(pk) != self.job_id or dosa_hdr_round(pk) != self.round \
                or dosa_hdr_worker_id(pk) != <uint32_t>DOSA_DPU_SENDER_ID or part >= <uint32_t>self.P:
            self.stats_v[S_OTHER] += 1  # another job's, round's or sender's: not ours to judge
            return
        typ = dosa_hdr_type(pk)
        if typ == <uint32_t>DOSA_T_STATUS:
            if self.n_side < SIDE_SLOTS and plen <= self.side_v.shape[1]:
                memcpy(&self.side_v[self.n_side, 0], pk, plen)
                self.side_len_v[self.n_side] = plen
                self.n_side += 1
            else:
                self.stats_v[S_SIDE_DROPPED] += 1
            return
        if (typ != <uint32_t>DOSA_T_SPARSE_RESULT and typ != <uint32_t>DOSA_T_DENSE_RESULT) \
                or dosa_hdr_scale_exp(pk) != self.scale_exp:
            self.stats_v[S_OTHER] += 1
            return
        if dosa_check_header(<const dosa_hdr*>pk, <uint32_t>plen) != -1:
            self.stats_v[S_MALFORMED] += 1
            return
        seq = dosa_hdr_seq(pk)
        count = dosa_hdr_count(pk)
        total = dosa_hdr_total(pk)
        base = dosa_hdr_base(pk)
        # the rules hold: 1 <= total <= MAXPK, seq < total, count fits the packet
        if self.done_v[part] or self.got_v[part, seq]:
            self.stats_v[S_DUPLICATE] += 1
            return
        if self.res_got_v[part] and <uint32_t>self.res_total_v[part] != total:
            self.stats_v[S_MALFORMED] += 1  # one partition's packets disagree on their total
            return
        lo = <int64_t>part * self.partition_size
        hi = lo + self.partition_size
        if hi > self.numel:
            hi = self.numel
        sparse = typ == <uint32_t>DOSA_T_SPARSE_RESULT
        if sparse:
            for j in range(count):  # every index inside the partition, or the packet is dropped
                idx = base + dosa_sparse_offset(pk, count, j)
                if <int64_t>idx < lo or <int64_t>idx >= hi:
                    self.stats_v[S_MALFORMED] += 1
                    return
        elif count and (<int64_t>base < lo or <int64_t>base + count > hi):
            self.stats_v[S_MALFORMED] += 1
            return
        if self.arena.store(pk, sparse, count, base, part * MAXPK + seq) < 0:
            self.stats_v[S_SIDE_DROPPED] += 1  # out of memory: the timers ask again
            return
        self.got_v[part, seq] = 1
        self.res_total_v[part] = total
        self.res_got_v[part] += 1
        if self.res_got_v[part] >= total:
            self.done_v[part] = 1
            self.t_last_done = now()
            self.done_at_v[part] = self.t_last_done
            self.n_done += 1
            self.tx.partition_done(part)
            self.completed_v[self.n_completed] = part
            self.n_completed += 1
            if self.arena.has_dense:
                self.arena.write_dense(part, total)

    def intake(self, const uint8_t[:, ::1] data, const int64_t[::1] lengths, Py_ssize_t n):
        """Take packets 0..n-1 of a batch as if they had been received (the socket path runs the
        same code on its receive buffer). Returns the pump() flags: SIDE, COMPLETED, DONE."""
        cdef Py_ssize_t i, c0 = self.n_completed, s0 = self.n_side
        if n > data.shape[0] or n > lengths.shape[0]:
            raise ValueError("intake: n exceeds the batch")
        with nogil:
            for i in range(n):
                if 0 <= lengths[i] <= data.shape[1]:
                    self._take(&data[i, 0], lengths[i])
                else:
                    self.stats_v[S_MALFORMED] += 1
        if self.n_completed > c0:
            self.last_progress = self.t_last_done
        return ((F_SIDE if self.n_side > s0 else 0) | (F_COMPLETED if self.n_completed > c0 else 0)
                | (F_DONE if self.n_done == self.P else 0))

    # ------------------------------------------------------------------ receive
    cdef Py_ssize_t _recv(self, int fd, int* err) noexcept nogil:
        """One recvmmsg without waiting; every packet of every datagram goes through _take.
        Returns the datagrams read."""
        cdef int rc, k, seg
        cdef Py_ssize_t dlen, off, l
        cdef uint8_t* p
        cdef double t0 = thread_cpu(), t1
        gro_prepare(self.msgs, self.iov, self.addrs, self.rxbuf, self.ctrl, NMSG)
        rc = recvmmsg(fd, self.msgs, NMSG, MSG_DONTWAIT, NULL)
        t1 = thread_cpu()
        self.cpu_v[CPU_RECEIVE] += t1 - t0
        if rc < 0:
            if errno != EAGAIN and errno != EWOULDBLOCK and errno != EINTR:
                err[0] = errno
            return 0
        if rc == 0:
            return 0
        self.ctr[C_RECV_CALLS] += 1
        self.ctr[C_RECV_DGRAMS] += rc
        for k in range(rc):
            dlen = self.msgs[k].msg_len
            p = self.rxbuf + <Py_ssize_t>k * GRO_BUF
            if self.msgs[k].msg_hdr.msg_flags & MSG_TRUNC:
                self.ctr[C_TRUNCATED] += 1
                self.ctr[C_RECV_PACKETS] += 1
                continue
            seg = gro_segment(&self.msgs[k])
            if seg <= 0:
                seg = <int>dlen
            self.ctr[C_RECV_BYTES] += dlen
            off = 0
            while off < dlen or (dlen == 0 and off == 0):
                l = dlen - off
                if l > seg:
                    l = seg
                self.ctr[C_RECV_PACKETS] += 1
                self._take(p + off, l)
                off += l
                if dlen == 0:
                    break
        self.cpu_v[CPU_INTAKE] += thread_cpu() - t1
        return rc

    cdef int _wait(self, int fd, int mfd, double deadline) noexcept nogil:
        """ppoll on both sockets until one is readable or the deadline passes: 1, 0, -errno."""
        cdef pollfd pf[2]
        cdef int nf = 1, rc
        cdef timespec ts
        cdef double left
        pf[0].fd = fd
        pf[0].events = POLLIN
        pf[0].revents = 0
        if mfd >= 0:
            pf[1].fd = mfd
            pf[1].events = POLLIN
            pf[1].revents = 0
            nf = 2
        while True:
            left = deadline - now()
            if left <= 0:
                return 0
            ts.tv_sec = <long>left
            ts.tv_nsec = <long>((left - ts.tv_sec) * 1e9)
            rc = ppoll(pf, nf, &ts, NULL)
            if rc > 0:
                return 1
            if rc == 0:
                return 0
            if errno != EINTR:
                return -errno

    def wait(self, int fd, int mfd, double timeout):
        """Wait (GIL released) until a socket is readable or ``timeout`` s pass; True if readable."""
        cdef int rc
        with nogil:
            rc = self._wait(fd, mfd, now() + timeout)
        if rc < 0:
            import os
            raise OSError(-rc, f"ppoll failed: {os.strerror(-rc)}")
        return rc > 0

    def pump(self, int fd, int mfd, double timeout, bint return_on_completion=False,
             double quiet=0.0):
        """Run the round (send, receive, intake, wait) until it is done, a STATUS arrived,
        ``timeout`` seconds passed, or, with ``return_on_completion``, a partition completed;
        with ``quiet`` > 0 also when partitions completed in this call and then none for
        ``quiet`` seconds (the moment a gap in the results becomes visible: the caller's
        retransmission timers count from the last completion). ``mfd`` is the multicast socket
        (-1: none). ``timeout`` 0: one non-blocking pass. Returns DONE / SIDE / COMPLETED /
        DEADLINE / GSO_OFF bits. ``completed[:n_completed]`` lists the partitions completed since
        the last call (reset at every call)."""
        cdef int flags = 0, err = 0, w = 0
        cdef Py_ssize_t got
        cdef double deadline = now() + timeout, t0, until
        self.n_completed = 0
        self.n_side = 0
        with nogil:
            while True:
                t0 = thread_cpu()
                err = self._fill(fd, &flags)
                self.cpu_v[CPU_SEND] += thread_cpu() - t0
                if err or self.n_done == self.P:
                    break
                got = 0
                if mfd >= 0:
                    got += self._recv(mfd, &err)
                if not err:
                    got += self._recv(fd, &err)
                if err or self.n_side or self.n_done == self.P:
                    break
                if self.n_completed and return_on_completion:
                    break
                until = deadline
                if quiet > 0 and self.n_completed and self.t_last_done + quiet < until:
                    until = self.t_last_done + quiet
                if now() >= until:  # also while packets keep coming: the timers are Python's
                    flags |= F_DEADLINE
                    break
                if got:
                    continue
                t0 = thread_cpu()
                w = self._wait(fd, mfd, until)
                self.cpu_v[CPU_RECEIVE] += thread_cpu() - t0
                if w < 0:
                    err = -w
                    break
        if self.n_completed:
            self.last_progress = self.t_last_done
        if err:
            self._raise_send(err)
        if self.n_side:
            flags |= F_SIDE
        if self.n_completed:
            flags |= F_COMPLETED
        if self.n_done == self.P:
            flags |= F_DONE
        return flags

    # ------------------------------------------------------------------ the result
    def result(self, Py_ssize_t lo=0, Py_ssize_t hi=-1):
        """(indices u32, sums int32) of partitions [lo, hi) (default all), in index order; every
        one of them must be done (ResultArena.gather)."""
        if hi < 0:
            hi = self.P
        if not 0 <= lo <= hi <= self.P:
            raise ValueError(f"result: partitions {lo}..{hi} outside 0..{self.P}")
        for p in range(lo, hi):
            if not self.done_v[p]:
                raise ValueError(f"result: partition {p} is not complete")
        return self.arena.gather(lo, hi, self.res_total_v)
