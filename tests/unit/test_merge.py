"""The userspace merge (dpu_fw/_softmerge.pyx): the dataplane's rules, run by a userspace DPU
worker on its own state (the dataplane's layout), fed packetized contributions as if received.
The XDP program applies the same rules (tests/dataplane): the verdicts are the same counters."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from dosa.counters import Counter
from dosa.job import JobConfig
from dosa.packetizer import packetize
from dosa.wire import PacketBatch
from dpu_fw.worker import DpuWorker

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dpu:
    """A userspace DPU worker of one job (its hosts on loopback ports nobody reads), fed batches
    through its merge as if they came from the job's hosts."""

    def __init__(self, numel=3000, psize=1000, workers=3, state_dir=None, port=None):
        self.port = port or _free_port()
        self.job = JobConfig(job_id=1, numel=numel, hosts=[("127.0.0.1", 40000 + w) for w in range(workers)],
                             dpus=[("127.0.0.1", self.port)], partition_size=psize, scale_exp=8)
        self.pmap = self.job.pmap
        self.w = DpuWorker([self.job], 0, mode="userspace", state_dir=state_dir)
        self.rt = self.w.jobs[1]

    def feed(self, batch: PacketBatch, worker: int | None = None):
        """Verdict names of the batch's packets (from the worker in their headers, or ``worker``)."""
        ws = batch.headers()["worker_id"].astype(np.int64) if worker is None else np.full(len(batch), worker)
        ip = np.full(len(batch), int.from_bytes(socket.inet_aton("127.0.0.1"), "little"), np.uint32)
        port = np.array([socket.htons(40000 + int(w)) for w in ws], np.uint16)
        v, _ = self.w.soft.merge_batch(np.ascontiguousarray(batch.data), batch.lengths, ip, port)
        return [Counter(int(x)).name.lower() for x in v]

    def buffer(self, p: int, rnd: int) -> np.ndarray:
        """The sums of (p, rnd)'s buffer as they lie (zeroed once its result went out: the
        result is then the compacted shadow copy, see ``sums``)."""
        st = self.rt.state
        slot, g = st.occupant(int(self.rt.local_of[p]), rnd)
        lo, hi = self.pmap.bounds(p)
        return st.bufs["sums"][slot * 2 + (g & 1), :hi - lo]

    def sums(self, p: int, rnd: int) -> np.ndarray:
        """(p, rnd)'s sums as its result says: what an ask is answered with (the engine rebuilds
        it from the shadow copy), or the buffer while it is not complete."""
        from dosa.packetizer import parse_batch, results_to_sparse

        res = self.rt.engine.result(1, int(self.rt.local_of[p]), rnd)
        if res is None:
            return self.buffer(p, rnd)
        idx, vals, _ = results_to_sparse(parse_batch(PacketBatch(res[0], res[1], np.full(len(res[1]), -1))))
        lo, hi = self.pmap.bounds(p)
        out = np.zeros(hi - lo, np.int64)
        out[idx.astype(np.int64) - lo] = vals
        return out

    def counters(self) -> dict:
        return self.w.job_stats()[1]

    def completions(self) -> int:
        return self.counters().get("completions", 0)

    def close(self):
        self.w.close()


@pytest.fixture
def dpu():
    made = []

    def make(**kw):
        made.append(Dpu(**kw))
        return made[-1]

    yield make
    for d in made:
        d.close()


def contribution(pmap, w, rnd, nnz=400, scale=8, seed=0):
    rng = np.random.default_rng([seed, w, rnd])
    idx = np.sort(rng.choice(pmap.numel, nnz, replace=False)).astype(np.uint32)
    q = rng.integers(-10**6, 10**6, nnz).astype(np.int32)
    return idx, q, packetize(idx, q, pmap, job_id=1, worker_id=w, round=rnd, scale_exp=scale)


def test_round_completes_once_with_the_exact_sum_and_ignores_duplicates(dpu):
    d = dpu()
    exp = np.zeros(d.pmap.numel, np.int64)
    for w in range(3):
        idx, q, b = contribution(d.pmap, w, 0)
        np.add.at(exp, idx.astype(np.int64), q)
        assert set(d.feed(b)) == {"merged"}
        assert set(d.feed(b)) == ({"pass_dup_of_complete"} if w == 2 else {"duplicate"})
    assert d.completions() == 3
    for p in range(3):
        assert np.array_equal(d.sums(p, 0), exp[p * 1000:(p + 1) * 1000])
        assert d.rt.state.is_complete(p, 0) and d.rt.state.missing_workers(p, 0) == []


def test_completion_needs_every_worker_and_missing_ones_are_named(dpu):
    d = dpu()
    for w in (0, 2):
        d.feed(contribution(d.pmap, w, 0)[2])
    assert not d.rt.state.is_complete(0, 0) and d.completions() == 0
    assert d.rt.state.missing_workers(0, 0) == [1]


