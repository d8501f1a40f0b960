"""AggregationClient against userspace DpuWorkers on loopback, in one process (threads): the whole
protocol path without namespaces or privilege. The namespace tests (tests/netns/test_allreduce_*)
cover real links, loss, XDP and failures."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from dpu_fw.worker import DpuWorker
from host_lib.client import AggregationClient, MissingWorkersError
from dosa.job import JobConfig


def free_ports(n):
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def cluster():
    made = []

    def make(workers=4, dpus=2, mode="sum", numel=100_000, timeout=5.0, mtu=1500):
        ports = free_ports(workers + dpus)
        job = JobConfig(job_id=3, numel=numel, hosts=[("127.0.0.1", p) for p in ports[:workers]],
                        dpus=[("127.0.0.1", p) for p in ports[workers:]], partition_size=8192,
                        mode=mode, density=0.01, scale_exp=8, mtu=mtu)
        ws = [DpuWorker([job], d, mode="userspace") for d in range(dpus)]
        ts = [threading.Thread(target=w.run, daemon=True) for w in ws]
        for t in ts:
            t.start()
        cs = [AggregationClient(job, worker_id=i, timeout=timeout) for i in range(workers)]
        made.append((ws, ts, cs))
        return job, cs

    make.made = made
    yield make
    for ws, ts, cs in made:
        for c in cs:
            c.close()
        for w in ws:
            w.stop()
        for t in ts:
            t.join(5)
        for w in ws:
            w.close()


def run_all(clients, fn):
    out = [None] * len(clients)
    errs = [None] * len(clients)

    def go(i):
        try:
            out[i] = fn(i, clients[i])
        except Exception as e:  # noqa: BLE001 - handed to the test
            errs[i] = e

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out, errs


def random_inputs(rng, numel, workers, n, bound=10**6):
    """Per worker: n sorted unique u32 indices below numel, int32 values in [-bound, bound)."""
    return [(np.sort(rng.choice(numel, n, replace=False)).astype(np.uint32),
             rng.integers(-bound, bound, n).astype(np.int32)) for _ in range(workers)]


def exact_total(numel, ins):
    """The exact int64 sum of every worker's (indices, values) over the index space."""
    total = np.zeros(numel, np.int64)
    for idx, q in ins:
        np.add.at(total, idx.astype(np.int64), q)
    return total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sum", "gtopk"])
def test_sparse_allreduce_over_loopback_is_exact(cluster, mode):
    job, cs = cluster(mode=mode)
    rng = np.random.default_rng(5)
    for _ in range(3):
        ins = random_inputs(rng, job.numel, 4, 1500)
        total = exact_total(job.numel, ins)
        out, errs = run_all(cs, lambda i, c: c.allreduce_sparse(*ins[i], 8))
        assert errs == [None] * 4
        for ridx, sums in out:
            assert np.array_equal(sums.astype(np.int64), total[ridx.astype(np.int64)])
            if mode == "sum":
                assert np.array_equal(ridx.astype(np.int64), np.flatnonzero(total))
            else:  # at most k per partition, and the largest |sum| of each
                part = ridx // job.partition_size
                assert np.bincount(part).max() <= int(np.ceil(job.density * job.partition_size))
                kept = np.zeros(job.numel, bool)
                kept[ridx] = True
                for p in np.unique(part):
                    sl = slice(p * job.partition_size, (p + 1) * job.partition_size)
                    a, k = np.abs(total[sl]), kept[sl]
                    assert a[k].min() >= a[~k].max()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mtu", [576, 3500])
