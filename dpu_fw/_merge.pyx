# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Hot loops of the DPU worker: the userspace merge state machine (the same rules the XDP dataplane
applies, see docs/protocol.md *Rounds, buffers, duplicates*), result extraction and buffer clearing.

Public wrappers with argument checks live in ``dpu_fw/userspace.py``; everything here runs without
the GIL over typed memoryviews; a batch costs one call, never one Python step per packet.
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from dataplane.reasons import Counter

# Verdicts of merge_batch, one per packet: the dataplane's counters (dataplane/reasons.py), the one
# list of verdict names; read once at import into C ints.
cdef int V_ACCEPTED = Counter.MERGED
cdef int V_DUPLICATE = Counter.DUPLICATE
cdef int V_DUP_OF_COMPLETE = Counter.PASS_DUP_OF_COMPLETE
cdef int V_TOO_OLD = Counter.ROUND_TOO_OLD
cdef int V_TOO_NEW = Counter.ROUND_TOO_NEW
cdef int V_SCALE_MISMATCH = Counter.SCALE_MISMATCH
cdef int V_TOTAL_MISMATCH = Counter.TOTAL_MISMATCH
cdef int V_BAD_INDEX = Counter.INDEX_OUT_OF_PARTITION
cdef int V_UNKNOWN_WORKER = Counter.UNKNOWN_WORKER

cdef enum:
    SCALE_UNSET = 127  # outside the protocol's -32..62
    BITMAP_WORDS = 1024  # the listed extraction's scratch bitmap: 65536 bits, one per u16 offset
    PREFETCH = 16  # sums the listed extraction's gather prefetches ahead (32 and 64: no better)

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil
    void __builtin_prefetch(const void*) nogil


cdef inline uint32_t be32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3]


def merge_batch(const uint32_t[::1] eidx, const int32_t[::1] evals, const int64_t[::1] eoff,
                const int32_t[::1] lp,
                const int64_t[::1] rnd, const int32_t[::1] wid, const int32_t[::1] seq,
                const int32_t[::1] total, const int32_t[::1] count, const int32_t[::1] scale,
                const int64_t[::1] lo, const int64_t[::1] hi,
                int64_t[::1] base_round, uint8_t[:, :, :, ::1] seen, int32_t[:, :, ::1] delivered,
                int32_t[:, :, ::1] totals, int32_t[:, ::1] done_workers, int32_t[:, ::1] scale_of,
                uint8_t[:, ::1] complete, int64_t[:, :, ::1] buf, int nworkers,
                int8_t[::1] verdict, int64_t[:, ::1] completions):
    """Apply the dataplane's merge rules to a batch of SPARSE_DATA packets of one job, all for
    partitions this DPU owns (``lp`` = local partition index), headers already validated and decoded
    into the per-packet arrays. Packet i's entries are ``eidx/evals[eoff[i] : eoff[i] + count[i]]``
    (the flat arrays of dosa.packetizer.parse_batch).

    Returns the number of completions written to ``completions`` as (local partition, round) rows,
    in the order they happened. ``verdict[i]`` says what happened to packet i (a
    dataplane.reasons.Counter value).
    """
    cdef Py_ssize_t n = lp.shape[0], i, j, e0
    cdef Py_ssize_t ncomp = 0
    cdef int l, par, w, s, c, t
    cdef int64_t r, b, idx, off
    cdef bint bad
    if eoff.shape[0] < n or completions.shape[0] < n or verdict.shape[0] < n:
        raise ValueError("output arrays shorter than the batch")
    with nogil:
        for i in range(n):
            l = lp[i]
            r = rnd[i]
            w = wid[i]
            s = seq[i]
            t = total[i]
            c = count[i]
            if w < 0 or w >= nworkers:
                verdict[i] = V_UNKNOWN_WORKER
                continue
            b = base_round[l]
            if r < b:
                verdict[i] = V_TOO_OLD
                continue
            if r > b + 1:
                verdict[i] = V_TOO_NEW
                continue
            par = <int>(r & 1)
            if complete[l, par]:
                verdict[i] = V_DUP_OF_COMPLETE
                continue
            if seen[l, par, w, s]:
                verdict[i] = V_DUPLICATE
                continue
            if totals[l, par, w] != 0 and totals[l, par, w] != t:
                verdict[i] = V_TOTAL_MISMATCH
                continue
            if scale_of[l, par] != SCALE_UNSET and scale_of[l, par] != scale[i]:
                verdict[i] = V_SCALE_MISMATCH
                continue
            e0 = eoff[i]
            bad = False
            for j in range(e0, e0 + c):
                idx = eidx[j]
                if idx < lo[l] or idx >= hi[l]:
                    bad = True
                    break
            if bad:
                verdict[i] = V_BAD_INDEX
                continue
            off = lo[l]
            for j in range(e0, e0 + c):
                buf[l, par, eidx[j] - off] += evals[j]
            verdict[i] = V_ACCEPTED
            scale_of[l, par] = scale[i]
            totals[l, par, w] = t
            seen[l, par, w, s] = 1
            delivered[l, par, w] += 1
            if delivered[l, par, w] == t:
                done_workers[l, par] += 1
                if done_workers[l, par] == nworkers:
                    complete[l, par] = 1
                    completions[ncomp, 0] = l
                    completions[ncomp, 1] = r
                    ncomp += 1
    return ncomp


