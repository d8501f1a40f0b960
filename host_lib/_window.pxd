# The send window of a host's round (host_lib/_window.pyx), cimported by its engine (_engine.pyx).
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef class SendWindow:
    cdef readonly Py_ssize_t P, window
    cdef int64_t[::1] gate_v
    cdef uint32_t[::1] dpu_ip_v
    cdef uint16_t[::1] dpu_port_v
    cdef int64_t[::1] ctr, gso
    cdef uint64_t rng
    # shared with the engine (and host_lib.round through it): sent, last_tx written here, done read
    cdef uint8_t[::1] sent_v, done_v
    cdef double[::1] last_tx_v
    cdef readonly Py_ssize_t next, released, inflight
    # the round's data packets
    cdef object tx_data, tx_len, tx_dest, tx_start, tx_lose
    cdef const uint8_t[:, ::1] txd_v
    cdef uint8_t[::1] lose_v
    cdef const int64_t[::1] txl_v, txdest_v, txs_v
    cdef int64_t* rows
    cdef uint32_t* rip
    cdef uint16_t* rport
    cdef Py_ssize_t rows_cap

    cdef void reset(self, Py_ssize_t released)
    cdef void partition_done(self, Py_ssize_t part) noexcept nogil
    cdef int fill(self, int fd, bint* gso_off) noexcept nogil
    cdef int _send_rows(self, int fd, Py_ssize_t r0, Py_ssize_t r1, bint* gso_off) noexcept nogil
