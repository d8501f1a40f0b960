# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The completion path's kernels: from a completed aggregation buffer to its result packets.

* ``extract``: the non-zero sums of a buffer (s32, index order) read at the offsets of its touched
  list (dataplane/dosa_xdp.c list_offsets()) or, when the list overflowed, by a scan of the buffer.
* ``top_k``: gtopk's selection, the k largest |sum| with ties to the smaller index, kept in index
  order (the rule of every DPU and every check: dosa.job's gtopk, capture verify).
* ``packets_for`` / ``write_results``: SPARSE_RESULT packets, or DENSE_RESULT where the dense run
  is fewer bytes on the wire (``dosa.wire.encoded_bytes``, checked at import), byte for byte what
  ``dosa.packetizer.packetize_results`` builds from the same entries (tests/unit/test_emit.py).

All nogil on raw pointers: the engine (dpu_fw/_completion.pyx) calls them once per completion with
no Python in between. The Python wrappers at the bottom are for tests and ``dosa bench dpu``.
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from ._state cimport (DOSA_DPU_SENDER_ID, DOSA_F_LAST, DOSA_HDR_LEN, DOSA_MAGIC,
                      DOSA_MAX_PACKETS_PER_CONTRIBUTION, DOSA_T_DENSE_RESULT,
                      DOSA_T_SPARSE_RESULT, DOSA_VERSION, dosa_hdr)

from dosa import wire as _wire

cdef extern from *:
    """
    #include <arpa/inet.h>
    """
    int __builtin_ctzll(unsigned long long) nogil
    void __builtin_prefetch(const void*) nogil
    uint16_t htons(uint16_t) nogil
    uint32_t htonl(uint32_t) nogil

cdef enum:
    PREFETCH = 16  # sums the listed gather prefetches ahead: each is a cache miss of its own

cdef int64_t PACKET_OVERHEAD = _wire.PACKET_OVERHEAD
cdef uint32_t MAX_SPARSE_BASE = _wire.MAX_SPARSE_BASE


cdef inline Py_ssize_t _scan(const int32_t* sums, Py_ssize_t n, uint32_t lo, uint32_t* oi,
                             int32_t* ov) noexcept nogil:
    """Non-zeros of sums[0:n] by a pass over the buffer: blocks of 16 sums OR-ed and skipped when
    zero, a block that is not stored without a branch (the output advances where non-zero)."""
    cdef Py_ssize_t i = 0, j, k = 0, end
    cdef int32_t v, acc
    while i < n:
        end = i + 16 if i + 16 <= n else n
        acc = 0
        for j in range(i, end):
            acc |= sums[j]
        if acc != 0:
            for j in range(i, end):
                v = sums[j]
                oi[k] = lo + <uint32_t>j
                ov[k] = v
                k += v != 0
        i = end
    return k


cdef Py_ssize_t extract(const int32_t* sums, Py_ssize_t n, const uint16_t* lst, uint64_t count,
                        uint32_t list_cap, uint64_t* bits, uint32_t lo, uint32_t* oi,
                        int32_t* ov) noexcept nogil:
    """The non-zero sums of a buffer (``sums[i]`` is index ``lo + i``, i < n <= 65536) into
    ``oi``/``ov`` (absolute indices, ascending; room for n), returning how many.

    With a list that did not overflow (0 < count <= list_cap): the listed offsets name every
    non-zero sum, most more than once (once per worker), some whose sum is zero, some past n (the
    bytes after a packet's offsets in its last word). A bit per offset in ``bits`` (BITMAP_WORDS
    zeroed words, zeroed again on return) sorts and deduplicates them; the words between the lowest
    and highest set are walked in order into ``oi``; then the sums are gathered in a loop of its
    own, prefetching PREFETCH ahead (each is a cache miss: only a loop free of data-dependent
    branches keeps enough in flight), and the zeros dropped by advancing the output only where the
    sum is not zero. Otherwise a scan."""
    cdef Py_ssize_t i, j, w, m = 0, k = 0, wlo = BITMAP_WORDS, whi = -1
    cdef uint64_t word
    cdef int32_t v
    if list_cap == 0 or count > list_cap or n > 65536:
        return _scan(sums, n, lo, oi, ov)
    for i in range(<Py_ssize_t>count):
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
            __builtin_prefetch(&sums[oi[i + PREFETCH]])
        j = oi[i]
        v = sums[j]
        oi[k] = lo + <uint32_t>j
        ov[k] = v
        k += v != 0
    return k


cdef inline int64_t _abs(int32_t v) noexcept nogil:
    return -<int64_t>v if v < 0 else <int64_t>v


cdef int64_t _select(int64_t* a, Py_ssize_t n, Py_ssize_t kth) noexcept nogil:
    """The value that would sit at position ``kth`` of ``a[0:n]`` sorted ascending (a is
    permuted): quickselect, median-of-three pivots."""
    cdef Py_ssize_t lo = 0, hi = n - 1, i, j, mid
    cdef int64_t p, t
    while hi > lo:
        mid = lo + (hi - lo) // 2
        if a[mid] < a[lo]:
            t = a[mid]; a[mid] = a[lo]; a[lo] = t
        if a[hi] < a[lo]:
            t = a[hi]; a[hi] = a[lo]; a[lo] = t
        if a[hi] < a[mid]:
            t = a[hi]; a[hi] = a[mid]; a[mid] = t
        p = a[mid]
        i = lo
        j = hi
        while i <= j:
            while a[i] < p:
                i += 1
            while a[j] > p:
                j -= 1
            if i <= j:
                t = a[i]; a[i] = a[j]; a[j] = t
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            return a[kth]
    return a[kth]


cdef Py_ssize_t top_k(uint32_t* oi, int32_t* ov, Py_ssize_t n, Py_ssize_t k,
                      int64_t* scratch) noexcept nogil:
    """Keep, in place and in index order, the ``k`` entries of largest |sum|, ties broken by the
    smaller index (dpu_fw.userspace.top_k_abs's rule); returns the new count. ``scratch`` holds n."""
    cdef Py_ssize_t i, c = 0, need, out = 0
    cdef int64_t thr, a
    if n <= k:
        return n
    if k <= 0:
        return 0
    for i in range(n):
        scratch[i] = _abs(ov[i])
    thr = _select(scratch, n, n - k)
    for i in range(n):
        c += _abs(ov[i]) > thr
    need = k - c
    for i in range(n):
        a = _abs(ov[i])
        if a > thr or (a == thr and need > 0):
            need -= a == thr
            oi[out] = oi[i]
            ov[out] = ov[i]
            out += 1
    return out


cdef Py_ssize_t packets_for(Py_ssize_t count, Py_ssize_t span, const Writer* w,
                            bint* dense) noexcept nogil:
    """Packets of a partition's result of ``count`` entries spread over ``span`` indices, in the
    encoding of fewer bytes on the wire (dosa.wire.encoded_bytes: sparse, 6 bytes an entry, or
    one dense run, 4 bytes an index of the span); sets ``dense``. -1 past the protocol's limit."""
    cdef Py_ssize_t per_s = w.per_sparse, per_d = w.per_dense
    cdef Py_ssize_t npk_s = (count + per_s - 1) // per_s if count > 0 else 1
    cdef Py_ssize_t tail = count - (npk_s - 1) * per_s
    cdef int64_t sparse_b = 6 * count + 2 * ((npk_s - 1) * (per_s & 1) + (tail & 1)) \
        + npk_s * PACKET_OVERHEAD
    cdef Py_ssize_t npk_d = (span + per_d - 1) // per_d
    cdef int64_t dense_b = 4 * span + npk_d * PACKET_OVERHEAD
    dense[0] = count > 0 and span > 0 and dense_b < sparse_b
    cdef Py_ssize_t npk = npk_d if dense[0] else npk_s
    return npk if npk <= DOSA_MAX_PACKETS_PER_CONTRIBUTION else -1


cdef inline void _header(uint8_t* row, const Writer* w, uint8_t ptype, uint32_t partition,
                         Py_ssize_t seq, Py_ssize_t count, Py_ssize_t total,
                         uint32_t base) noexcept nogil:
    cdef dosa_hdr* h = <dosa_hdr*>row
    h.magic = htonl(DOSA_MAGIC)
    h.version = DOSA_VERSION
    h.type = ptype
    h.flags = htons(<uint16_t>(w.flags | (DOSA_F_LAST if seq == total - 1 else 0)))
    h.job_id = htonl(w.job_id)
    h.worker_id = htons(DOSA_DPU_SENDER_ID)
    h.partition = htons(<uint16_t>partition)
    h.round = htonl(w.rnd)
    h.seq = htons(<uint16_t>seq)
    h.count = htons(<uint16_t>count)
    h.total = htons(<uint16_t>total)
    h.scale_exp = <int8_t>w.scale_exp
    h.reserved = 0
    h.base = htonl(base)


cdef void write_results(uint8_t* rows, int64_t* lengths, const Writer* w, uint32_t partition,
                        uint32_t lo, const uint32_t* oi, const int32_t* ov, Py_ssize_t n,
                        Py_ssize_t npk, bint dense) noexcept nogil:
    """The ``npk`` result packets (``packets_for``) of a partition whose first index is ``lo`` and
    whose result is the ``n`` entries oi/ov (ascending), into rows ``rows + r * stride`` with their
    lengths: a SPARSE_RESULT packet carries per_sparse entries (the short one last; one empty packet
    for no entries) as u16 offsets from min(lo, MAX_SPARSE_BASE) then s32 values; a DENSE_RESULT
    packet per_dense values of the run from the first entry's index, zeros between entries."""
    cdef Py_ssize_t r, c, e, i, vo, first_e = 0
    cdef uint8_t* row
    cdef uint32_t base, first, dbase
    cdef uint16_t* po
    cdef uint32_t* pv
    if not dense:
        base = lo if lo < MAX_SPARSE_BASE else MAX_SPARSE_BASE
        for r in range(npk):
            row = rows + r * w.stride
            e = r * w.per_sparse
            c = w.per_sparse if n - e > w.per_sparse else n - e
            _header(row, w, DOSA_T_SPARSE_RESULT, partition, r, c, npk, base)
            vo = DOSA_HDR_LEN + 2 * c + 2 * (c & 1)
            po = <uint16_t*>(row + DOSA_HDR_LEN)
            pv = <uint32_t*>(row + vo)
            for i in range(c):
                po[i] = htons(<uint16_t>(oi[e + i] - base))
                pv[i] = htonl(<uint32_t>ov[e + i])
            if c & 1:
                po[c] = 0  # the padding before the values
            lengths[r] = vo + 4 * c
        return
    first = oi[0]
    for r in range(npk):
        row = rows + r * w.stride
        dbase = first + <uint32_t>(r * w.per_dense)
        c = (oi[n - 1] - dbase + 1) if oi[n - 1] - dbase + 1 < <uint32_t>w.per_dense else w.per_dense
        _header(row, w, DOSA_T_DENSE_RESULT, partition, r, c, npk, dbase)
        pv = <uint32_t*>(row + DOSA_HDR_LEN)
        memset(pv, 0, 4 * c)
        while first_e < n and oi[first_e] < dbase + <uint32_t>c:
            pv[oi[first_e] - dbase] = htonl(<uint32_t>ov[first_e])
            first_e += 1
        lengths[r] = DOSA_HDR_LEN + 4 * c


# ---- Python wrappers (tests, dosa bench dpu) and the import-time check against dosa.wire --------

def extract_py(const int32_t[::1] sums, lst, count, uint32_t lo):
    """``extract`` of one buffer: (u32 indices, s32 sums). ``lst``: None or the touched list
    (uint16 array of its capacity) with ``count`` positions used."""
    cdef Py_ssize_t n = sums.shape[0]
    oi = np.empty(max(n, 1), np.uint32)
    ov = np.empty(max(n, 1), np.int32)
    bits = np.zeros(BITMAP_WORDS, np.uint64)
    cdef uint32_t[::1] a = oi
    cdef int32_t[::1] b = ov
    cdef uint64_t[::1] bt = bits
    cdef const uint16_t[::1] lv
    cdef Py_ssize_t m
    cdef uint32_t cap = 0
    cdef uint64_t cnt = 0
    empty = np.zeros(1, np.uint16)
    lv = empty if lst is None else lst
    if lst is not None:
        cap = <uint32_t>lv.shape[0]
        cnt = <uint64_t>count
    with nogil:
        m = extract(&sums[0] if n else NULL, n, &lv[0], cnt, cap, &bt[0], lo, &a[0], &b[0])
    return oi[:m].copy(), ov[:m].copy()


def top_k_py(idx, sums, Py_ssize_t k):
    """``top_k`` on copies: (indices, sums) of the k largest |sum|, index order."""
    oi = np.array(idx, np.uint32)
    ov = np.array(sums, np.int32)
    scratch = np.empty(max(len(oi), 1), np.int64)
    cdef uint32_t[::1] a = oi if len(oi) else np.zeros(1, np.uint32)
    cdef int32_t[::1] b = ov if len(ov) else np.zeros(1, np.int32)
    cdef int64_t[::1] s = scratch
    cdef Py_ssize_t n = len(oi), m
    with nogil:
        m = top_k(&a[0], &b[0], n, k, &s[0])
    return oi[:m], ov[:m]


def partition_result(idx, sums, *, uint32_t job_id, uint32_t rnd, int scale_exp, uint16_t flags,
                     uint32_t partition, uint32_t lo, int mtu):
    """One partition's result packets as (data (npk, stride) uint8, lengths int64)."""
    cdef Writer w
    w.job_id, w.rnd, w.scale_exp, w.flags = job_id, rnd, scale_exp, flags
    w.per_sparse = _wire.entries_per_packet(_wire.PacketType.SPARSE_RESULT, mtu)
    w.per_dense = _wire.entries_per_packet(_wire.PacketType.DENSE_RESULT, mtu)
    w.stride = _wire.stride_for_mtu(mtu)
    oi = np.ascontiguousarray(idx, np.uint32)
    ov = np.ascontiguousarray(sums, np.int32)
    cdef Py_ssize_t n = len(oi), span = int(oi[n - 1]) - int(oi[0]) + 1 if n else 0
    cdef bint dense
    cdef Py_ssize_t npk = packets_for(n, span, &w, &dense)
    if npk < 0:
        raise ValueError(f"partition {partition}: {n} entries need more than "
                         f"{DOSA_MAX_PACKETS_PER_CONTRIBUTION} packets")
    data = np.zeros((npk, w.stride), np.uint8)
    lengths = np.zeros(npk, np.int64)
    cdef uint8_t[:, ::1] d = data
    cdef int64_t[::1] ln = lengths
    cdef uint32_t[::1] a = oi if n else np.zeros(1, np.uint32)
    cdef int32_t[::1] b = ov if n else np.zeros(1, np.int32)
    write_results(&d[0, 0], &ln[0], &w, partition, lo, &a[0], &b[0], n, npk, dense)
    return data, lengths


def _check_encoding():
    """packets_for's byte rule is dosa.wire.encoded_bytes: checked at import over counts and spans
    around the packet boundaries of every MTU class (a drift fails the import, not a round)."""
    cdef Writer w
    cdef bint dense
    for mtu in (_wire.DEFAULT_MTU, _wire.MAX_MTU, 576):
        w.per_sparse = _wire.entries_per_packet(_wire.PacketType.SPARSE_RESULT, mtu)
        w.per_dense = _wire.entries_per_packet(_wire.PacketType.DENSE_RESULT, mtu)
        counts = [c for c in range(0, 3 * w.per_sparse + 3)] + [1000, 4000, 20000, 65536]
        for c in counts:
            for span in {c, c + 1, (3 * c) // 2 + 1, 2 * c, 65536}:
                if span < c or span > 65536:
                    continue
                sb, db = _wire.encoded_bytes(np.array([c]), np.array([span]), mtu)
                packets_for(c, span, &w, &dense)
                if bool(dense) != bool(c > 0 and db[0] < sb[0]):
                    raise ImportError(f"dpu_fw._results' encoding rule differs from dosa.wire's at "
                                      f"count {c}, span {span}, MTU {mtu}")


_check_encoding()
if _wire.HDR_LEN != DOSA_HDR_LEN:
    raise ImportError("dpu_fw._results and dosa.wire disagree on the header length")