def scatter_add(int64_t[::1] buf, const uint32_t[::1] idx, const int32_t[::1] val, int64_t lo):
    """buf[idx - lo] += val for every entry inside the buffer; entries outside are skipped and
    counted (returned), never written: a bad index is reported, not a crash."""
    cdef Py_ssize_t n = idx.shape[0], i, nbad = 0
    cdef int64_t k, size = buf.shape[0]
    if val.shape[0] != n:
        raise ValueError(f"{n} indices but {val.shape[0]} values")
    with nogil:
        for i in range(n):
            k = <int64_t>idx[i] - lo
            if k < 0 or k >= size:
                nbad += 1
            else:
                buf[k] += val[i]
    return nbad


cdef inline Py_ssize_t _store(int64_t v, Py_ssize_t j, int64_t base_index, uint32_t* oi,
                               int32_t* os, Py_ssize_t k, Py_ssize_t* ns) noexcept nogil:
    """Store sum ``v`` of offset ``j`` at output k, saturated to s32 (counted in ``ns``), without a
    branch; returns the next output (k + 1 when v is non-zero, else k: a zero is overwritten)."""
    cdef bint hi = v > 2147483647, lo = v < -2147483647
    ns[0] += hi | lo
    v = 2147483647 if hi else v
    v = -2147483647 if lo else v
    oi[k] = <uint32_t>(base_index + j)
    os[k] = <int32_t>v
    return k + (v != 0)


cdef inline Py_ssize_t _extract(const int64_t* buf, Py_ssize_t n, int64_t base_index, uint32_t* oi,
                                int32_t* os, Py_ssize_t* nsat) noexcept nogil:
    """Non-zeros of buf[0:n] to oi/os (absolute index, s32 sum saturated and counted in nsat);
    returns how many. Blocks of 8 sums are OR-ed and skipped when all are zero; the sums of a
    block that is not are stored without a branch (the output index advances where non-zero), so
    a few per cent of non-zeros, scattered, cost no mispredictions. oi/os must hold n entries."""
    cdef Py_ssize_t i = 0, j, k = 0, ns = 0, nb = n - n % 8, end
    while i < n:
        if i < nb:
            if (buf[i] | buf[i + 1] | buf[i + 2] | buf[i + 3] | buf[i + 4] | buf[i + 5]
                    | buf[i + 6] | buf[i + 7]) == 0:
                i += 8
                continue
            end = i + 8
        else:
            end = n
        for j in range(i, end):
            k = _store(buf[j], j, base_index, oi, os, k, &ns)
        i = end
    nsat[0] += ns
    return k


cdef inline Py_ssize_t _extract_listed(const int64_t* buf, Py_ssize_t n, const uint16_t* lst,
                                       Py_ssize_t cnt, uint64_t* bits, int64_t base_index,
                                       uint32_t* oi, int32_t* os, Py_ssize_t* nsat) noexcept nogil:
    """Exactly what _extract writes for buf[0:n], read only at the offsets lst[0:cnt]: the touched
    list XDP wrote (dataplane/dosa_xdp.c list_offsets(): every merged packet's offsets), which names
    every non-zero sum, in any order, most more than once (once per worker that sent it), some
    whose sum is zero, some past the partition (the bytes after a packet's offsets in its last
    word). A bit per listed offset in ``bits`` (a zeroed bitmap of at least ceil(n / 64) words)
    sorts and deduplicates them; the words between the lowest and the highest set are walked in
    order (and cleared: the bitmap is zeroed again on return) into oi as offsets. Then each listed
    sum is stored as in _extract (_store), compacting oi in place. That gather is a loop of its
    own, prefetching PREFETCH sums ahead: the sums are a few per cent of a buffer that is not in
    cache, one cache miss each, and only a loop free of data-dependent branches keeps enough of
    them in flight (walking and reading in one loop was slower than scanning the whole buffer).
    Offsets at or past n are ignored."""
    cdef Py_ssize_t i, j, w, m = 0, k = 0, ns = 0, wlo = n, whi = -1
    cdef uint64_t word
    for i in range(cnt):
        j = lst[i]
        if j < n:
            w = j >> 6
            bits[w] |= (<uint64_t>1) << (j & 63)
            if w < wlo:
                wlo = w
            if w > whi:
                whi = w
    for w in range(wlo, whi + 1):
        word = bits[w]
        if word == 0:
            continue
        bits[w] = 0
        while word:
            oi[m] = <uint32_t>((w << 6) + __builtin_ctzll(word))
            m += 1
            word &= word - 1
    for i in range(m):  # oi[i] is read before oi[k <= i] is written: compaction in place is safe
        if i + PREFETCH < m:
            __builtin_prefetch(&buf[oi[i + PREFETCH]])
        j = oi[i]
        k = _store(buf[j], j, base_index, oi, os, k, &ns)
    nsat[0] += ns
    return k


