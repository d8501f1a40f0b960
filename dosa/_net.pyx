# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Batched UDP send/receive over a PacketBatch buffer: UDP GSO and GRO on top of sendmmsg/recvmmsg.

Send (:func:`send_batch`): consecutive rows to the same destination with equal lengths (the last of
a run may be shorter) become one GSO datagram (a ``UDP_SEGMENT`` control message, one iovec per
packet slot, at most ``gso_segs`` segments and 65,507 bytes); the kernel cuts it into the original
packets below the socket (on a real NIC: in the NIC), so the wire sees exactly the packets of the
batch. Up to 1024 such datagrams go in one sendmmsg. Without GSO (or once the path refused it) one
datagram per packet.

Receive: :class:`GroReceiver` reads a socket with ``UDP_GRO`` on: one datagram may carry many
equal-size segments (the size comes in a SOL_UDP/UDP_GRO control message); they are split back into
one packet slot each, and what does not fit the caller's slots is kept for the next call.
:func:`recv_batch` is the plain recvmmsg path (one datagram per slot) for sockets without GRO.

The GIL is released for the whole call, including the waits in poll(). The socket must be
non-blocking: a full send buffer (EAGAIN/ENOBUFS) waits in poll(POLLOUT) until ``timeout`` runs out.
Public wrapper: ``dosa/transport.py`` (UdpEndpoint), which probes GSO/GRO once and falls back.
"""
from libc.errno cimport errno, EAGAIN, EINTR

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset, memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

# the socket structures, calls and constants are declared in dosa/_net.pxd (shared with
# host_lib/_engine.pyx)

#: What the kernel accepts per GSO datagram (UDP_MAX_SEGMENTS is 64 on older kernels, 128 since 6.x).
MAX_GSO_SEGMENTS = 64
SOL_UDP = SOL_UDP_
UDP_SEGMENT = UDP_SEGMENT_
UDP_GRO = UDP_GRO_
#: an endpoint's counter slots in order (the C_* slots of dosa/_net.pxd): dosa.transport's
#: UdpEndpoint.counters holds one int64 for each, host_lib's round engine adds to the same array
COUNTERS = ("send_calls", "send_datagrams", "sent_packets", "sent_bytes", "recv_calls",
            "recv_datagrams", "recv_packets", "recv_bytes", "truncated")
assert len(COUNTERS) == N_COUNTERS and COUNTERS.index("truncated") == C_TRUNCATED


cdef double now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int wait_fd(int fd, short events, double deadline) noexcept nogil:
    """poll() until fd is ready or the deadline passes. 1 ready, 0 timed out, -1 error (errno)."""
    cdef pollfd pfd
    cdef int ms, rc
    while True:
        ms = <int>((deadline - now()) * 1000.0 + 0.999)
        if ms < 0:
            ms = 0
        pfd.fd = fd
        pfd.events = events
        pfd.revents = 0
        rc = poll(&pfd, 1, ms)
        if rc > 0:
            return 1
        if rc == 0:
            return 0
        if errno != EINTR:
            return -1


cdef int recvmmsg_wait(int fd, mmsghdr* msgs, unsigned int n, double deadline, int* err) noexcept nogil:
    """recvmmsg without blocking, polling until something arrives or ``deadline`` passes. Returns
    the datagrams received (0: timed out); on an error returns 0 with ``err[0]`` set to errno."""
    cdef int rc, w
    while True:
        rc = recvmmsg(fd, msgs, n, MSG_DONTWAIT, NULL)
        if rc >= 0:
            return rc
        if errno == EINTR:
            continue
        if errno != EAGAIN and errno != EWOULDBLOCK:
            err[0] = errno
            return 0
        w = wait_fd(fd, POLLIN, deadline)
        if w == 0:
            return 0
        if w < 0:
            err[0] = errno
            return 0


def _os_error(int err, str what, Py_ssize_t sent):
    import os
    e = OSError(err, f"{what} failed: {os.strerror(err)}")
    e.sent = sent  # packets sent before the error: the caller may resend the rest another way
    return e


cdef inline bint gso_refused(int err) noexcept nogil:
    """errnos with which a path refuses a GSO datagram (no checksum offload, an MTU below the
    segment...), not a full buffer: the sender goes on with one datagram per packet for good."""
    return err == EIO or err == EINVAL or err == EOPNOTSUPP or err == ENOPROTOOPT or err == EMSGSIZE


cdef Py_ssize_t send_core(int fd, const uint8_t* data, Py_ssize_t stride, const int64_t* lengths,
                          const int64_t* rows, Py_ssize_t n, const uint32_t* ip_be,
                          const uint16_t* port_be, double timeout, int64_t* gso_segs,
                          int64_t* calls_out, int64_t* dgrams_out, int* err_out) noexcept nogil:
    """The send loop of :func:`send_batch` (its docstring) on raw arrays, without the GIL: packet
    ``rows[k]`` (``lengths[rows[k]]`` bytes at ``data + rows[k] * stride``) to (ip_be[k],
    port_be[k]). Rows and lengths must have been checked. ``gso_segs[0]``: segments a GSO datagram
    (<= 1: none); when the path refuses GSO it is set to 0 and the rest goes one datagram per packet
    (the caller sees the change). Returns the packets sent; ``err_out`` gets the errno of a failure
    other than a full buffer (0 otherwise); ``calls_out`` and ``dgrams_out`` get += the system calls
    and datagrams. host_lib's round engine calls it too (dosa/_net.pxd)."""
    cdef Py_ssize_t done = 0, k, m, row, nb, ni, j, seg, tot, first
    cdef int rc, err = 0, w, maxseg = <int>gso_segs[0] if gso_segs[0] > 1 else 1
    cdef int64_t calls = 0, dgrams = 0
    cdef double deadline
    cdef cmsghdr* cm
    err_out[0] = 0
    if n <= 0:
        return 0
    # scratch sized to this call (a round sends ~40-100 packets a call: a worst-case 250 KB,
    # zeroed, cost ~40 us a call in page faults); every field used is written below
    cdef Py_ssize_t vlen = n if n < VLEN else VLEN, iov_cap = n if n < IOV_CAP else IOV_CAP
    cdef mmsghdr* msgs = <mmsghdr*>malloc(vlen * sizeof(mmsghdr))
    cdef iovec* iov = <iovec*>malloc(iov_cap * sizeof(iovec))
    cdef sockaddr_in* addrs = <sockaddr_in*>malloc(vlen * sizeof(sockaddr_in))
    cdef uint8_t* ctrl = <uint8_t*>malloc(vlen * CTRL_SPACE)
    cdef Py_ssize_t* npk = <Py_ssize_t*>malloc(vlen * sizeof(Py_ssize_t))
    if msgs == NULL or iov == NULL or addrs == NULL or ctrl == NULL or npk == NULL:
        free(msgs); free(iov); free(addrs); free(ctrl); free(npk)
        err_out[0] = 12  # ENOMEM
        return 0
    deadline = now() + timeout
    while done < n:
        # cut rows[done:] into datagrams: a run of equal lengths to one destination, the
        # last of the run possibly shorter, within the segment and byte limits
        nb = 0
        ni = 0
        k = done
        while k < n and nb < vlen and ni < iov_cap:
            first = k
            seg = lengths[rows[k]]
            tot = seg
            iov[ni].iov_base = <void*>(data + rows[k] * stride)
            iov[ni].iov_len = <size_t>seg
            j = 1
            k += 1
            if maxseg > 1 and seg > 0:
                while k < n and j < maxseg and ni + j < iov_cap and \
                        ip_be[k] == ip_be[first] and port_be[k] == port_be[first] and \
                        lengths[rows[k]] <= seg and lengths[rows[k]] > 0 and \
                        tot + lengths[rows[k]] <= MAX_GSO_BYTES:
                    iov[ni + j].iov_base = <void*>(data + rows[k] * stride)
                    iov[ni + j].iov_len = <size_t>lengths[rows[k]]
                    tot += lengths[rows[k]]
                    j += 1
                    k += 1
                    if lengths[rows[k - 1]] < seg:
                        break  # the short one ends the run
            memset(&msgs[nb], 0, sizeof(mmsghdr))
            memset(&addrs[nb], 0, sizeof(sockaddr_in))
            addrs[nb].sin_family = AF_INET
            addrs[nb].sin_port = port_be[first]
            addrs[nb].sin_addr.s_addr = ip_be[first]
            msgs[nb].msg_hdr.msg_name = <void*>&addrs[nb]
            msgs[nb].msg_hdr.msg_namelen = sizeof(sockaddr_in)
            msgs[nb].msg_hdr.msg_iov = &iov[ni]
            msgs[nb].msg_hdr.msg_iovlen = <size_t>j
            if j > 1:
                memset(&ctrl[nb * CTRL_SPACE], 0, CTRL_SPACE)
                msgs[nb].msg_hdr.msg_control = <void*>&ctrl[nb * CTRL_SPACE]
                msgs[nb].msg_hdr.msg_controllen = CMSG_SPACE(sizeof(uint16_t))
                cm = CMSG_FIRSTHDR(&msgs[nb].msg_hdr)
                cm.cmsg_level = SOL_UDP_
                cm.cmsg_type = UDP_SEGMENT_
                cm.cmsg_len = CMSG_LEN(sizeof(uint16_t))
                (<uint16_t*>CMSG_DATA(cm))[0] = <uint16_t>seg
            npk[nb] = j
            ni += j
            nb += 1
        # send them; a partial sendmmsg is rebuilt from the first datagram not sent
        rc = sendmmsg(fd, msgs, <unsigned int>nb, MSG_DONTWAIT)
        calls += 1
        if rc > 0:
            dgrams += rc
            for m in range(rc):
                done += npk[m]
            continue
        if rc < 0 and errno == EINTR:
            continue
        if rc < 0 and maxseg > 1 and gso_refused(errno):
            gso_segs[0] = 0  # the datagrams not sent are rebuilt one packet each
            maxseg = 1
            continue
        if rc < 0 and errno != EAGAIN and errno != EWOULDBLOCK and errno != ENOBUFS:
            err = errno
            break
        w = wait_fd(fd, POLLOUT, deadline)
        if w == 0:
            break
        if w < 0:
            err = errno
            break
    free(msgs); free(iov); free(addrs); free(ctrl); free(npk)
    calls_out[0] += calls
    dgrams_out[0] += dgrams
    err_out[0] = err
    return done


