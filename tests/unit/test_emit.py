"""The DPU's result fast path (dpu_fw.emit.build_results, the Cython extract_many +
write_sparse_results) builds byte for byte the packets dosa.packetizer.packetize_results builds
from the same sums."""
import numpy as np
import pytest

from dosa import wire
from dosa.packetizer import packetize_results, parse_batch
from dosa.wire import Flags, PartitionMap
from dpu_fw import _merge
from dpu_fw.emit import Scratch, build_results


def _buffers(pmap, parts, rng, density, sat=False):
    bufs = []
    for p in parts:
        lo, hi = p * pmap.partition_size, min((p + 1) * pmap.partition_size, pmap.numel)
        b = np.zeros(hi - lo, np.int64)
        n = int(rng.binomial(hi - lo, density[p % len(density)]))
        at = rng.choice(hi - lo, n, replace=False)
        b[at] = rng.integers(-2**31 + 1, 2**31 - 1, n) // 4
        if sat and n:
            b[at[0]] = 2**33
            b[at[-1]] = -2**35
        bufs.append(b)
    return bufs


def _reference(bufs, parts, pmap, **kw):
    idx, sums, nsat = [], [], 0
    for p, b in zip(parts, bufs):
        i, s, ns = _merge.extract_nonzero(b, p * pmap.partition_size)
        idx.append(i)
        sums.append(s)
        nsat += ns
    return packetize_results(np.concatenate(idx), np.concatenate(sums), pmap, partitions=parts,
                             **kw), nsat


def _same(a, b):
    assert a.data.shape == b.data.shape
    assert np.array_equal(a.lengths, b.lengths)
    assert np.array_equal(a.dest, b.dest)
    assert np.array_equal(a.data, b.data)  # whole slots, padding past the length included


@pytest.mark.parametrize("mtu", [1500, 3500, 576])
@pytest.mark.parametrize("sat", [False, True])
def test_fast_path_is_byte_identical_to_packetize_results(mtu, sat):
    rng = np.random.default_rng(mtu + sat)
    # 7 partitions, the last 10007 entries long; empty, sparse, and multi-packet partitions
    pmap = PartitionMap(numel=6 * 65536 + 10007, partition_size=65536)
    parts = np.array([0, 1, 2, 4, 5, 6])
    density = [0.0, 0.01, 0.05, 0.0005, 0.02, 0.03]
    bufs = _buffers(pmap, parts, rng, density, sat)
    kw = dict(job_id=7, round=12345, scale_exp=-5, flags=0, mtu=mtu)
    res = build_results(bufs, parts, parts * 65536, pmap, scratch=Scratch(), **kw)
    ref, nsat = _reference(bufs, parts, pmap, **kw)
    assert res.fast
    _same(res.batch, ref)
    assert int(res.nsat.sum()) == nsat and (nsat > 0) == sat
    # rows: partition k's packets, in order; idx/starts: its non-zeros
    h = res.batch.headers()
    for k, p in enumerate(parts):
        sl = slice(res.rows[k], res.rows[k + 1])
        assert (h["partition"][sl] == p).all() and list(h["seq"][sl]) == list(range(sl.stop - sl.start))
        nz = np.flatnonzero(bufs[k]) + p * 65536
        assert np.array_equal(res.idx[res.starts[k]:res.starts[k + 1]], nz)
    assert (h["total"] > 1).any()  # multi-packet partitions were exercised
    parse_batch(res.batch)  # and every packet is valid


def test_gtopk_flag_header_fields_and_one_partition():
    rng = np.random.default_rng(3)
    pmap = PartitionMap(numel=3 * 65536, partition_size=65536)
    parts = np.array([2])
    bufs = _buffers(pmap, parts, rng, [0.004])
    kw = dict(job_id=2**32 - 1, round=2**32 - 1, scale_exp=wire.SCALE_EXP_MAX,
              flags=int(Flags.GTOPK | Flags.RETRANSMIT), mtu=1500)
    res = build_results(bufs, parts, parts * 65536, pmap, **kw)
    _same(res.batch, _reference(bufs, parts, pmap, **kw)[0])
    kw["scale_exp"] = wire.SCALE_EXP_MIN
    res = build_results(bufs, parts, parts * 65536, pmap, **kw)
    _same(res.batch, _reference(bufs, parts, pmap, **kw)[0])


