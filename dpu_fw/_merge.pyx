# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Hot loops of the DPU worker: the userspace merge state machine (the same rules the XDP dataplane
applies, see docs/protocol.md *Rounds, buffers, duplicates*), result extraction and buffer clearing.

Public wrappers with argument checks live in ``dpu_fw/userspace.py``; everything here runs without
the GIL over typed memoryviews; a batch costs one call, never one Python step per packet.
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t

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


def extract_nonzero(const int64_t[::1] buf, int64_t base_index):
    """Non-zero sums of ``buf`` as (absolute u32 indices, s32 sums, number saturated).

    A sum outside s32 cannot happen when hosts respect the clip bound C = (2^31-1)/W; if it does it
    is saturated and counted, so the caller can report it instead of sending a wrapped value.

    One pass over the buffer (it is the DPU's biggest per-round cost: a 25M-entry job reads 200 MB
    of sums a round, ~1-3 % of them non-zero): blocks of 8 sums are OR-ed and skipped when all are
    zero, and the non-zeros go to scratch arrays sized for the worst case, copied out at the end.
    """
    cdef Py_ssize_t n = buf.shape[0], i, j, k = 0, nsat = 0, nb = n - n % 8
    cdef int64_t v
    scratch_i = np.empty(n, np.uint32)
    scratch_v = np.empty(n, np.int32)
    cdef uint32_t[::1] oi = scratch_i
    cdef int32_t[::1] os = scratch_v
    with nogil:
        i = 0
        while i < n:
            if i < nb and (buf[i] | buf[i + 1] | buf[i + 2] | buf[i + 3] | buf[i + 4] | buf[i + 5]
                           | buf[i + 6] | buf[i + 7]) == 0:
                i += 8
                continue
            j = i + 8 if i < nb else n
            while i < j:
                v = buf[i]
                if v != 0:
                    oi[k] = <uint32_t>(base_index + i)
                    if v > 2147483647:
                        v = 2147483647
                        nsat += 1
                    elif v < -2147483647:
                        v = -2147483647
                        nsat += 1
                    os[k] = <int32_t>v
                    k += 1
                i += 1
    return scratch_i[:k].copy(), scratch_v[:k].copy(), nsat


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
