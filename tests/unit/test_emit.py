"""The DPU's completion kernels (dpu_fw/_results.pyx): a buffer's non-zero sums read through its
touched list equal the scan's; gtopk's selection; and the result packets are byte for byte what
dosa.packetizer.packetize_results builds from the same sums (so a capture verifies, and a rebuilt
answer equals the fan-out)."""
import numpy as np
import pytest

from dosa.packetizer import packetize_results
from dosa.wire import Flags, PartitionMap
from dpu_fw._results import extract_py, partition_result, top_k_py

pytestmark = pytest.mark.timeout(60)


def _touched(n, rng, density, cap, cancel=0.1):
    """A buffer of n s32 sums built the way XDP builds it, with its touched list: each packet of
    each worker lists its offsets (duplicates across workers), some sums cancel back to zero, the
    count keeps growing past the capacity (overflow)."""
    buf = np.zeros(n, np.int32)
    lst = np.zeros(cap, np.uint16)
    count = 0
    for _w in range(3):
        at = np.sort(rng.choice(n, int(rng.binomial(n, density)), replace=False))
        buf[at] += rng.integers(-2**20, 2**20, len(at)).astype(np.int32)
        if count + len(at) <= cap:
            lst[count:count + len(at)] = at
        count += -(-len(at) // 4) * 4  # whole words, as XDP reserves them
    nz = np.flatnonzero(buf)
    buf[nz[:int(len(nz) * cancel)]] = 0  # cancelled: listed, zero
    return buf, lst, count


def _scan(buf, lo):
    nz = np.flatnonzero(buf)
    return (lo + nz).astype(np.uint32), buf[nz]


def test_the_list_gives_the_scan_s_entries_and_is_what_is_read():
    rng = np.random.default_rng(4)
    buf, lst, count = _touched(65536, rng, 0.02, 16384)
    ref = _scan(buf, 123)
    got = extract_py(buf, lst, count, 123)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    # a list missing a non-zero loses it: the list, not the buffer, was read
    first = next(int(o) for o in lst[:count] if buf[o] != 0)
    short = lst.copy()
    short[:count][short[:count] == first] = 0 if first else 1
    got = extract_py(buf, short, count, 123)
    assert 123 + first not in got[0].tolist() and len(got[0]) == len(ref[0]) - (buf[0 if first else 1] == 0)
    # overflowed (count past the capacity) or no list: the scan
    for lst_, c in ((short, len(short) + 4), (None, 0)):
        got = extract_py(buf, lst_, c, 123)
        assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert len(extract_py(buf, lst, 0, 123)[0]) == 0  # an empty list names nothing


def test_offsets_past_the_buffer_are_ignored():
    buf = np.zeros(1000, np.int32)
    buf[[3, 999]] = [7, -1]
    lst = np.array([999, 3, 5000, 65535, 3, 0, 0, 0], np.uint16)
    got = extract_py(buf, lst, 8, 10)
    assert got[0].tolist() == [13, 1009] and got[1].tolist() == [7, -1]


def test_top_k_keeps_the_largest_ties_to_the_smaller_index_in_index_order():
    idx = np.arange(10, 30, dtype=np.uint32)
    sums = np.array([5, -5, 1, 9, -9, 2, 5, 0, 3, -5, 7, 7, 1, 1, 1, 2, 8, -8, 4, 6], np.int32)
    i, s = top_k_py(idx, sums, 6)
    assert i.tolist() == [13, 14, 20, 21, 26, 27] and s.tolist() == [9, -9, 7, 7, 8, -8]
    i, s = top_k_py(idx, sums, 9)  # |6| then two of the four |5|: 10 and 11 (smaller index wins)
    assert i.tolist() == [10, 11, 13, 14, 20, 21, 26, 27, 29]
    assert top_k_py(idx, sums, 20)[0].tolist() == idx.tolist()
    rng = np.random.default_rng(1)
    for _ in range(50):  # against numpy's stable sort
        n, k = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        v = rng.integers(-20, 20, n).astype(np.int32)
        ix = np.arange(n, dtype=np.uint32)
        keep = np.sort(np.argsort(-np.abs(v.astype(np.int64)), kind="stable")[:k])
        assert top_k_py(ix, v, k)[0].tolist() == keep.tolist()


@pytest.mark.parametrize("mtu", [1500, 3500, 576])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.5, 0.9])
def test_result_packets_are_packetize_results_byte_for_byte(mtu, density):
    """Sparse results of any size (one empty packet for none), dense runs where fewer bytes, the
    gtopk flag: the same packets as packetize_results (the packetizer's header fields, padding,
    lengths) for a full and a short partition."""
    rng = np.random.default_rng(int(density * 1000) + mtu)
    pmap = PartitionMap(numel=65536 + 10007, partition_size=65536)
    for p in (0, 1):
        lo, hi = pmap.bounds(p)
        at = np.sort(rng.choice(hi - lo, int((hi - lo) * density), replace=False))
        idx = (lo + at).astype(np.uint32)
        sums = rng.integers(-2**31 + 1, 2**31 - 1, len(at)).astype(np.int32)
        sums[sums == 0] = 1
        for flags in (0, int(Flags.GTOPK)):
            kw = dict(scale_exp=-2, flags=flags, mtu=mtu)
            try:
                ref = packetize_results(idx, sums, pmap, job_id=9, round=3, partitions=[p], **kw)
            except ValueError:  # more than the protocol carries at this MTU: refused by both
                with pytest.raises(ValueError, match="more than 256 packets"):
                    partition_result(idx, sums, job_id=9, rnd=3, partition=p, lo=lo, **kw)
                continue
            data, lengths = partition_result(idx, sums, job_id=9, rnd=3, partition=p, lo=lo, **kw)
            assert np.array_equal(lengths, ref.lengths)
            for k in range(len(ref)):
                assert bytes(data[k, :lengths[k]]) == bytes(ref.data[k, :ref.lengths[k]]), (p, k)


def test_more_entries_than_the_protocol_carries_is_an_error():
    """At MTU 576 neither encoding carries half of a 65536-entry partition in 256 packets."""
    idx = np.arange(0, 65536, 2, dtype=np.uint32)
    with pytest.raises(ValueError, match="need more than 256 packets"):
        partition_result(idx, np.ones(len(idx), np.int32), job_id=1, rnd=0, scale_exp=0, flags=0,
                         partition=0, lo=0, mtu=576)
