# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A batch's entries in one compiled pass each way (dosa.packetizer): :func:`write_entries` puts the
entries of packets being built into their slots, :func:`decode_entries` reads those of received
packets out. Each packet says its own layout: its type, count and base are read from its header and
its entries go through the accessors generated from dosa.wire into dosa/dosa_wire.h (declared in
dosa/dosa_wire.pxd), so no offset or byte order is written here.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

from dosa.dosa_wire cimport (DOSA_HDR_LEN, DOSA_T_RETX_REQUEST, dosa_dense, dosa_dense_value,
                             dosa_entry_len, dosa_hdr_base, dosa_hdr_count, dosa_hdr_type,
                             dosa_odd_pad, dosa_put_dense_value, dosa_put_sparse_offset,
                             dosa_put_sparse_pad, dosa_put_sparse_value, dosa_retx_seq, dosa_sparse,
                             dosa_sparse_offset, dosa_sparse_value, dosa_status_worker_id)


def decode_entries(const uint8_t[:, ::1] data, const int64_t[::1] rows, uint32_t[::1] out_idx,
                   int32_t[::1] out_val, bint skip_dense_zeros=False):
    """Decode the entries of packets ``rows`` (in that order) into ``out_idx`` / ``out_val``;
    returns the number written. Each packet says its own layout: its type, count and base are read
    from its header and its entries through the accessors generated from dosa.wire
    (dosa/dosa_wire.h): a sparse entry is (base + offset, value), a dense one (base + j, value), a
    RETX_REQUEST's or STATUS's (its u32 seq or worker id, 0). A row whose entries would not fit its
    slot makes it return -1 (headers are validated before: never expected). ``skip_dense_zeros``: a
    dense run's zero values are not written (a result's dense run carries the zero sums of its span
    too, and they are no entries)."""
    cdef Py_ssize_t k, m = 0, n = rows.shape[0], cap = out_idx.shape[0], width = data.shape[1]
    cdef uint32_t j, c, b, t
    cdef int32_t v
    cdef const uint8_t* pk
    if out_val.shape[0] < cap:
        raise ValueError("out_val needs as many slots as out_idx")
    with nogil:
        for k in range(n):
            if rows[k] < 0 or rows[k] >= data.shape[0]:
                m = -1
                break
            pk = &data[rows[k], 0]
            t = dosa_hdr_type(pk)
            c = dosa_hdr_count(pk)
            b = dosa_hdr_base(pk)
            if m + c > cap or DOSA_HDR_LEN + dosa_entry_len(t) * c + dosa_odd_pad(t) * (c & 1) > width:
                m = -1
                break
            if dosa_sparse(t):
                for j in range(c):
                    out_idx[m] = b + dosa_sparse_offset(pk, c, j)
                    out_val[m] = dosa_sparse_value(pk, c, j)
                    m += 1
            elif dosa_dense(t):
                for j in range(c):
                    v = dosa_dense_value(pk, c, j)
                    if skip_dense_zeros and v == 0:
                        continue
                    out_idx[m] = b + j
                    out_val[m] = v
                    m += 1
            else:
                for j in range(c):
                    out_idx[m] = dosa_retx_seq(pk, c, j) if t == DOSA_T_RETX_REQUEST \
                        else dosa_status_worker_id(pk, c, j)
                    out_val[m] = 0
                    m += 1
    return m


def write_entries(uint8_t[:, ::1] data, const int64_t[::1] first, const uint32_t[::1] idx,
                  const int32_t[::1] val):
    """The inverse of :func:`decode_entries` for one batch being built (dosa.packetizer): row k's
    header (type, count, base) is written already; its entries go in through the accessors
    generated from dosa.wire. Sparse: entries ``first[k] .. first[k] + count - 1`` of (idx, val),
    as offsets ``idx - base`` and their values. Dense: the packet carries indices ``base .. base +
    count - 1``; the entries from ``first[k]`` on whose index is below ``base + count`` go to their
    place; the rest of the run must already be zero (a fresh batch is). Returns 0, or -1 (nothing
    guaranteed written) when an offset does not fit a u16, an entry lies outside its run, or a
    packet does not fit its slot: the caller computed them wrong."""
    cdef Py_ssize_t k, e, n = data.shape[0], width = data.shape[1], m = idx.shape[0]
    cdef uint32_t j, c, b, t
    cdef int64_t off
    cdef uint8_t* pk
    cdef int bad = 0
    if first.shape[0] < n or val.shape[0] != m:
        raise ValueError("write_entries: one first entry per row, one value per index")
    with nogil:
        for k in range(n):
            pk = &data[k, 0]
            t = dosa_hdr_type(pk)
            c = dosa_hdr_count(pk)
            b = dosa_hdr_base(pk)
            if first[k] < 0 or DOSA_HDR_LEN + dosa_entry_len(t) * c + dosa_odd_pad(t) * (c & 1) > width:
                bad = 1
                break
            if dosa_sparse(t):
                if first[k] + c > m:
                    bad = 1
                    break
                for j in range(c):
                    e = first[k] + j
                    off = <int64_t>idx[e] - b
                    if off < 0 or off > 0xFFFF:
                        bad = 1
                        break
                    dosa_put_sparse_offset(pk, c, j, <uint32_t>off)
                    dosa_put_sparse_value(pk, c, j, val[e])
                if bad:
                    break
                dosa_put_sparse_pad(pk, c)
            elif dosa_dense(t):
                e = first[k]
                while e < m and <int64_t>idx[e] < <int64_t>b + c:
                    off = <int64_t>idx[e] - b
                    if off < 0:
                        bad = 1
                        break
                    dosa_put_dense_value(pk, c, <uint32_t>off, val[e])
                    e += 1
                if bad:
                    break
            elif c:
                bad = 1
                break
    return -1 if bad else 0