def extract_nonzero(const int64_t[::1] buf, int64_t base_index):
    """Non-zero sums of ``buf`` as (absolute u32 indices, s32 sums, number saturated).

    A sum outside s32 cannot happen when hosts respect the clip bound C = (2^31-1)/W; if it does it
    is saturated and counted, so the caller can report it instead of sending a wrapped value.

    One pass over the buffer (it is the DPU's biggest per-round cost: a 25M-entry job reads 200 MB
    of sums a round, ~1-3 % of them non-zero): blocks of 8 sums are OR-ed and skipped when all are
    zero, and the non-zeros go to scratch arrays sized for the worst case, copied out at the end.
    """
    cdef Py_ssize_t n = buf.shape[0], k = 0, nsat = 0
    scratch_i = np.empty(n, np.uint32)
    scratch_v = np.empty(n, np.int32)
    cdef uint32_t[::1] oi = scratch_i
    cdef int32_t[::1] os = scratch_v
    if n:
        with nogil:
            k = _extract(&buf[0], n, base_index, &oi[0], &os[0], &nsat)
    return scratch_i[:k].copy(), scratch_v[:k].copy(), nsat


def extract_listed(const int64_t[::1] buf, const uint16_t[::1] lst, count, int64_t base_index):
    """extract_nonzero's output (absolute u32 indices, s32 sums, number saturated) read from the
    buffer's touched list (``lst``, ``count``: dataplane.maps.DataplaneMaps.touched) instead of a
    pass over the whole buffer; a list that overflowed (count > len(lst)) falls back to that pass.
    One partition through extract_many."""
    cdef Py_ssize_t n = buf.shape[0]
    oi = np.empty(n, np.uint32)
    ov = np.empty(n, np.int32)
    starts = np.empty(2, np.int64)
    nsat = np.empty(1, np.int64)
    k = extract_many([buf], np.array([base_index], np.int64), oi, ov, starts, nsat,
                     [(lst, count)])
    return oi[:k].copy(), ov[:k].copy(), int(nsat[0])


def extract_many(list bufs, const int64_t[::1] base_index, uint32_t[::1] out_idx,
                 int32_t[::1] out_val, int64_t[::1] starts, int64_t[::1] nsat, list lists=None,
                 uint64_t[::1] bits=None):
    """extract_nonzero over several buffers in one call: the non-zeros of ``bufs[k]`` (an int64
    array whose element i is index ``base_index[k] + i``) go to ``out_idx/out_val[starts[k] :
    starts[k+1]]``, packed one partition after the other; ``nsat[k]`` counts its saturated sums.
    ``out_*`` must hold the sum of the buffers' lengths (the worst case). Returns the total.

    ``lists[k]`` (optional): None, or buffer k's touched list as (uint16 array of the list's
    capacity, count) (dataplane.maps.DataplaneMaps.touched): read instead of the whole buffer
    when count <= capacity (the output is the same, see _extract_listed), the whole buffer is
    scanned when the list overflowed. ``bits``: a zeroed scratch bitmap of at least 1024 words
    (65536 bits), left zeroed; allocated per call when None."""
    cdef Py_ssize_t nb = len(bufs), k, n, pos = 0, cap = out_idx.shape[0], ns, cnt = 0, nbits
    cdef const int64_t[::1] b
    cdef const uint16_t[::1] lv
    cdef bint listed
    if base_index.shape[0] < nb or starts.shape[0] < nb + 1 or nsat.shape[0] < nb \
            or out_val.shape[0] < cap:
        raise ValueError("extract_many: output arrays shorter than the list of buffers")
    if lists is not None and len(lists) < nb:
        raise ValueError(f"extract_many: {len(lists)} touched lists for {nb} buffers")
    if lists is not None and bits is None:
        bits = np.zeros(BITMAP_WORDS, np.uint64)
    nbits = 64 * bits.shape[0] if bits is not None else 0
    starts[0] = 0
    for k in range(nb):
        b = bufs[k]
        n = b.shape[0]
        if pos + n > cap:
            raise ValueError(f"extract_many: scratch of {cap} entries is too small")
        ns = 0
        listed = False
        if n and lists is not None and lists[k] is not None:
            lst, count = lists[k]
            lv = lst
            # a list with room that did not overflow, for a buffer the bitmap covers
            listed = 0 < lv.shape[0] and 0 <= count <= lv.shape[0] and n <= nbits
            if listed:
                cnt = count
        if listed:
            with nogil:
                pos += _extract_listed(&b[0], n, &lv[0], cnt, &bits[0], base_index[k],
                                       &out_idx[pos], &out_val[pos], &ns)
        elif n:
            with nogil:
                pos += _extract(&b[0], n, base_index[k], &out_idx[pos], &out_val[pos], &ns)
        nsat[k] = ns
        starts[k + 1] = pos
    return pos