def send_batch(int fd, const uint8_t[:, ::1] data, const int64_t[::1] lengths,
               const int64_t[::1] rows, const uint32_t[::1] ip_be, const uint16_t[::1] port_be,
               double timeout=1.0, int64_t[::1] gso=None, int64_t[::1] counters=None):
    """Send packet ``data[rows[k], :lengths[rows[k]]]`` to (ip_be[k], port_be[k]) for every k,
    both in network byte order. ``gso`` (int64[1], optional): ``gso[0] > 1`` sends runs of up to
    that many packets as one GSO datagram each (module docstring); a path that refuses GSO sets it
    to 0 and the rest goes one datagram per packet. Returns the number of packets sent: fewer than
    ``len(rows)`` only when the socket stayed full for ``timeout`` seconds. Raises OSError (with
    ``.sent``, the packets already sent) for any other send error. ``counters`` (int64[2]), if
    given, gets += (system calls, datagrams handed to the kernel)."""
    cdef Py_ssize_t n = rows.shape[0], k, row, done = 0
    cdef int err = 0
    cdef int64_t calls = 0, dgrams = 0, no_gso = 0
    cdef int64_t* gp = &gso[0] if gso is not None and gso.shape[0] else &no_gso
    if ip_be.shape[0] != n or port_be.shape[0] != n:
        raise ValueError("one destination per packet is needed")
    if counters is not None and counters.shape[0] < 2:
        raise ValueError("counters needs two slots (system calls, datagrams)")
    for k in range(n):
        row = rows[k]
        if row < 0 or row >= data.shape[0] or lengths[row] < 0 or lengths[row] > data.shape[1]:
            raise ValueError(f"packet row {row} is outside the batch or has a bad length")
    if n == 0:
        return 0
    with nogil:
        done = send_core(fd, &data[0, 0], data.shape[1], &lengths[0], &rows[0], n, &ip_be[0],
                         &port_be[0], timeout, gp, &calls, &dgrams, &err)
    if counters is not None:
        counters[0] += calls
        counters[1] += dgrams
    if err:
        raise _os_error(err, "sendmmsg", done)
    return done


