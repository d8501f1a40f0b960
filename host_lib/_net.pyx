# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Batched UDP send/receive over a PacketBatch buffer (sendmmsg/recvmmsg), one iovec per packet.

One system call moves up to 1024 packets (the kernel's UIO_MAXIOV bound on vlen); the GIL is
released for the whole call, including the waits in poll(). The socket must be non-blocking: a full
send buffer (EAGAIN/ENOBUFS) waits in poll(POLLOUT) until ``timeout`` runs out.
Public wrapper: ``host_lib/transport.py`` (UdpEndpoint).
"""
from libc.errno cimport errno, EAGAIN, EINTR

cdef extern from "<errno.h>":
    int EWOULDBLOCK
    int ENOBUFS
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef extern from "<sys/uio.h>":
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<netinet/in.h>":
    struct in_addr:
        uint32_t s_addr
    struct sockaddr_in:
        unsigned short sin_family
        uint16_t sin_port
        in_addr sin_addr

cdef extern from "<sys/socket.h>":
    struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len
    int sendmmsg(int sockfd, mmsghdr* msgvec, unsigned int vlen, int flags) nogil
    int recvmmsg(int sockfd, mmsghdr* msgvec, unsigned int vlen, int flags, timespec* timeout) nogil
    int AF_INET
    int MSG_DONTWAIT
    int MSG_TRUNC

cdef extern from "<poll.h>":
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout) nogil
    short POLLIN
    short POLLOUT

cdef enum:
    VLEN = 1024


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


def send_batch(int fd, const uint8_t[:, ::1] data, const int64_t[::1] lengths,
               const int64_t[::1] rows, const uint32_t[::1] ip_be, const uint16_t[::1] port_be,
               double timeout=1.0):
    """Send packet ``data[rows[k], :lengths[rows[k]]]`` to (ip_be[k], port_be[k]) for every k,
    both in network byte order. Returns the number sent: fewer than ``len(rows)`` only when the
    socket stayed full for ``timeout`` seconds. Raises OSError for any other send error."""
    cdef Py_ssize_t n = rows.shape[0], done = 0, k, m, row
    cdef int rc, err = 0, w
    cdef double deadline
    if ip_be.shape[0] != n or port_be.shape[0] != n:
        raise ValueError("one destination per packet is needed")
    for k in range(n):
        row = rows[k]
        if row < 0 or row >= data.shape[0] or lengths[row] < 0 or lengths[row] > data.shape[1]:
            raise ValueError(f"packet row {row} is outside the batch or has a bad length")
    if n == 0:
        return 0
    cdef mmsghdr* msgs = <mmsghdr*>calloc(VLEN, sizeof(mmsghdr))
    cdef iovec* iov = <iovec*>calloc(VLEN, sizeof(iovec))
    cdef sockaddr_in* addrs = <sockaddr_in*>calloc(VLEN, sizeof(sockaddr_in))
    if msgs == NULL or iov == NULL or addrs == NULL:
        free(msgs); free(iov); free(addrs)
        raise MemoryError()
    try:
        with nogil:
            deadline = now() + timeout
            while done < n:
                m = n - done
                if m > VLEN:
                    m = VLEN
                for k in range(m):
                    row = rows[done + k]
                    iov[k].iov_base = <void*>&data[row, 0]
                    iov[k].iov_len = <size_t>lengths[row]
                    addrs[k].sin_family = AF_INET
                    addrs[k].sin_port = port_be[done + k]
                    addrs[k].sin_addr.s_addr = ip_be[done + k]
                    memset(&msgs[k], 0, sizeof(mmsghdr))
                    msgs[k].msg_hdr.msg_name = <void*>&addrs[k]
                    msgs[k].msg_hdr.msg_namelen = sizeof(sockaddr_in)
                    msgs[k].msg_hdr.msg_iov = &iov[k]
                    msgs[k].msg_hdr.msg_iovlen = 1
                rc = sendmmsg(fd, msgs, <unsigned int>m, MSG_DONTWAIT)
                if rc > 0:
                    done += rc
                    continue
                if rc < 0 and errno == EINTR:
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
    finally:
        free(msgs); free(iov); free(addrs)
    if err:
        import os
        raise OSError(err, f"sendmmsg failed: {os.strerror(err)}")
    return done


def recv_batch(int fd, uint8_t[:, ::1] data, int64_t[::1] lengths, uint32_t[::1] src_ip_be,
               uint16_t[::1] src_port_be, double timeout):
    """Receive up to ``len(lengths)`` packets into the slots of ``data``, waiting at most ``timeout``
    seconds for the first one (0 = don't wait). Returns the number received. A datagram larger than
    a slot gets length -1 (truncated; the caller drops it as malformed)."""
    cdef Py_ssize_t cap = lengths.shape[0], k
    cdef int rc, err = 0, w
    cdef double deadline
    if data.shape[0] < cap or src_ip_be.shape[0] < cap or src_port_be.shape[0] < cap:
        raise ValueError("every output array needs a slot per packet")
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
            while True:
                rc = recvmmsg(fd, msgs, <unsigned int>cap, MSG_DONTWAIT, NULL)
                if rc >= 0:
                    break
                if errno == EINTR:
                    continue
                if errno != EAGAIN and errno != EWOULDBLOCK:
                    err = errno
                    break
                w = wait_fd(fd, POLLIN, deadline)
                if w == 0:
                    rc = 0
                    break
                if w < 0:
                    err = errno
                    break
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
    if err:
        import os
        raise OSError(err, f"recvmmsg failed: {os.strerror(err)}")
    return rc


def decode_sparse_entries(const uint8_t[:, ::1] data, const int64_t[::1] rows,
                          const int64_t[::1] count, Py_ssize_t first_byte,
                          uint32_t[::1] out_idx, int32_t[::1] out_val):
    """Decode the (big-endian u32 index, big-endian s32 value) entries of packets ``rows`` (in that
    order, ``count[k]`` entries each, starting at byte ``first_byte`` of a slot) into ``out_idx`` /
    ``out_val``; returns the number written. The caller checks that this is the wire's
    SPARSE_ENTRY_DTYPE layout (host_lib.client) and that the counts fit the slots (validated headers)."""
    cdef Py_ssize_t k, j, m = 0, n = rows.shape[0], cap = out_idx.shape[0]
    cdef const uint8_t* p
    if count.shape[0] < n or out_val.shape[0] < cap:
        raise ValueError("count needs a value per row and out_val as many slots as out_idx")
    with nogil:
        for k in range(n):
            if count[k] < 0 or m + count[k] > cap or first_byte + 8 * count[k] > data.shape[1]:
                break
            p = &data[rows[k], first_byte]
            for j in range(count[k]):
                out_idx[m] = (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]
                out_val[m] = <int32_t>((<uint32_t>p[4] << 24) | (<uint32_t>p[5] << 16) | (<uint32_t>p[6] << 8) | p[7])
                p += 8
                m += 1
    return m