# SPARSE_RESULT layout, from dosa.wire (read here, checked at import below; never restated): the
# header fields' byte offsets and sizes, the value block's position and the payload length.
from dosa import wire as _wire

cdef dict _F = {name: _wire.HEADER_DTYPE.fields[name][1] for name in _wire.HEADER_DTYPE.names}
cdef Py_ssize_t H_MAGIC = _F["magic"], H_VERSION = _F["version"], H_TYPE = _F["type"]
cdef Py_ssize_t H_FLAGS = _F["flags"], H_JOB = _F["job_id"], H_WORKER = _F["worker_id"]
cdef Py_ssize_t H_PART = _F["partition"], H_ROUND = _F["round"], H_SEQ = _F["seq"]
cdef Py_ssize_t H_COUNT = _F["count"], H_TOTAL = _F["total"], H_SCALE = _F["scale_exp"]
cdef Py_ssize_t H_BASE = _F["base"], HDR = _wire.HDR_LEN
cdef uint32_t MAGIC = _wire.MAGIC
cdef uint8_t VERSION = _wire.VERSION
cdef uint8_t T_SPARSE_RESULT = int(_wire.PacketType.SPARSE_RESULT)
cdef uint16_t F_LAST = int(_wire.Flags.LAST)
cdef uint16_t DPU_SENDER = _wire.DPU_SENDER_ID
# the writer below stores each field at the width numpy's HEADER_DTYPE gives it, big-endian
_WIDTH = {"magic": 4, "version": 1, "type": 1, "flags": 2, "job_id": 4, "worker_id": 2,
          "partition": 2, "round": 4, "seq": 2, "count": 2, "total": 2, "scale_exp": 1, "base": 4}
for _n, _w in _WIDTH.items():
    _dt = _wire.HEADER_DTYPE.fields[_n][0]
    if _dt.itemsize != _w or (_w > 1 and _dt.byteorder != ">"):
        raise ImportError(f"dosa.wire header field {_n} is {_dt}, the result writer expects "
                          f"{_w} bytes big-endian")
if [(n, str(np.dtype(d))) for n, d in _wire.PAYLOAD_BLOCKS[_wire.PacketType.SPARSE_RESULT]] != \
        [("offset", ">u2"), ("value", ">i4")]:
    raise ImportError("dosa.wire's SPARSE_RESULT payload is no longer u16 offsets + s32 values")


cdef inline Py_ssize_t _value_off(Py_ssize_t c) noexcept nogil:
    # the u16 offsets block padded to 4 bytes (checked against wire.value_offset at import)
    return HDR + 2 * c + 2 * (c & 1)


cdef inline Py_ssize_t _length(Py_ssize_t c) noexcept nogil:
    # checked against wire.payload_length(SPARSE_RESULT, c) at import
    return _value_off(c) + 4 * c


for _c in range(max(_wire.MAX_ENTRIES.values()) + 2):
    if _value_off(_c) != _wire.value_offset(_c) or \
            _length(_c) != _wire.payload_length(_wire.PacketType.SPARSE_RESULT, _c):
        raise ImportError(f"dosa.wire's sparse layout at count {_c} differs from the result writer")