cdef void gro_prepare(mmsghdr* msgs, iovec* iov, sockaddr_in* addrs, uint8_t* buf, uint8_t* ctrl,
                      int n) noexcept nogil:
    """Set up ``n`` recvmmsg slots: datagram k into ``buf + k * GRO_BUF`` (64 KB: GRO never builds
    more), its source into ``addrs[k]``, its control messages into ``ctrl + k * CTRL_SPACE``. Again
    before every call (the kernel rewrites the lengths)."""
    cdef int k
    for k in range(n):
        iov[k].iov_base = <void*>(buf + <Py_ssize_t>k * GRO_BUF)
        iov[k].iov_len = GRO_BUF
        memset(&msgs[k], 0, sizeof(mmsghdr))
        msgs[k].msg_hdr.msg_name = <void*>&addrs[k]
        msgs[k].msg_hdr.msg_namelen = sizeof(sockaddr_in)
        msgs[k].msg_hdr.msg_iov = &iov[k]
        msgs[k].msg_hdr.msg_iovlen = 1
        msgs[k].msg_hdr.msg_control = <void*>(ctrl + k * CTRL_SPACE)
        msgs[k].msg_hdr.msg_controllen = CTRL_SPACE


cdef int gro_segment(mmsghdr* m) noexcept nogil:
    """The segment size of a received datagram (its SOL_UDP/UDP_GRO control message), 0 when it
    has none (a single packet)."""
    cdef cmsghdr* cm = CMSG_FIRSTHDR(&m.msg_hdr)
    cdef int seg = 0
    while cm != NULL:
        if cm.cmsg_level == SOL_UDP_ and cm.cmsg_type == UDP_GRO_:
            seg = (<int*>CMSG_DATA(cm))[0]
        cm = CMSG_NXTHDR(&m.msg_hdr, cm)
    return seg