def test_mtu_and_dense_runs_round_trip_exactly(cluster, mtu):
    """The job's MTU sizes every packet both ways; a partition denser than the break-even travels
    as a dense run (data and result) and the sums stay exact."""
    job, cs = cluster(mtu=mtu)
    rng = np.random.default_rng(mtu)
    ins = []
    for w in range(4):
        idx = np.unique(np.r_[rng.choice(job.numel, 800, replace=False), np.arange(40960, 40960 + 7000)])
        ins.append((idx.astype(np.uint32), rng.integers(-10**6, 10**6, len(idx)).astype(np.int32)))
    total = exact_total(job.numel, ins)
    out, errs = run_all(cs, lambda i, c: c.allreduce_sparse(*ins[i], 8))
    assert errs == [None] * 4
    for ridx, sums in out:
        assert np.array_equal(ridx.astype(np.int64), np.flatnonzero(total))
        assert np.array_equal(sums.astype(np.int64), total[ridx.astype(np.int64)])


@pytest.mark.timeout(60)
def test_float_allreduce_and_async_handle(cluster):
    job, cs = cluster(numel=20_000)
    for c in cs:
        c.density = 1.0
    rng = np.random.default_rng(9)
    xs = rng.standard_normal((4, job.numel)).astype(np.float32)
    out, errs = run_all(cs, lambda i, c: c.allreduce_async(xs[i]).wait(20))
    assert errs == [None] * 4
    bound = 4 * 2.0 ** (-job.scale_exp - 1)
    for o in out:
        assert np.abs(o.astype(np.float64) - xs.astype(np.float64).sum(0)).max() <= bound


@pytest.mark.timeout(60)
def test_missing_worker_is_named_within_the_timeout(cluster):
    job, cs = cluster(timeout=1.5)
    idx = np.arange(0, job.numel, 97, dtype=np.uint32)
    q = np.ones(len(idx), np.int32)
    out, errs = run_all(cs[:3], lambda i, c: c.allreduce_sparse(idx, q, 8))
    for e in errs:
        assert isinstance(e, MissingWorkersError), e
        assert e.missing == [3]
        assert "worker(s) [3]" in str(e)