cdef inline void _be16(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>(v >> 8)
    p[1] = <uint8_t>v


cdef inline void _be32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>(v >> 24)
    p[1] = <uint8_t>(v >> 16)
    p[2] = <uint8_t>(v >> 8)
    p[3] = <uint8_t>v


def write_sparse_results(uint8_t[:, ::1] data, int64_t[::1] lengths, int64_t[::1] dest,
                         const uint32_t[::1] idx, const int32_t[::1] vals,
                         const int64_t[::1] e_begin, const int64_t[::1] e_end,
                         const int64_t[::1] parts, const int64_t[::1] base,
                         const int64_t[::1] row_begin, const int64_t[::1] npk, Py_ssize_t per_packet,
                         uint32_t job_id, uint32_t rnd, int scale_exp, uint16_t flags,
                         int64_t dest_value):
    """SPARSE_RESULT packets of several partitions into a zeroed PacketBatch (``data``, ``lengths``,
    ``dest``): partition k (number ``parts[k]``, entries ``idx/vals[e_begin[k] : e_end[k]]``,
    absolute indices sorted ascending, offsets from ``base[k]``) fills the ``npk[k]`` rows from
    ``row_begin[k]``, ``per_packet`` entries a packet with the short one last, exactly as
    dosa.packetizer lays them out (at least one packet, an empty one for no entries)."""
    cdef Py_ssize_t n_parts = parts.shape[0], k, r, np_, c, e, e1, i, vo, row0
    cdef Py_ssize_t stride = data.shape[1], nrows = data.shape[0]
    cdef uint8_t* row
    cdef int64_t b
    if e_begin.shape[0] < n_parts or e_end.shape[0] < n_parts or base.shape[0] < n_parts \
            or row_begin.shape[0] < n_parts or npk.shape[0] < n_parts:
        raise ValueError("write_sparse_results: per-partition arrays shorter than parts")
    if lengths.shape[0] < nrows or dest.shape[0] < nrows or vals.shape[0] < idx.shape[0]:
        raise ValueError("write_sparse_results: lengths/dest/values shorter than the batch/indices")
    if per_packet < 1 or _length(per_packet) > stride:
        raise ValueError(f"write_sparse_results: {per_packet} entries do not fit a {stride}-byte slot")
    for k in range(n_parts):
        c = e_end[k] - e_begin[k]
        if npk[k] < 1 or npk[k] * per_packet < c or (npk[k] - 1) * per_packet > c - (c > 0):
            raise ValueError(f"write_sparse_results: partition {parts[k]} has {c} entries but "
                             f"{npk[k]} packets")
        if e_begin[k] < 0 or e_end[k] > idx.shape[0] or row_begin[k] < 0 or row_begin[k] + npk[k] > nrows:
            raise ValueError(f"write_sparse_results: partition {parts[k]} lies outside the "
                             "entries or the batch")
    with nogil:
        for k in range(n_parts):
            np_ = npk[k]
            e1 = e_end[k]
            b = base[k]
            row0 = row_begin[k]
            for r in range(np_):
                row = &data[row0 + r, 0]
                e = e_begin[k] + r * per_packet
                c = per_packet if e1 - e > per_packet else e1 - e
                _be32(row + H_MAGIC, MAGIC)
                row[H_VERSION] = VERSION
                row[H_TYPE] = T_SPARSE_RESULT
                _be16(row + H_FLAGS, flags | (F_LAST if r == np_ - 1 else 0))
                _be32(row + H_JOB, job_id)
                _be16(row + H_WORKER, DPU_SENDER)
                _be16(row + H_PART, <uint32_t>parts[k])
                _be32(row + H_ROUND, rnd)
                _be16(row + H_SEQ, <uint32_t>r)
                _be16(row + H_COUNT, <uint32_t>c)
                _be16(row + H_TOTAL, <uint32_t>np_)
                row[H_SCALE] = <uint8_t><int8_t>scale_exp
                _be32(row + H_BASE, <uint32_t>b)
                vo = _value_off(c)
                for i in range(c):
                    _be16(row + HDR + 2 * i, <uint32_t>(<int64_t>idx[e + i] - b))
                    _be32(row + vo + 4 * i, <uint32_t>vals[e + i])
                lengths[row0 + r] = _length(c)
                dest[row0 + r] = dest_value


def clear_indices(int64_t[::1] buf, const uint32_t[::1] idx, int64_t base_index):
    """Zero ``buf`` at ``idx - base_index``: clears a buffer in O(non-zeros) instead of a memset of
    the whole partition (the indices are the ones extract_nonzero returned)."""
    cdef Py_ssize_t n = idx.shape[0], i
    cdef int64_t k, size = buf.shape[0]
    with nogil:
        for i in range(n):
            k = <int64_t>idx[i] - base_index
            if 0 <= k < size:
                buf[k] = 0