cdef class GroReceiver:
    """Receives from sockets with UDP_GRO on into packet slots, one segment per slot.

    One recvmmsg reads up to ``nmsg`` datagrams of up to 64 KB into this object's buffers; each is
    split into its segments (size from the UDP_GRO control message; a datagram without one is a
    single packet). Segments that do not fit the caller's slots stay here and come first in the next
    ``recv`` (from whichever socket), so nothing received is lost. ``calls`` and ``datagrams`` count
    the recvmmsg calls that returned data and the datagrams they returned."""

    cdef int nmsg, have, cur
    cdef Py_ssize_t off
    cdef uint8_t* buf
    cdef uint8_t* ctrl
    cdef mmsghdr* msgs
    cdef iovec* iov
    cdef sockaddr_in* addrs
    cdef int* seg
    cdef public int64_t calls, datagrams

    def __cinit__(self, int nmsg=64):
        if nmsg < 1 or nmsg > VLEN:
            raise ValueError(f"nmsg must lie in 1..{VLEN}")
        self.nmsg = nmsg
        self.buf = <uint8_t*>calloc(nmsg, GRO_BUF)
        self.ctrl = <uint8_t*>calloc(nmsg, CTRL_SPACE)
        self.msgs = <mmsghdr*>calloc(nmsg, sizeof(mmsghdr))
        self.iov = <iovec*>calloc(nmsg, sizeof(iovec))
        self.addrs = <sockaddr_in*>calloc(nmsg, sizeof(sockaddr_in))
        self.seg = <int*>calloc(nmsg, sizeof(int))
        if not (self.buf and self.ctrl and self.msgs and self.iov and self.addrs and self.seg):
            raise MemoryError()
        self.have = self.cur = 0
        self.off = 0
        self.calls = self.datagrams = 0

    def __dealloc__(self):
        free(self.buf); free(self.ctrl); free(self.msgs); free(self.iov); free(self.addrs)
        free(self.seg)

    @property
    def pending(self) -> bool:
        """Received segments not yet handed out."""
        return self.cur < self.have

    cdef Py_ssize_t _drain(self, uint8_t[:, ::1] data, int64_t[::1] lengths, uint32_t[::1] src_ip_be,
                           uint16_t[::1] src_port_be, Py_ssize_t out, Py_ssize_t cap) noexcept nogil:
        cdef Py_ssize_t dlen, l, slot = data.shape[1]
        cdef int s
        cdef uint8_t* p
        while self.cur < self.have and out < cap:
            dlen = self.msgs[self.cur].msg_len
            p = self.buf + <Py_ssize_t>self.cur * GRO_BUF
            if (self.msgs[self.cur].msg_hdr.msg_flags & MSG_TRUNC) or dlen == 0:
                lengths[out] = -1 if dlen else 0
                src_ip_be[out] = self.addrs[self.cur].sin_addr.s_addr
                src_port_be[out] = self.addrs[self.cur].sin_port
                out += 1
                self.cur += 1
                self.off = 0
                continue
            s = self.seg[self.cur]
            if s <= 0:
                s = <int>dlen
            while self.off < dlen and out < cap:
                l = dlen - self.off
                if l > s:
                    l = s
                if l > slot:
                    lengths[out] = -1  # a segment larger than a slot: truncated, dropped by the caller
                else:
                    memcpy(&data[out, 0], p + self.off, l)
                    lengths[out] = l
                src_ip_be[out] = self.addrs[self.cur].sin_addr.s_addr
                src_port_be[out] = self.addrs[self.cur].sin_port
                self.off += l
                out += 1
            if self.off >= dlen:
                self.cur += 1
                self.off = 0
        return out

    def recv(self, int fd, uint8_t[:, ::1] data, int64_t[::1] lengths, uint32_t[::1] src_ip_be,
             uint16_t[::1] src_port_be, double timeout):
        """Fill up to ``len(lengths)`` slots: first what is pending, then one recvmmsg from ``fd``
        (waiting up to ``timeout`` s only if nothing was pending). Returns the slots filled; a
        segment longer than a slot (or a datagram cut by the buffer) gets length -1."""
        cdef Py_ssize_t cap = lengths.shape[0], out = 0, k
        cdef int rc = 0, err = 0
        cdef double deadline
        if data.shape[0] < cap or src_ip_be.shape[0] < cap or src_port_be.shape[0] < cap:
            raise ValueError("every output array needs a slot per packet")
        if cap == 0:
            return 0
        with nogil:
            out = self._drain(data, lengths, src_ip_be, src_port_be, 0, cap)
            if out < cap and self.cur >= self.have:
                gro_prepare(self.msgs, self.iov, self.addrs, self.buf, self.ctrl, self.nmsg)
                deadline = now() + (timeout if out == 0 else 0.0)
                rc = recvmmsg_wait(fd, self.msgs, <unsigned int>self.nmsg, deadline, &err)
                if err == 0 and rc > 0:
                    self.calls += 1
                    self.datagrams += rc
                    for k in range(rc):
                        self.seg[k] = gro_segment(&self.msgs[k])
                    self.have = rc
                    self.cur = 0
                    self.off = 0
                    out = self._drain(data, lengths, src_ip_be, src_port_be, out, cap)
        if err:
            raise _os_error(err, "recvmmsg", 0)
        return out