def test_the_next_round_settles_the_previous_one_and_the_window_moves(dpu):
    d = dpu(numel=1000, psize=1000)
    for w in range(3):
        d.feed(contribution(d.pmap, w, 0)[2])
    assert set(d.feed(contribution(d.pmap, 0, 2)[2])) == {"round_too_new"}
    for w in range(3):
        d.feed(contribution(d.pmap, w, 1)[2])
    st = d.rt.state
    assert st.base(0) == 1  # round 1's completion settled round 0 before its result went out
    assert not d.buffer(0, 0).any() and not st.wstate[:3]["seen"].any()  # parity 0 cleared
    assert set(d.feed(contribution(d.pmap, 1, 0)[2])) == {"round_too_old"}
    assert set(d.feed(contribution(d.pmap, 1, 2)[2])) == {"merged"}  # parity 0 again, accepted


def test_scale_total_and_index_violations_are_rejected(dpu):
    d = dpu(numel=1000, psize=1000)
    d.feed(contribution(d.pmap, 0, 0, scale=8)[2])
    assert set(d.feed(contribution(d.pmap, 1, 0, scale=9)[2])) == {"scale_mismatch"}
    # total mismatch: worker 2 announces 3 packets, then sends a seq 1 claiming total 2
    idx, q, b = contribution(d.pmap, 2, 0, nnz=500)
    d.feed(b.select(np.array([True, False, False])))
    _, _, b1 = contribution(d.pmap, 2, 0, nnz=300)
    assert d.feed(b1.select(np.array([False, True]))) == ["total_mismatch"]
    # an index outside the partition (a hand-edited packet) drops the whole packet
    d2 = dpu(numel=2000, psize=1000)
    _, _, b = contribution(d2.pmap, 0, 0, nnz=20)
    first = b.select(np.array([0]))
    first.data[0, 32:36] = np.frombuffer(np.array([1500], ">u4").tobytes(), np.uint8)
    assert d2.feed(first) == ["index_out_of_partition"]
    assert not d2.buffer(0, 0).any()


def test_a_packet_from_another_source_or_worker_is_refused(dpu):
    d = dpu(numel=1000, psize=1000)
    _, _, b = contribution(d.pmap, 0, 0)
    assert set(d.feed(b, worker=1)) == {"bad_source"}  # worker 0's packets from worker 1's port
    b.data[:, 12:14] = np.frombuffer(np.array([7], ">u2").tobytes(), np.uint8)
    assert set(d.feed(b, worker=0)) == {"unknown_worker"}
    assert not d.buffer(0, 0).any()


def test_sums_saturate_at_the_s32_bound_and_are_counted(dpu):
    d = dpu(numel=1000, psize=1000, workers=2)
    big = np.array([2**31 - 1, -(2**31 - 1), 5], np.int32)
    idx = np.array([3, 4, 5], np.uint32)
    for w in range(2):
        d.feed(packetize(idx, big, d.pmap, job_id=1, worker_id=w, round=0, scale_exp=8))
    assert d.sums(0, 0)[[3, 4, 5]].tolist() == [2**31 - 1, -(2**31 - 1), 10]
    assert d.counters()["saturated_sums"] == 2


def test_state_in_files_survives_a_restart(tmp_path, dpu):
    d = dpu(state_dir=str(tmp_path))
    for w in range(2):
        d.feed(contribution(d.pmap, w, 0)[2])
    port = d.port
    d.close()
    d = dpu(state_dir=str(tmp_path), port=port)
    assert set(d.feed(contribution(d.pmap, 0, 0)[2])) == {"duplicate"}  # worker 0's, remembered
    assert set(d.feed(contribution(d.pmap, 2, 0)[2])) == {"merged"} and d.completions() == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nnz", [400, 9000])
def test_an_ask_is_answered_with_the_exact_sum_however_the_shadow_copy_is_kept(dpu, nnz):
    """The answer to an ask is rebuilt from the shadow copy: compacted into the list area for a
    sparse result, the sums with their sorted offsets for a denser one (more than the list area
    holds compacted: 9000 non-zero sums of a 16384-entry partition). Both answers are the sum
    the completion sent, in sum mode as in gtopk."""
    d = dpu(numel=32768, psize=16384, workers=2)
    exp = np.zeros(d.pmap.numel, np.int64)
    for w in range(2):
        idx, q, b = contribution(d.pmap, w, 0, nnz=nnz)
        np.add.at(exp, idx.astype(np.int64), q)
        assert set(d.feed(b)) == {"merged"}
    for p in range(2):
        assert np.array_equal(d.sums(p, 0), exp[p * 16384:(p + 1) * 16384])
