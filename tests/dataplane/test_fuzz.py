"""Fuzz: thousands of random and mutated frames through BPF_PROG_TEST_RUN. The program never fails,
every frame is passed or dropped with exactly one verdict counter (sum of verdicts == frames), a
correct job running interleaved with the fuzz stays exact, and the fuzzed job is exact again after
its state is reset."""
from __future__ import annotations

import numpy as np
import pytest

from dataplane.reasons import VERDICTS, Counter
from dataplane_harness import HDR_OFF, XDP_DROP, XDP_PASS, random_contribution
from dosa import wire

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]

N_FUZZ = 6000


def valid_round(h, rng, j, round_=0):
    frames, ref = [], {}
    for p in j.owned_partitions():
        lo, hi = j.bounds(p)
        ref[p] = np.zeros(hi - lo, np.int64)
        for w in range(j.workers):
            idx, val = random_contribution(rng, j, p, 0.4)
            np.add.at(ref[p], idx - lo, val)
            frames += h.data(j, w, p, round_, idx, val, scale=3, per_packet=60)
    return frames, ref


def mutate(rng, frame: bytes) -> bytes:
    b = bytearray(frame)
    kind = rng.integers(0, 6)
    if kind == 0:  # flip a few random bytes anywhere
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(0, len(b))] ^= int(rng.integers(1, 256))
    elif kind == 1:  # a random value in one dosa header field
        off = HDR_OFF + int(rng.integers(0, 32))
        b[off:off + 2] = rng.integers(0, 256, 2, dtype=np.uint8).tobytes()
    elif kind == 2:  # truncate (never below an Ethernet header: PROG_TEST_RUN refuses those, as a
        b = b[: rng.integers(14, len(b))]  # NIC never delivers them)
    elif kind == 3:  # extend with garbage
        b += rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8).tobytes()
    elif kind == 4:  # a field of the IP/UDP headers
        off = 14 + int(rng.integers(0, 28))
        b[off] = int(rng.integers(0, 256))
    else:  # pure noise behind a copy of the Ethernet/IP/UDP headers
        b = b[:HDR_OFF] + rng.integers(0, 256, rng.integers(0, 300), dtype=np.uint8).tobytes()
    return bytes(b)


def test_fuzzed_frames_are_all_accounted_and_never_corrupt_a_correct_job(h):
    rng = np.random.default_rng(1234)
    fuzzed = h.job(workers=2, numel=2000, partition_size=500)
    good = h.job(workers=3, numel=3000, partition_size=700)
    seeds, _ = valid_round(h, rng, fuzzed)
    good_frames, good_ref = valid_round(h, rng, good)
    seeds += [s for s in valid_round(h, rng, fuzzed, 1)[0]]
    for p in fuzzed.owned_partitions():  # dense blocks too, so mutations reach the dense path
        lo, hi = fuzzed.bounds(p)
        hd = wire.Header(type=wire.PacketType.DENSE_DATA, job_id=fuzzed.job_id, worker_id=int(p % 2),
                         partition=int(p), round=1, seq=0, total=1, flags=int(wire.Flags.LAST), base=int(lo))
        seeds.append(h.frame(wire.build_packet(hd, rng.integers(-99, 99, min(360, hi - lo))), int(p % 2)))

    frames = [mutate(rng, seeds[rng.integers(0, len(seeds))]) for _ in range(N_FUZZ)]
    frames += [rng.integers(0, 256, rng.integers(14, 200), dtype=np.uint8).tobytes() for _ in range(500)]
    # the good job's frames, spread through the fuzz in random order
    stream = frames + good_frames
    order = rng.permutation(len(stream))

    before = h.counters()
    actions = h.run_all(stream[i] for i in order)
    delta = h.counters() - before
    assert set(actions) <= {XDP_DROP, XDP_PASS}
    assert sum(int(delta[c]) for c in VERDICTS) == len(stream)
    assert delta[Counter.INTERNAL] == 0
    hit = {Counter(c).name for c in VERDICTS if delta[c]}
    assert len(hit) >= 12, hit  # the mutations reach deep into the program, not only the parser
    for p in good.owned_partitions():
        assert np.array_equal(h.maps.buffer(good.job_id, p, 0), good_ref[p])
    comps = [c for c in h.maps.poll_completions(0) if c.job_id == good.job_id]
    assert sorted(c.partition for c in comps) == list(good.owned_partitions())

    # the fuzzed job, reset as the control plane would reinstall it, merges exactly again
    h.maps.clear_job_state(fuzzed)
    h.maps.poll_completions(0)
    frames, ref = valid_round(h, rng, fuzzed)
    h.run_all(frames)
    for p in fuzzed.owned_partitions():
        assert np.array_equal(h.maps.buffer(fuzzed.job_id, p, 0), ref[p])
    assert len(h.maps.poll_completions(0)) == fuzzed.num_partitions


def test_random_bytes_never_abort(h):
    rng = np.random.default_rng(99)
    frames = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in rng.integers(14, 1500, 2000)]
    before = h.counters()
    assert set(h.run_all(frames)) <= {XDP_DROP, XDP_PASS}
    delta = h.counters() - before
    assert sum(int(delta[c]) for c in VERDICTS) == len(frames)