def recv_batch(int fd, uint8_t[:, ::1] data, int64_t[::1] lengths, uint32_t[::1] src_ip_be,
               uint16_t[::1] src_port_be, double timeout, int64_t[::1] counters=None):
    """Receive up to ``len(lengths)`` packets into the slots of ``data``, waiting at most ``timeout``
    seconds for the first one (0 = don't wait). Returns the number received. A datagram larger than
    a slot gets length -1 (truncated; the caller drops it as malformed). For sockets without
    UDP_GRO (see GroReceiver). ``counters`` (int64[2]) gets += (calls that returned data, datagrams)."""
    cdef Py_ssize_t cap = lengths.shape[0], k
    cdef int rc, err = 0
    cdef double deadline
    if data.shape[0] < cap or src_ip_be.shape[0] < cap or src_port_be.shape[0] < cap:
        raise ValueError("every output array needs a slot per packet")
    if counters is not None and counters.shape[0] < 2:
        raise ValueError("counters needs two slots (calls, datagrams)")
    if cap > VLEN:
        cap = VLEN
    if cap == 0:
        return 0
    cdef mmsghdr* msgs = <mmsghdr*>calloc(cap, sizeof(mmsghdr))
    cdef iovec* iov = <iovec*>calloc(cap, sizeof(iovec))
    cdef sockaddr_in* addrs = <sockaddr_in*>calloc(cap, sizeof(sockaddr_in))
    if msgs == NULL or iov == NULL or addrs == NULL:
        free(msgs); free(iov); free(addrs)
        raise MemoryError()
    rc = 0
    try:
        with nogil:
            for k in range(cap):
                iov[k].iov_base = <void*>&data[k, 0]
                iov[k].iov_len = <size_t>data.shape[1]
                msgs[k].msg_hdr.msg_name = <void*>&addrs[k]
                msgs[k].msg_hdr.msg_namelen = sizeof(sockaddr_in)
                msgs[k].msg_hdr.msg_iov = &iov[k]
                msgs[k].msg_hdr.msg_iovlen = 1
            deadline = now() + timeout
            rc = recvmmsg_wait(fd, msgs, <unsigned int>cap, deadline, &err)
            if err == 0:
                for k in range(rc):
                    if msgs[k].msg_hdr.msg_flags & MSG_TRUNC:
                        lengths[k] = -1
                    else:
                        lengths[k] = msgs[k].msg_len
                    src_ip_be[k] = addrs[k].sin_addr.s_addr
                    src_port_be[k] = addrs[k].sin_port
    finally:
        free(msgs); free(iov); free(addrs)
        if counters is not None and rc > 0:
            counters[0] += 1
            counters[1] += rc
    if err:
        raise _os_error(err, "recvmmsg", 0)
    return rc
