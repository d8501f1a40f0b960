# The C-level parts of dosa/_net.pyx that other compiled modules use (host_lib/_engine.pyx): the
# socket structures and calls, the batched UDP send loop (UDP GSO over sendmmsg, with its fallback
# when a path refuses GSO), the GRO receive slots and segment size, and the clock and poll helpers.
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from posix.time cimport timespec

cdef extern from "<errno.h>":
    int EWOULDBLOCK
    int ENOBUFS
    int EIO, EINVAL, EOPNOTSUPP, ENOPROTOOPT, EMSGSIZE

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
    struct cmsghdr:
        size_t cmsg_len
        int cmsg_level
        int cmsg_type
    cmsghdr* CMSG_FIRSTHDR(msghdr* m) nogil
    cmsghdr* CMSG_NXTHDR(msghdr* m, cmsghdr* c) nogil
    unsigned char* CMSG_DATA(cmsghdr* c) nogil
    size_t CMSG_SPACE(size_t n) nogil
    size_t CMSG_LEN(size_t n) nogil
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
    VLEN = 1024          # datagrams per sendmmsg/recvmmsg (the kernel's UIO_MAXIOV bound on vlen)
    IOV_CAP = 8192       # iovecs (packets) per sendmmsg: VLEN GSO datagrams of up to 8 segments,
                         # or fewer, longer ones
    SOL_UDP_ = 17
    UDP_SEGMENT_ = 103
    UDP_GRO_ = 104
    MAX_GSO_BYTES = 65507  # largest UDP payload of one IPv4 datagram
    CTRL_SPACE = 32      # >= CMSG_SPACE(sizeof(int)), 8-aligned
    GRO_BUF = 65536      # one received datagram (GRO never builds more than 64 KB)
    # an endpoint's counter slots (dosa.transport.UdpEndpoint.counters; _net.COUNTERS names them in
    # this order), moved by send_batch's callers and by host_lib's round engine
    C_SEND_CALLS = 0, C_SEND_DGRAMS, C_SENT_PACKETS, C_SENT_BYTES, C_RECV_CALLS, C_RECV_DGRAMS, \
        C_RECV_PACKETS, C_RECV_BYTES, C_TRUNCATED, N_COUNTERS

cdef double now() noexcept nogil
cdef int wait_fd(int fd, short events, double deadline) noexcept nogil
cdef Py_ssize_t send_core(int fd, const uint8_t* data, Py_ssize_t stride, const int64_t* lengths,
                          const int64_t* rows, Py_ssize_t n, const uint32_t* ip_be,
                          const uint16_t* port_be, double timeout, int64_t* gso_segs,
                          int64_t* calls_out, int64_t* dgrams_out, int* err_out) noexcept nogil
cdef void gro_prepare(mmsghdr* msgs, iovec* iov, sockaddr_in* addrs, uint8_t* buf, uint8_t* ctrl,
                      int n) noexcept nogil
cdef int gro_segment(mmsghdr* m) noexcept nogil
