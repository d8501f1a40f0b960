"""``dosa bench allreduce``: time dosa's allreduce through the DPU, XDP path and userspace path.

For each path a fresh testbed (testbed.Testbed: H host namespaces, M DPU namespaces, a bridge) is
brought up with that mode (its DPUs run ``dosa ctl serve`` and ``dosa dpu run``), shaped like the
baselines' (``--link-rate``, hosts on one core and the DPU on the other when they run on a testbed;
the testbed itself puts the DPU's receive in threaded NAPI on the DPU core and a pfifo on the
bridge port towards it). Every host runs this module's host side (``python -m benchmarks.allreduce.dosa_paths --host ...``), which joins
through the control plane, reads its sparse input from benchmarks.allreduce's work folder (``--inputs``;
uniform random indices without one), runs warm-up then timed rounds of ``allreduce_sparse``, checks
EVERY round's result against the exact fixed-point reference, and writes its per-round times, CPU
time, bytes and retransmissions. A round's time is the slowest host's; the report gives the median
over the timed rounds. With a work folder the host then also times dosa END TO END (``_end_to_end``:
dense gradient in, RoundEncoder error feedback + top-k + quantization, allreduce, dense sum out),
each round after a barrier, every round checked against the exact sum of what the hosts sent
(``end_to_end`` / ``check_end_to_end`` in the record, like the baselines'; ``DOSA_BENCH_END_TO_END=0``
skips it).

Knobs for experiments (environment, reaching hosts and DPU services): ``DOSA_MULTICAST=0`` (unicast
fan-out), ``DOSA_BENCH_WINDOW=N`` (partitions in flight a host), ``DOSA_BENCH_SLOTS=N`` (the job's
aggregation slots per DPU: its window on the DPU),
``DOSA_BENCH_PROFILE=DIR`` (a CPU-time cProfile of each host's rounds, ``DIR/rank<r>.prof``).

JSON layout (``--json``)::

    {"config": {...}, "methods": {"dosa_xdp": {...}, "dosa_userspace": {...}}}

so the benchmark issue can add baselines as further entries of "methods".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from dosa.errors import DosaError
from dosa.job import DpuMode, ResultMode

from benchmarks.ranks import read_rank_results


def _inputs(numel: int, density: float, workers: int, seed: int, rnd: int, w: int):
    from host_lib.quantize import clip_bound

    rng = np.random.default_rng([seed, rnd, w])
    k = max(1, int(numel * density))
    idx = np.unique(rng.integers(0, numel, int(k * 1.02) + 8))[:k].astype(np.uint32)
    lim = clip_bound(workers)
    q = rng.integers(-lim, lim + 1, len(idx)).astype(np.int32)
    return idx, q


def _workdir_inputs(workdir: Path, rank: int, workers: int):
    """This rank's input from benchmarks.allreduce's work folder (the baselines' exact top-k, ``idx{r}``
    / ``val{r}``), quantized with the scale exponent every rank derives from the largest |value| of
    all ranks (so all agree), plus the exact fixed-point reference of the sum, computed once.
    Returns (idx u32, q i32, scale_exp, ref_idx i64, ref_sum i64)."""
    from host_lib.quantize import choose_scale_exp, quantize

    vals = [np.load(workdir / f"val{r}.npy") for r in range(workers)]
    m = max((float(np.abs(v).max()) for v in vals if len(v)), default=0.0)
    s = choose_scale_exp(m, workers)
    idxs = [np.load(workdir / f"idx{r}.npy").astype(np.int64) for r in range(workers)]
    qs = [quantize(v, s, workers)[0] for v in vals]
    ref_idx, ref_sum = _exact_sparse_sum(idxs, qs)
    mine = qs[rank] != 0  # a zero after quantization is not sent (the DPU would not see it either)
    return (idxs[rank][mine].astype(np.uint32), qs[rank][mine].astype(np.int32), s,
            ref_idx, ref_sum)


def _exact_sparse_sum(idxs, qs) -> tuple[np.ndarray, np.ndarray]:
    """The exact fixed-point sum of several hosts' (indices, values): (indices i64, sums i64) of
    every non-zero sum, sorted by index. The one reference every dosa check compares with."""
    allidx = np.concatenate([np.asarray(i, np.int64) for i in idxs])
    uniq, inv = np.unique(allidx, return_inverse=True)
    tot = np.zeros(len(uniq), np.int64)
    np.add.at(tot, inv, np.concatenate([np.asarray(q, np.int64) for q in qs]))
    nz = tot != 0
    return uniq[nz], tot[nz]


def _random_inputs(numel: int, density: float, workers: int, seed: int, rank: int):
    """Fallback without a work folder: uniform random indices (uncorrelated hosts)."""
    data = [_inputs(numel, density, workers, seed, 0, w) for w in range(workers)]
    ref_idx, ref_sum = _exact_sparse_sum([d[0] for d in data], [d[1] for d in data])
    return data[rank][0], data[rank][1], 0, ref_idx, ref_sum


def _check(mode: str, ridx, sums, ref_idx, ref_sum, job) -> bool:
    """Is (ridx, sums) exactly the job's answer? sum: every non-zero sum. gtopk: every returned sum
    is the exact one, and per partition exactly min(k, non-zeros) of the largest |sum| came back."""
    ridx = np.asarray(ridx, np.int64)
    sums = np.asarray(sums, np.int64)
    if mode == ResultMode.SUM:
        return bool(np.array_equal(ridx, ref_idx) and np.array_equal(sums, ref_sum))
    if len(ridx) and (np.any(np.diff(ridx) <= 0)):
        return False
    pos = np.searchsorted(ref_idx, ridx)
    if len(ridx) and (pos.max() >= len(ref_idx) or not np.array_equal(ref_idx[pos], ridx)
                      or not np.array_equal(ref_sum[pos], sums)):
        return False
    pm = job.pmap
    P, ps = pm.num_partitions, pm.partition_size
    lens = np.minimum(ps, job.numel - np.arange(P) * ps)
    want = np.minimum(job.gtopk_k(lens), np.bincount(ref_idx // ps, minlength=P))
    if not np.array_equal(np.bincount(ridx // ps, minlength=P), want):
        return False
    left = np.ones(len(ref_idx), bool)
    left[pos] = False
    lo_in = np.full(P, np.iinfo(np.int64).max)
    np.minimum.at(lo_in, ridx // ps, np.abs(sums))
    hi_out = np.full(P, -1)
    np.maximum.at(hi_out, ref_idx[left] // ps, np.abs(ref_sum[left]))
    return bool(np.all(hi_out <= lo_in))


def _proc_cpu_s(pids) -> float:
    """User + system CPU seconds of processes/threads ``pids`` and all their descendants, from the
    kernel's own accounting (the scheduler's run time, /proc/<pid>/task/*/schedstat). A DPU's share: its control plane and
    worker processes and, in XDP mode, the threaded-NAPI kernel threads that run its XDP merge."""
    return sum(_proc_cpu_by_name(pids).values())


def _proc_cpu_by_name(pids) -> dict[str, float]:
    """``_proc_cpu_s`` by thread name (/proc/<pid>/task/<tid>/comm): where a DPU's CPU goes."""
    pids = {int(p) for p in pids}
    if not pids:
        return {}
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    todo, seen = list(pids), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo += [c for c, pp in parent.items() if pp == p]
    # the scheduler's run time of every thread (ns; utime + stime in /proc/<pid>/stat would say the
    # same in 10 ms ticks, too coarse for a round)
    out: dict[str, float] = {}
    for p in seen:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{p}/task/{t}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError, IndexError):
                continue
            key = "napi" if name.startswith("napi/") else name
            out[key] = out.get(key, 0.0) + ns / 1e9
    return out


def _dpu_pids() -> list[int]:
    return [int(x) for x in os.environ.get("DOSA_BENCH_DPU_PIDS", "").split(",") if x.strip()]


def _save_atomic(path: Path, **arrays) -> None:
    """np.savez to ``path`` via a temporary name, so a reader polling for it never sees half a file."""
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _wait_files(files: list[Path], what: str, timeout: float = 120.0) -> None:
    """A barrier between the hosts through the shared folder: wait until every file exists."""
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            raise DosaError(f"end to end: not every host wrote {what} in {timeout:.0f} s")
        time.sleep(0.002)


def _barrier(folder: Path, tag: str, rank: int, workers: int) -> None:
    """Every host marks ``tag`` in ``folder`` and waits for all the others' marks.

    Around every timed round: a round starts when every host is ready (as the baselines'
    ``dist.barrier()``), and no host starts its untimed work (checking, writing its entries) before
    every host has finished the round. The hosts share cores on the testbed, so one host's checking
    would otherwise run inside another host's timed round (the baselines check only after their
    last round)."""
    (folder / f"{tag}.{rank}").touch()
    _wait_files([folder / f"{tag}.{w}" for w in range(workers)], f"its {tag} mark")


#: Partition ranges a host's end-to-end round is cut into (DOSA_BENCH_E2E_CHUNKS; 1 = one blocking
#: allreduce_sparse of the whole gradient): each range is selected (RoundEncoder.encode_ranges, one
#: threshold for the whole gradient) and fed to the round at once (FedRound, this thread only), so
#: the DPU merges range i while the hosts select range i + 1. Default 1: on the testbed the four
#: hosts share one core and the overlap it buys is eaten by its cost (per range: a packetize call, a
#: reload of the engine's packet table, a non-blocking pump): docs/performance.md has the A/B (4
#: hosts, 25M, unshaped; 1 range 244.7 / 183.5 ms, 4 ranges 222.8 / 233.8 ms end to end, host CPU
#: 38.4 / 35.1 against 43.3 / 42.8 ms a round).
E2E_CHUNKS = 1


class _Chunks:
    """Partition-aligned ranges of the index space, encoded one at a time by one RoundEncoder
    (``encode_ranges``: one threshold for the whole gradient, the same selection as one pass)."""

    def __init__(self, c, n: int):
        P, ps, numel = c.pmap.num_partitions, c.pmap.partition_size, c.job.numel
        self.parts = np.unique(np.linspace(0, P, min(n, P) + 1).round().astype(np.int64))
        self.bounds = [(int(p0) * ps, min(int(p1) * ps, numel)) for p0, p1 in
                       zip(self.parts[:-1], self.parts[1:])]


def _e2e_blocking(c, enc, g, scale, mode, out, touched, phases):
    """One round, not pipelined: encode everything, then allreduce_sparse, which writes the dense
    output as the results come in."""
    th = time.thread_time()
    e = enc.encode(g, scale)
    nz = e.values != 0  # a zero after quantization is not sent (its remainder is in the residual)
    idx, q = e.indices[nz], e.values[nz]
    th = _tick(phases, "select+error feedback+quantize", th)
    if touched is None:
        out[:] = 0
        touched = np.zeros(0, np.uint32)
    # the dense output (out[touched] = 0, out[ridx] = sum * 2^-s) is written by the round's engine
    # partition by partition as results come in (its CPU is in the absorb phase)
    ridx, sums = c.allreduce_sparse(idx, q, scale, dense_out=out, dense_clear=touched)
    th = time.thread_time()
    if mode == ResultMode.GTOPK:
        enc.fold_back(*enc.unapplied(type(e)(idx, q, scale), ridx), scale)
        th = _tick(phases, "fold back", th)
    return idx, q, ridx, sums, ridx


def _e2e_pipelined(c, enc, ch: _Chunks, g, scale, mode, out, touched, phases):
    """One round fed range by range (host_lib.stream.FedRound, this thread only): each range is
    selected (``RoundEncoder.encode_ranges``) and its packets go out at once, so the DPU merges
    range i while this host (and the others sharing its core) select range i + 1; the dense output
    is written as the results come in, as in the blocking round."""
    from host_lib.encoder import EncodedRound

    th = time.thread_time()
    if touched is None:
        out[:] = 0
        touched = np.zeros(0, np.uint32)
    rnd = c.open_fed_round(scale, dense_out=out, dense_clear=touched)  # written as results come in
    sent = []
    for (lo, hi, e), p1 in zip(enc.encode_ranges(g, scale, ch.bounds), ch.parts[1:]):
        th = _tick(phases, "select+error feedback+quantize", th)
        rnd.feed(e.indices, e.values, int(p1))  # its packetize / send / receive CPU: the client's phases
        sent.append(e)
        th = time.thread_time()
    ridx, sums = rnd.finish()
    th = time.thread_time()
    idx = np.concatenate([e.indices for e in sent])
    q = np.concatenate([e.values for e in sent])
    if mode == ResultMode.GTOPK:
        enc.fold_back(*enc.unapplied(EncodedRound(idx, q, scale), ridx), scale)
        th = _tick(phases, "fold back", th)
    return idx, q, ridx, sums, ridx


def _end_to_end(c, mode: str, rank: int, workers: int, scale: int, workdir: Path, e2e_dir: Path,
                rounds: int, warmup: int, density: float, rec: dict) -> None:
    """Time dosa end to end, like the baselines' ``end_to_end``: dense gradient in (the work folder's
    ``grad{rank}.npy``), error feedback + top-k selection + quantization
    (host_lib.encoder.RoundEncoder, the fast selector), the allreduce, dense float32 sum out (only
    the entries the last round wrote are cleared, as the baseline does). The gtopk mode also folds
    the entries the DPU did not return back into the residual.

    The check stays outside the timed part: every host writes what it actually sent in each round
    (``sent<rank>_<round>.npz``: idx, q) and the digest of its result; the next round starts when
    all hosts' files of this one exist (a barrier, like the baselines'); rank 0 waits for all of them
    and checks every round's result against the exact int64 sum of the hosts' sent entries
    (:func:`_check`, so gtopk is checked too), and that every host got the same bytes. Every host
    also checks its dense output against its sparse result."""
    import hashlib

    from host_lib.encoder import RoundEncoder
    from host_lib.quantize import dequantize

    g = np.load(workdir / f"grad{rank}.npy")
    n_chunks = int(os.environ.get("DOSA_BENCH_E2E_CHUNKS", str(E2E_CHUNKS)))
    chunks = None if n_chunks <= 1 else _Chunks(c, n_chunks)
    enc = RoundEncoder(c.job.numel, density, workers, method="fast", seed=rank)
    rec["e2e_chunks"] = 1 if chunks is None else len(chunks.bounds)
    out = np.zeros(c.job.numel, np.float32)
    touched = None
    times, cpu, sent_n, kept = [], [], [], []
    phases: dict[str, float] = {}  # CPU s of this thread per phase, summed over the timed rounds
    dpu0 = None
    dense_ok = True
    (e2e_dir / f"start{rank}").touch()
    _wait_files([e2e_dir / f"start{w}" for w in range(workers)], "its start mark")
    for r in range(warmup + rounds):
        # every round starts after a barrier (as the baselines' dist.barrier()): one host's untimed
        # checking and writing must not show up as another host's waiting
        if r:
            _wait_files([e2e_dir / f"sent{w}_{r - 1}.npz" for w in range(workers)],
                        f"its round-{r - 1} entries")
        if r == warmup:  # the phases and the DPU's CPU of the timed rounds only
            c.phase_cpu.clear()
            phases.clear()
            dpu0 = _proc_cpu_s(_dpu_pids()) if rank == 0 else None
        t0, c0 = time.perf_counter(), time.process_time()
        if chunks is None:
            idx, q, ridx, sums, touched = _e2e_blocking(c, enc, g, scale, mode, out, touched, phases)
        else:
            idx, q, ridx, sums, touched = _e2e_pipelined(c, enc, chunks, g, scale, mode, out, touched,
                                                         phases)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        _barrier(e2e_dir, f"end{r}", rank, workers)  # the checks below stay out of every timed round
        vals = dequantize(sums, scale)  # untimed: the check of the dense output below
        dense_ok &= bool(np.count_nonzero(out) == np.count_nonzero(vals)
                         and np.array_equal(out[ridx], vals))
        _save_atomic(e2e_dir / f"sent{rank}_{r}.npz", idx=idx, q=q,
                     digest=np.frombuffer(hashlib.sha1(ridx.tobytes() + sums.tobytes()).digest(),
                                          np.uint8))
        if rank == 0:
            kept.append((ridx, sums))
        if r >= warmup:
            times.append(dt)
            cpu.append(dc)
            sent_n.append(len(idx))
    rec["e2e_round_s"] = times
    rec["e2e_cpu_s"] = cpu
    phases.update(c.phase_cpu)
    rec["e2e_phases_cpu_s"] = {k: v / max(1, rounds) for k, v in phases.items()}
    if dpu0 is not None:
        rec["e2e_dpu_cpu_s"] = (_proc_cpu_s(_dpu_pids()) - dpu0) / max(1, rounds)
    rec["e2e_entries_sent"] = sent_n
    rec["e2e_dense_ok"] = dense_ok
    if rank != 0:
        return
    # rank 0: every host's sent entries of every round -> the exact reference, compared
    checked = wrong = 0
    for r in range(warmup + rounds):
        files = [e2e_dir / f"sent{w}_{r}.npz" for w in range(workers)]
        _wait_files(files, f"its round-{r} entries")
        data = [np.load(f) for f in files]
        ref_idx, ref_sum = _exact_sparse_sum([d["idx"] for d in data], [d["q"] for d in data])
        ridx, sums = kept[r]
        ok = _check(mode, ridx, sums, ref_idx, ref_sum, c.job)
        ok &= all(np.array_equal(d["digest"], data[0]["digest"]) for d in data)
        checked += workers
        wrong += 0 if ok else workers
    rec["e2e_rounds_checked"] = checked
    rec["e2e_rounds_wrong"] = wrong


def _tick(acc: dict, name: str, t0: float) -> float:
    t = time.thread_time()
    acc[name] = acc.get(name, 0.0) + t - t0
    return t


def host_main(argv=None) -> int:
    """One rank: join, run rounds, check every round's result, write ``<out>/rank<RANK>.json``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.allreduce.dosa_paths --host")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--density", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--mode", default="sum")
    ap.add_argument("--out", required=True)
    ap.add_argument("--inputs", default=None, help="benchmarks.allreduce work folder (idx{r}/val{r}.npy)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--retx-interval", type=float, default=0.25)
    ap.add_argument("--window", type=int, default=int(os.environ.get("DOSA_BENCH_WINDOW", "256")))
    ap.add_argument("--mtu", type=int, default=None, help="the job's MTU (the testbed links')")
    ap.add_argument("--slots", type=int, default=int(os.environ.get("DOSA_BENCH_SLOTS", "0")) or None,
                    help="the job's aggregation slots per DPU (default: the job default)")
    a = ap.parse_args(argv)
    from host_lib.client import AggregationClient

    rank = int(os.environ.get("RANK", "0"))
    workers = int(os.environ.get("WORLD_SIZE", "1"))
    rec = {"rank": rank, "round_s": [], "sent": [], "received": [], "verified": None,
           "rounds_checked": 0, "rounds_wrong": 0, "retx_per_round": [], "cpu_s": [], "cpu_sys_s": []}
    if a.inputs:
        idx, q, scale, ref_idx, ref_sum = _workdir_inputs(Path(a.inputs), rank, workers)
    else:
        idx, q, scale, ref_idx, ref_sum = _random_inputs(a.numel, a.density, workers, a.seed, rank)
    try:
        with AggregationClient.from_env(a.numel, timeout=a.timeout, retx_interval=a.retx_interval,
                                        window=a.window,
                                        join={"mode": a.mode, "density": a.density,
                                              **({"mtu": a.mtu} if a.mtu else {}),
                                              **({"slots": a.slots} if a.slots else {}),
                                              "scale_exp": int(scale), "wait": 120}) as c:
            rec["multicast"] = c.multicast_group is not None
            prof = None
            if os.environ.get("DOSA_BENCH_PROFILE"):  # a cProfile of the rounds, for docs/performance.md
                import cProfile

                prof = cProfile.Profile(time.process_time)
                prof.enable()
            dpu0 = None
            marks = Path(a.out) / "marks"  # the hosts' round barriers (_barrier)
            marks.mkdir(exist_ok=True)
            for r in range(a.warmup + a.rounds):
                if r == a.warmup:
                    c.phase_cpu.clear()
                    sc0 = (c.ep.send_calls, c.ep.send_datagrams, c.ep.recv_calls,
                           c.ep.recv_datagrams, c.ep.sent_packets, c.ep.recv_packets)
                    dpu0 = _proc_cpu_s(_dpu_pids()) if rank == 0 else None
                    dpu_by0 = _proc_cpu_by_name(_dpu_pids()) if rank == 0 else None
                s0, r0, x0 = c.ep.sent_bytes, c.ep.recv_bytes, c.retransmissions
                _barrier(marks, f"start{r}", rank, workers)
                t0, c0, o0 = time.perf_counter(), time.process_time(), os.times()
                ridx, sums = c.allreduce_sparse(idx, q, scale)
                dt, dc, o1 = time.perf_counter() - t0, time.process_time() - c0, os.times()
                _barrier(marks, f"end{r}", rank, workers)  # the check below: outside every timed round
                ok = _check(a.mode, ridx, sums, ref_idx, ref_sum, c.job)
                rec["rounds_checked"] += 1
                rec["rounds_wrong"] += 0 if ok else 1
                if r >= a.warmup:
                    rec["round_s"].append(dt)
                    rec["cpu_s"].append(dc)
                    rec["cpu_sys_s"].append(o1.system - o0.system)
                    rec["sent"].append(c.ep.sent_bytes - s0)
                    rec["received"].append(c.ep.recv_bytes - r0)
                    rec["retx_per_round"].append(c.retransmissions - x0)
            if dpu0 is not None:
                rec["dpu_cpu_s"] = (_proc_cpu_s(_dpu_pids()) - dpu0) / max(1, a.rounds)
                by1 = _proc_cpu_by_name(_dpu_pids())
                rec["dpu_cpu_s_by_thread"] = {k: (v - dpu_by0.get(k, 0.0)) / max(1, a.rounds)
                                              for k, v in by1.items() if v - dpu_by0.get(k, 0.0) > 1e-4}
            rec["phases_cpu_s"] = {k: v / max(1, a.rounds) for k, v in c.phase_cpu.items()}
            sc1 = (c.ep.send_calls, c.ep.send_datagrams, c.ep.recv_calls, c.ep.recv_datagrams,
                   c.ep.sent_packets, c.ep.recv_packets)
            rec["socket_per_round"] = {
                k: (y - x) / max(1, a.rounds) for k, x, y in zip(
                    ("send_calls", "send_datagrams", "recv_calls", "recv_datagrams",
                     "sent_packets", "recv_packets"), sc0, sc1)}
            rec["gso"], rec["gro"] = c.ep.gso_segs > 1, c.ep.gro
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(os.environ["DOSA_BENCH_PROFILE"], f"rank{rank}.prof"))
            rec["verified"] = rec["rounds_wrong"] == 0
            rec["entries_sent"] = int(len(idx))
            rec["result_entries"] = int(len(ridx))
            rec["retransmissions"] = c.retransmissions
            if a.inputs and os.environ.get("DOSA_BENCH_END_TO_END", "1") != "0":
                e2e_dir = Path(a.out) / "e2e"
                e2e_dir.mkdir(exist_ok=True)
                _end_to_end(c, a.mode, rank, workers, int(scale), Path(a.inputs), e2e_dir, a.rounds,
                            a.warmup, a.density, rec)
    except DosaError as e:
        rec["error"] = str(e)
    with open(Path(a.out) / f"rank{rank}.json", "w") as f:
        json.dump(rec, f)
    return 0 if "error" not in rec else 1


def _services(pool_buffers: int):
    """testbed.services.dpu_services with a dataplane pool large enough for the job's slots, up to
    one per owned partition (DOSA_BENCH_SLOTS)."""
    from testbed.services import ServiceSpec, dpu_services

    def fn(ctx):
        out = []
        for spec in dpu_services(ctx):
            if spec.name == "ctl" and ctx.mode == DpuMode.XDP:
                spec = ServiceSpec(spec.name, [*spec.argv, "--pool-buffers", str(pool_buffers)],
                                   spec.ready, spec.env)
            out.append(spec)
        return out

    return fn


def _cpu_times() -> dict:
    """{cpu: (user+nice, system, softirq+irq, idle+iowait)} jiffies from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:8]]
                out[line.split()[0]] = (v[0] + v[1], v[2], v[5] + v[6], v[3] + v[4])
    return out


def _cpu_use(a: dict, b: dict, seconds: float) -> dict:
    """Share of each CPU's time in user, system, softirq and idle between two _cpu_times (the whole
    run of the hosts: setup, warm-up and timed rounds; the machine is shared)."""
    out = {}
    for cpu in a:
        d = [y - x for x, y in zip(a[cpu], b[cpu])]
        tot = max(1, sum(d))
        out[cpu] = {k: round(v / tot, 3) for k, v in zip(("user", "system", "softirq", "idle"), d)}
    out["seconds"] = round(seconds, 2)
    return out


def _mean_phases(dicts: list[dict]) -> dict:
    """{phase: mean over ranks} of per-rank {phase: value} dicts."""
    keys = sorted({k for d in dicts for k in d})
    return {k: float(np.mean([d.get(k, 0.0) for d in dicts])) for k in keys}


def _run_path(path: str, args, out_dir: Path, workdir: Path | None = None) -> dict:
    """Run one dosa path (``xdp`` or ``userspace``) on its own testbed, shaped like the baselines'
    (``args.link_rate`` on the host links, ``cpu_split``: hosts on one core, the DPU on the other),
    every host reading its input from ``workdir`` (benchmarks.allreduce's work folder) when given.
    Every round's result is checked against the exact reference on every host."""
    from dataplane.loader import DEFAULT_POOL_BUFFERS
    from dosa.wire import DEFAULT_PARTITION_SIZE, PartitionMap
    from testbed.core import Testbed

    pm = PartitionMap(args.numel, DEFAULT_PARTITION_SIZE, args.dpus)
    # room for every owned partition's slot (DOSA_BENCH_SLOTS up to all of them: 2 buffers each)
    bufs = max(DEFAULT_POOL_BUFFERS, 2 * len(pm.owned_by(0)))
    prefix = f"db{uuid.uuid4().hex[:5]}"
    tb = Testbed(prefix=prefix, subnet="10.231.99.0/24", services=_services(bufs),
                 state_dir=tempfile.mkdtemp(prefix="dosa-bench-state-"))
    res_dir = out_dir / path
    res_dir.mkdir(parents=True, exist_ok=True)
    t_up = time.monotonic()
    link_rate = getattr(args, "link_rate", None)
    # the baselines pin hosts to one core and the DPU to the other when they run on a testbed
    cpu_split = getattr(args, "cpu_split", None)
    cpu_split = bool(getattr(args, "testbed", True) if cpu_split is None else cpu_split)
    tb.up(args.hosts, args.dpus, mode=path, link_rate=link_rate, cpu_split=cpu_split,
          shape_dpus=bool(getattr(args, "shape_dpus", False)), mtu=getattr(args, "mtu", None))
    try:
        up_s = time.monotonic() - t_up
        # the testbed runs the DPUs' receive (the XDP merge) in threaded NAPI on the DPU cores
        napi = tb.status().get("dpu_napi_threads") or []
        tb_mtu = tb.status().get("config", {}).get("mtu")
        argv = [sys.executable, "-m", "benchmarks.allreduce.dosa_paths", "--host", "--numel", str(args.numel),
                "--density", str(args.density), "--rounds", str(args.rounds), "--warmup",
                str(args.warmup), "--mode", args.mode, "--out", str(res_dir)]
        if workdir is not None:
            argv += ["--inputs", str(workdir)]
        links_mtu = (tb.status().get("config") or {}).get("mtu")  # testbed up --mtu
        if links_mtu:
            argv += ["--mtu", str(links_mtu)]
        for opt in ("retx_interval", "window"):
            if getattr(args, opt, None) is not None:
                argv += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
        st = tb.status()
        dpu_pids = [p["pid"] for p in st.get("processes", [])
                    if p.get("node", "").startswith("d") or "dpu" in p.get("name", "")] + list(napi)
        cpu0 = _cpu_times()
        t_run = time.monotonic()
        run = tb.run(argv, timeout=args.timeout, echo=False, log_dir=res_dir / "logs",
                     env={"DOSA_BENCH_DPU_PIDS": ",".join(map(str, dpu_pids))})
        cpu_use = _cpu_use(cpu0, _cpu_times(), time.monotonic() - t_run)
        if run.timed_out:
            raise DosaError(f"{path} path: hosts did not finish in {args.timeout} s "
                            f"(logs in {res_dir / 'logs'})")
    finally:
        tb.down()
    ranks = read_rank_results(res_dir, args.hosts, f"{path} path", res_dir / "logs")
    per_round = np.max(np.array([r["round_s"] for r in ranks]), axis=0)
    e2e = {}
    if all("e2e_round_s" in r for r in ranks):
        t = np.max(np.array([r["e2e_round_s"] for r in ranks]), axis=0)
        checked, wrong = ranks[0].get("e2e_rounds_checked", 0), ranks[0].get("e2e_rounds_wrong", 0)
        dense_ok = all(r["e2e_dense_ok"] for r in ranks)
        e2e = {
            "end_to_end": {"median_s": float(np.median(t)), "min_s": float(t.min()),
                           "max_s": float(t.max()), "rounds_s": [float(x) for x in t]},
            "check_end_to_end": {
                "ok": bool(checked > 0 and wrong == 0 and dense_ok), "tolerance": "exact (fixed point)",
                "reference": "int64 sum of the (idx, q) every host actually sent in that round",
                "max_err_over_tol": 0.0 if checked > 0 and wrong == 0 and dense_ok else float("inf"),
                "ranks_checked": len(ranks), "rounds_checked": checked, "rounds_wrong": wrong,
                "dense_out_matches_sparse_result": dense_ok},
            "selector": "host_lib.encoder.RoundEncoder (topk_fast, error feedback)",
            "entries_sent_per_host_end_to_end": int(statistics.median(
                [statistics.median(r["e2e_entries_sent"]) for r in ranks])),
            "host_cpu_s_per_round_end_to_end": [float(statistics.median(r["e2e_cpu_s"])) for r in ranks],
            "phases_cpu_s_per_round": _mean_phases([r.get("e2e_phases_cpu_s", {}) for r in ranks]),
            "dpu_cpu_s_per_round_end_to_end": ranks[0].get("e2e_dpu_cpu_s"),
        }
    return {
        **e2e,
        "median_round_s": float(statistics.median(per_round)),
        "round_s": [float(x) for x in per_round],
        "bytes_sent_per_host": [int(statistics.median(r["sent"])) for r in ranks],
        "bytes_received_per_host": [int(statistics.median(r["received"])) for r in ranks],
        "entries_sent_per_host": ranks[0]["entries_sent"],
        "result_entries": ranks[0]["result_entries"],
        "retransmissions": [r["retransmissions"] for r in ranks],
        "retransmissions_per_round": [r["retx_per_round"] for r in ranks],
        "verified_round0": ranks[0]["verified"],
        "verified_all_rounds": all(r["verified"] for r in ranks),
        "rounds_checked": sum(r["rounds_checked"] for r in ranks),
        "rounds_wrong": sum(r["rounds_wrong"] for r in ranks),
        "multicast": all(r.get("multicast") for r in ranks),
        "inputs": "work folder" if workdir is not None else "uniform random",
        "link_rate": link_rate, "cpu_split": cpu_split, "mtu": tb_mtu,
        "testbed_up_s": up_s,
        "dpu_napi_threads_pinned": len(napi),
        "host_cpu_s_per_round": [float(statistics.median(r["cpu_s"])) for r in ranks],
        "dpu_cpu_s_per_round": [ranks[0]["dpu_cpu_s"]] if "dpu_cpu_s" in ranks[0] else None,
        "dpu_cpu_s_per_round_by_thread": ranks[0].get("dpu_cpu_s_by_thread"),
        "dpu_cpu_note": "user+sys of the DPU's ctl and worker processes and (XDP) its threaded-NAPI "
                        "threads over the timed transport rounds, per round",
        "phases_cpu_s_per_round_transport": _mean_phases([r.get("phases_cpu_s", {}) for r in ranks]),
        "socket_per_round_per_host": _mean_phases([r.get("socket_per_round", {}) for r in ranks]),
        "gso": all(r.get("gso") for r in ranks), "gro": all(r.get("gro") for r in ranks),
        "host_cpu_sys_s_per_round": [float(statistics.median(r["cpu_sys_s"])) for r in ranks],
        "machine_cpu_during_run": cpu_use,
    }


def run_bench(args) -> int:
    if os.geteuid() != 0:
        from dosa.errors import NeedsRoot

        raise NeedsRoot("dosa bench allreduce")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    for p in paths:
        if p not in ("xdp", "userspace"):
            raise DosaError(f"unknown path {p!r}: use xdp and/or userspace")
    if args.hosts < 1 or args.dpus < 1 or args.rounds < 1 or args.warmup < 0:
        raise DosaError("--hosts, --dpus and --rounds must be at least 1, --warmup at least 0")
    if args.mode == ResultMode.GTOPK and args.dpus > 1:
        print("note: gtopk with several DPUs takes the density of DPUs > 0 from --gtopk-density "
              "of their workers (docs/dpu_worker.md)", file=sys.stderr)
    args.timeout = getattr(args, "timeout", None) or 900
    out_dir = Path(tempfile.mkdtemp(prefix="dosa-bench-allreduce-"))
    report = {"config": {"hosts": args.hosts, "dpus": args.dpus, "numel": args.numel,
                         "density": args.density, "rounds": args.rounds, "warmup": args.warmup,
                         "mode": args.mode},
              "methods": {}}
    for p in paths:
        m = _run_path(p, args, out_dir)
        report["methods"][f"dosa_{p}"] = m
        mb = 1e6
        print(f"dosa_{p:<10} median round {m['median_round_s'] * 1e3:8.1f} ms   per host: sent "
              f"{statistics.median(m['bytes_sent_per_host']) / mb:7.2f} MB, received "
              f"{statistics.median(m['bytes_received_per_host']) / mb:7.2f} MB   "
              f"verified (every round, every host)={m['verified_all_rounds']}")
        if "end_to_end" in m:
            print(f"dosa_{p:<10} end to end   {m['end_to_end']['median_s'] * 1e3:8.1f} ms   "
                  f"checked={m['check_end_to_end']['ok']}")
    if "dosa_xdp" in report["methods"] and "dosa_userspace" in report["methods"]:
        ratio = report["methods"]["dosa_userspace"]["median_round_s"] / \
            report["methods"]["dosa_xdp"]["median_round_s"]
        report["userspace_over_xdp"] = ratio
        print(f"userspace / xdp round time: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    if "--host" in sys.argv[1:]:
        sys.exit(host_main(sys.argv[1:]))
    print("usage: dosa bench allreduce ...", file=sys.stderr)
    sys.exit(2)