@pytest.mark.timeout(60)
def test_dead_dpu_is_named_not_a_stale_worker_list(cluster):
    job, cs = cluster(timeout=1.5, dpus=1)
    idx = np.arange(0, job.numel, 97, dtype=np.uint32)
    q = np.ones(len(idx), np.int32)
    out, errs = run_all(cs, lambda i, c: c.allreduce_sparse(idx, q, 8))
    assert errs == [None] * 4
    ws, ts, _ = cluster.made[-1]
    for w in ws:
        w.stop()
    for t in ts:
        t.join(5)
    _, errs = run_all(cs, lambda i, c: c.allreduce_sparse(idx, q, 8))
    for e in errs:
        assert isinstance(e, MissingWorkersError), e
        assert e.missing == []
        assert "no recent answer from DPU(s) [0]" in str(e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sum", "gtopk"])
def test_a_result_rebuilt_for_an_ask_is_the_fanned_out_one_byte_for_byte(cluster, mode):
    """An ask is answered by rebuilding the result from the buffer (the shadow copy): the bytes
    must be the fan-out's, or a capture holds two different copies of one packet (capture verify:
    conflicting_copies). Every partition's rebuilt result is byte for byte what the packetizer
    builds from the result the hosts received."""
    from dosa.packetizer import packetize_results
    from dosa.wire import Flags

    job, cs = cluster(mode=mode, dpus=1)
    rng = np.random.default_rng(7)
    ins = [(np.unique(rng.choice(job.numel, 3000, replace=False)).astype(np.uint32), None) for _ in cs]
    ins = [(i, rng.integers(-1000, 1000, len(i)).astype(np.int32)) for i, _ in ins]
    out, errs = run_all(cs, lambda i, c: c.allreduce_sparse(*ins[i], 8))
    assert errs == [None] * len(cs)
    (ws, _, _), = cluster.made
    rt = ws[0].jobs[job.job_id]
    idx, sums = out[0]
    checked = 0
    for lp, p in enumerate(rt.owned.tolist()):
        data, lengths = rt.engine.result(job.job_id, lp, 0)
        a, b = np.searchsorted(idx, [p * job.partition_size, (p + 1) * job.partition_size])
        ref = packetize_results(idx[a:b], sums[a:b], job.pmap, job_id=job.job_id, round=0, scale_exp=8,
                                flags=int(Flags.GTOPK) if mode == "gtopk" else 0, partitions=[p],
                                mtu=job.mtu)
        assert np.array_equal(lengths, ref.lengths), (lp, p)
        assert all(bytes(data[k, :lengths[k]]) == bytes(ref.data[k, :ref.lengths[k]])
                   for k in range(len(lengths))), (lp, p)
        checked += 1
    assert checked == job.pmap.num_partitions


@pytest.mark.timeout(60)
def test_a_round_fed_range_by_range_is_exact_and_refuses_ranges_out_of_order(cluster):
    """host_lib.stream.FedRound: each host feeds its entries in three partition ranges (the first
    empty, the others not at partition boundaries of the data), from its own thread; the result is
    the same exact sum a blocking round gives, and a following blocking round still works."""
    from dosa.errors import DosaError

    job, cs = cluster(workers=3, dpus=2)
    P = job.pmap.num_partitions
    rng = np.random.default_rng(9)
    ins = random_inputs(rng, job.numel, 3, 2000)
    total = exact_total(job.numel, ins)
    cuts = [0, 1, P // 2, P]

    def fed(i, c):
        rnd = c.open_fed_round(8)
        idx, q = ins[i]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            a, b = np.searchsorted(idx, [lo * job.partition_size, hi * job.partition_size])
            rnd.feed(idx[a:b], q[a:b], hi)
        return rnd.finish()

    out, errs = run_all(cs, fed)
    assert errs == [None] * 3
    nz = np.flatnonzero(total)
    for ridx, sums in out:
        assert np.array_equal(ridx.astype(np.int64), nz) and np.array_equal(sums.astype(np.int64), total[nz])
    out, errs = run_all(cs, lambda i, c: c.allreduce_sparse(*ins[i], 8))  # the next round, blocking
    assert errs == [None] * 3 and all(np.array_equal(o[0].astype(np.int64), nz) for o in out)
    rnd = cs[0].open_fed_round(8)
    with pytest.raises(DosaError, match="only 0 of"):
        rnd.finish()
    rnd.feed(np.zeros(0, np.uint32), np.zeros(0, np.int32), 2)
    with pytest.raises(DosaError, match="in order"):
        rnd.feed(np.zeros(0, np.uint32), np.zeros(0, np.int32), 1)


@pytest.mark.timeout(60)
def test_a_host_whose_path_refuses_gso_falls_back_in_the_round_engine_and_loses_nothing(cluster, caplog):
    """The round engine sends through dosa._net's GSO loop: when the path refuses a GSO datagram
    (the kernel answers EINVAL for a socket without UDP checksums), it sends one datagram per
    packet from then on, says so once, and the round is exact."""
    import logging
    from dosa.transport import batching

    if not batching()["gso"]:
        pytest.skip("this kernel has no UDP GSO")
    job, cs = cluster(workers=2, dpus=1)
    cs[1].ep.sock.setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK
    rng = np.random.default_rng(12)
    ins = random_inputs(rng, job.numel, 2, 3000, bound=1000)
    total = exact_total(job.numel, ins)
    with caplog.at_level(logging.WARNING, logger="dosa.net"):
        for _ in range(2):
            out, errs = run_all(cs, lambda i, c: c.allreduce_sparse(*ins[i], 8))
            assert errs == [None, None]
            for ridx, sums in out:
                assert np.array_equal(sums.astype(np.int64), total[ridx.astype(np.int64)])
    assert cs[1].ep.gso_segs == 0 and cs[0].ep.gso_segs > 1
    assert sum("GSO refused" in r.getMessage() for r in caplog.records) == 1