def test_all_empty_and_no_partitions():
    pmap = PartitionMap(numel=2 * 65536, partition_size=65536)
    parts = np.array([0, 1])
    bufs = [np.zeros(65536, np.int64), np.zeros(65536, np.int64)]
    kw = dict(job_id=1, round=0, scale_exp=0, mtu=1500)
    res = build_results(bufs, parts, parts * 65536, pmap, **kw)
    assert res.fast and len(res.batch) == 2
    _same(res.batch, _reference(bufs, parts, pmap, **kw)[0])
    res = build_results([], np.zeros(0, np.int64), np.zeros(0, np.int64), pmap, **kw)
    assert len(res.batch) == 0 and list(res.rows) == [0]


@pytest.mark.parametrize("mtu", [1500, 3500])
def test_dense_partition_falls_back_to_packetize_results(mtu):
    rng = np.random.default_rng(5)
    pmap = PartitionMap(numel=3 * 65536 + 100, partition_size=65536)
    parts = np.array([0, 1, 2, 3])
    bufs = _buffers(pmap, parts, rng, [0.01, 0.0, 0.01, 0.02])
    bufs[1][1000:3000] = rng.integers(1, 1000, 2000)  # a run denser than the break-even
    bufs[3][10:90] = 5
    kw = dict(job_id=3, round=4, scale_exp=1, mtu=mtu)
    res = build_results(bufs, parts, parts * 65536, pmap, **kw)
    ref = _reference(bufs, parts, pmap, **kw)[0]
    assert not res.fast
    _same(res.batch, ref)
    h = res.batch.headers()
    dense = [k for k in range(4) if (h["type"][res.rows[k]:res.rows[k + 1]] == wire.PacketType.DENSE_RESULT).all()]
    assert dense == [1, 3]  # the others went through the Cython writer
    for k, p in enumerate(parts):
        assert (h["partition"][res.rows[k]:res.rows[k + 1]] == p).all()


def test_too_many_entries_raise_like_packetize_results():
    pmap = PartitionMap(numel=65536, partition_size=65536)
    b = np.zeros(65536, np.int64)
    b[::2] = 1  # 32768 entries over the whole span: sparse (1/2 < 2/3) needs > 256 packets at 576
    with pytest.raises(ValueError, match="packets"):
        build_results([b], np.array([0]), np.array([0]), pmap, job_id=1, round=0, scale_exp=0, mtu=576)


def test_write_sparse_results_checks_its_arguments():
    batch = wire.PacketBatch.empty(2, wire.stride_for_mtu(1500))
    e = np.zeros(0, np.uint32)
    with pytest.raises(ValueError, match="entries but"):
        _merge.write_sparse_results(batch.data, batch.lengths, batch.dest, e, np.zeros(0, np.int32),
                                    np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                                    np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([2]), 240,
                                    1, 0, 0, 0, -1)
    with pytest.raises(ValueError, match="do not fit"):
        _merge.write_sparse_results(batch.data, batch.lengths, batch.dest, e, np.zeros(0, np.int32),
                                    np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                                    np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([1]), 400,
                                    1, 0, 0, 0, -1)
    with pytest.raises(ValueError, match="outside"):
        _merge.write_sparse_results(batch.data, batch.lengths, batch.dest, e, np.zeros(0, np.int32),
                                    np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                                    np.zeros(1, np.int64), np.array([2]), np.array([1]), 240,
                                    1, 0, 0, 0, -1)


def _touched(n, rng, density, cap, cancel=0.1, sat=False):
    """A buffer of n sums built the way XDP builds it, with its touched list: random s32 adds (some
    0, some cancelling an entry back to zero, then maybe touching it again), each 0 -> non-zero
    transition appending the entry's offset while the list has room; the count keeps going."""
    at = rng.choice(n, int(rng.binomial(n, density)), replace=False)
    adds = [(int(o), int(v)) for o, v in zip(at, rng.integers(-2**20, 2**20, len(at)))]
    for o in at[:int(len(at) * cancel)].tolist():  # back to zero; half of them touched again
        adds += [(o, "cancel")] + ([(o, int(rng.integers(1, 100)))] if rng.random() < 0.5 else [])
    adds += [(int(o), 0) for o in rng.choice(n, 5)]  # zero values: no add, no listing
    if sat and len(at):
        adds += [(int(at[0]), 2**31 - 1)] * 3 + [(int(at[-1]), -2**31 + 1)] * 3
    buf = np.zeros(n, np.int64)
    lst = np.zeros(cap, np.uint16)
    count = 0
    for o, v in adds:
        v = -int(buf[o]) if v == "cancel" else v
        if v == 0:
            continue
        old = buf[o]
        buf[o] += v
        if old == 0:
            if count < cap:
                lst[count] = o
            count += 1
    return buf, lst, count


@pytest.mark.parametrize("mtu", [1500, 3500])
def test_touched_lists_give_byte_for_byte_the_full_scan_s_results(mtu):
    """build_results reading touched lists (duplicates, entries cancelled to zero, an overflowed
    list that falls back to the scan, empty lists, a partition without a list, saturated sums, a
    short last partition, a dense fallback) equals the full scan in every output."""
    rng = np.random.default_rng(mtu)
    pmap = PartitionMap(numel=7 * 65536 + 10007, partition_size=65536)
    parts = np.arange(8)
    density = [0.02, 0.0, 0.03, 0.3, 0.001, 0.02, 0.0, 0.04]  # 3: more than the list holds
    bufs, lists = [], []
    for k, p in enumerate(parts):
        lo, hi = pmap.bounds(int(p))
        b, lst, count = _touched(hi - lo, rng, density[k], 16384, sat=k == 2)
        bufs.append(b)
        lists.append((lst, count))
    assert lists[3][1] > 16384 and lists[1][1] == 0  # one overflowed, one empty
    assert any(len(set(lst[:c].tolist())) < c for lst, c in lists if c <= len(lst))  # duplicates
    lists[5] = None  # no list: scanned
    bufs[6][1000:3000] = rng.integers(1, 1000, 2000)  # a dense run (listed, as XDP would have)
    lists[6] = (np.arange(1000, 1000 + 16384, dtype=np.uint16), 2000)
    kw = dict(job_id=9, round=3, scale_exp=2, mtu=mtu)
    scratch = Scratch()
    full = build_results(bufs, parts, parts * 65536, pmap, **kw)
    got = build_results(bufs, parts, parts * 65536, pmap, scratch=scratch, lists=lists, **kw)
    _same(got.batch, full.batch)
    for name in ("rows", "idx", "sums", "starts", "nsat"):
        assert np.array_equal(getattr(got, name), getattr(full, name)), name
    assert got.nsat[2] > 0 and not got.fast
    assert not scratch.bits.any()  # the bitmap is left zeroed for the next call


def test_the_list_is_what_is_read_unless_it_overflowed():
    """A list missing a non-zero loses it (so the list, not the buffer, was read); the same list
    with a count past its capacity makes extract_listed scan the buffer; a count of 0 reads nothing."""
    rng = np.random.default_rng(4)
    buf, lst, count = _touched(65536, rng, 0.02, 16384)
    ref = _merge.extract_nonzero(buf, 123)
    got = _merge.extract_listed(buf, lst, count, 123)
    assert all(np.array_equal(a, b) for a, b in zip(got[:2], ref[:2])) and got[2] == ref[2]
    first = next(int(o) for o in lst[:count] if buf[o] != 0)
    other = next(int(o) for o in lst[:count] if o != first)
    short = lst.copy()
    short[:count][short[:count] == first] = other  # forget one non-zero entry
    got = _merge.extract_listed(buf, short, count, 123)
    assert 123 + first not in got[0].tolist() and len(got[0]) == len(ref[0]) - 1
    got = _merge.extract_listed(buf, short, len(short) + 1, 123)  # overflowed: scanned
    assert np.array_equal(got[0], ref[0])
    assert len(_merge.extract_listed(buf, lst, 0, 123)[0]) == 0
    # extract_many: mixed list / no list / overflowed, against the scan of every buffer
    bufs = [buf, buf[:1000].copy(), buf.copy()]
    n = sum(len(b) for b in bufs)
    outs = []
    for lists in (None, [(lst, count), None, (short, len(short) + 5)]):
        oi, ov = np.empty(n, np.uint32), np.empty(n, np.int32)
        st, ns = np.empty(4, np.int64), np.empty(3, np.int64)
        m = _merge.extract_many(bufs, np.array([0, 70000, 140000]), oi, ov, st, ns, lists)
        outs.append((oi[:m].copy(), ov[:m].copy(), st.copy(), ns.copy()))
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    with pytest.raises(ValueError, match="touched lists"):
        _merge.extract_many(bufs, np.zeros(3, np.int64), oi, ov, st, ns, [None])
