"""The baselines dosa is measured against: torch.distributed (Gloo) over the same per-host gradients.

* ``gloo_dense``: ``all_reduce`` of the dense float32 gradient (Gloo's ring algorithm for CPU tensors).
* ``gloo_sparse_allgather``: the DGC / Horovod way to reduce sparse gradients: allgather every host's
  entry count, then the (index, value) pairs padded to the largest count (one int32 tensor of
  ``2 * kmax``: indices then value bits, 8 bytes per entry as on dosa's wire), and every host sums all
  hosts' entries into a dense float32 result (``out[idx] += vals``; a host's indices are unique),
  reused across rounds: only the entries the previous round wrote are cleared.
* ``dgc_allgather``: the same allgather with DGC's error feedback end to end (Lin et al. 2018): the
  host keeps a float32 residual ``r``, selects the top-k of ``g + r`` (host_lib's fused pass, as
  dosa's encoder does) and zeroes what it sent. Its transport is ``gloo_sparse_allgather``'s; its
  end to end pays the residual's pass over the model as dosa does, so comparing dosa's end to end
  with it is like for like (``gloo_sparse_allgather`` selects from ``g`` alone, no residual).

Each method is timed two ways: ``transport`` (the sparse selection is given, as with dosa's
``--sparse-input``; for dense there is nothing to select) and ``end_to_end`` (dense gradient in,
top-k selection with :func:`selector` (host_lib's fast one when present) included, dense sum out).
A round starts after a barrier; its time is the slowest rank's. Rounds after ``warmup`` untimed
ones are reported as median/min/max.

Processes: one per host, launched with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) either through ``testbed.Testbed.run`` (each rank in its host namespace, pinned to the
testbed's host CPUs) or on loopback by :func:`_launch_loopback`. Inputs come from a work directory
written by :func:`prepare_workdir` (same bytes for every method, including dosa's); every rank checks
its own final result against the float64 reference there and reports the error.

Checking floats: Gloo and the sparse sum add W float32 values in some order, each addition rounding
once, so |result - exact| <= (W - 1) * 2^-24 * sum_i |x_i| per entry. The check uses
W * 2^-24 * sum_i |x_i| (+ 1e-30) as tolerance; an error above it is a wrong answer, not rounding.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.allreduce import gradients as G

METHODS = ("gloo_dense", "gloo_sparse_allgather", "dgc_allgather")
REPO_ROOT = Path(__file__).resolve().parents[2]
EPS32 = 2.0 ** -24


# --------------------------------------------------------------------------------------------------
# Work directory: the inputs every method (and every rank) reads
# --------------------------------------------------------------------------------------------------
def prepare_workdir(grads: list[np.ndarray], density: float, directory=None) -> Path:
    """Write the per-host inputs and the references into ``directory`` (default: a new temporary
    folder under /dev/shm when it exists). Layout:

    ``grad{r}.npy`` (float32 dense), ``idx{r}.npy`` (int64 sorted top-k), ``val{r}.npy`` (float32),
    ``ref_dense.npy`` / ``abs_dense.npy`` (float64 sum, float32 sum of |g|), ``ref_sparse.npy`` /
    ``abs_sparse.npy`` (the same for the selected entries), ``meta.json`` (world, numel, k, overlap).
    """
    world, numel = len(grads), len(grads[0])
    k = G.k_for(numel, density)
    if directory is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        directory = tempfile.mkdtemp(prefix="dosa-bench-", dir=base)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    sparse = []
    ref = np.zeros(numel, np.float64)
    absd = np.zeros(numel, np.float32)
    for r, g in enumerate(grads):
        np.save(d / f"grad{r}.npy", np.ascontiguousarray(g, np.float32))
        ref += g
        absd += np.abs(g)
        idx = G.topk_indices(g, k)
        sparse.append(G.Sparse(idx, g[idx]))
        np.save(d / f"idx{r}.npy", idx)
        np.save(d / f"val{r}.npy", g[idx])
    np.save(d / "ref_dense.npy", ref)
    np.save(d / "abs_dense.npy", absd)
    del ref, absd
    ref_s = G.sparse_reference(sparse, numel)
    abs_s = np.zeros(numel, np.float32)
    for s in sparse:
        abs_s[s.indices] += np.abs(s.values)
    np.save(d / "ref_sparse.npy", ref_s)
    np.save(d / "abs_sparse.npy", abs_s)
    meta = {"world": world, "numel": numel, "k": k, "density": density,
            "overlap": G.overlap_stats([s.indices for s in sparse])}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def load_meta(d) -> dict:
    return json.loads((Path(d) / "meta.json").read_text())


def _rm_workdir(d: Path) -> None:
    import shutil

    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Selection used end to end
# --------------------------------------------------------------------------------------------------
def selector():
    """(name, exact, fn(g, k) -> sorted int64 indices): the selector a dosa host would use.

    host_lib's fast selector (sampled threshold + one Cython pass; ~k entries, exactly the top-c for
    the c it returns) when present, else the exact ``np.argpartition``. With the fast one the
    end-to-end result is checked against the sum of what every host actually selected."""
    try:
        from host_lib.compress import topk_fast

        rng = np.random.default_rng(0)
        return ("host_lib.compress.topk_fast", False,
                lambda g, k: topk_fast(g, k, rng=rng)[0].astype(np.int64))
    except ImportError:
        return "numpy.argpartition", True, G.topk_indices


# --------------------------------------------------------------------------------------------------
# Bytes per host, from the algorithms (payload only: no TCP/IP/Ethernet headers)
# --------------------------------------------------------------------------------------------------
def bytes_per_host(method: str, world: int, numel: int, counts: list[int]) -> dict:
    w = world
    if method == "gloo_dense":
        b = int(round(2 * (w - 1) / w * numel * 4))
        return {"sent": b, "received": b,
                "model": "ring allreduce: 2(W-1)/W * numel * 4 bytes each way, payload only"}
    if method in ("gloo_sparse_allgather", "dgc_allgather"):
        kmax = max(counts)
        b = (w - 1) * (kmax * 8 + 8)
        return {"sent": b, "received": b,
                "model": "ring allgather of counts (8 B) and of padded (index, value) pairs: "
                         "(W-1) * (8*kmax + 8) bytes each way, payload only"}
    raise ValueError(f"unknown method {method!r}")


# --------------------------------------------------------------------------------------------------
# Worker (one process per host)
# --------------------------------------------------------------------------------------------------
def _check(out: np.ndarray, ref: np.ndarray, absx: np.ndarray, world: int) -> dict:
    err = np.abs(out.astype(np.float64) - ref)
    tol = world * EPS32 * absx.astype(np.float64) + 1e-30
    ratio = err / tol
    worst = int(np.argmax(ratio)) if len(ratio) else 0
    return {"ok": bool((err <= tol).all()), "max_abs_err": float(err.max()) if len(err) else 0.0,
            "max_err_over_tol": float(ratio[worst]) if len(ratio) else 0.0,
            "tolerance": "W * 2^-24 * sum_i |x_i| per entry (float32 summation order)"}


def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("DOSA_IFACE", "lo"))
    torch.set_num_threads(max(1, args.threads))
    d = Path(args.dir)
    meta = load_meta(d)
    if meta["world"] != world:
        raise SystemExit(f"work dir is for {meta['world']} hosts, WORLD_SIZE is {world}")
    numel, k = meta["numel"], meta["k"]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=args.op_timeout))
    g = np.load(d / f"grad{rank}.npy")
    idx0 = np.load(d / f"idx{rank}.npy")
    val0 = np.load(d / f"val{rank}.npy")
    sel_name, sel_exact, select = selector()
    out_np = np.zeros(numel, np.float32)
    out_t = torch.from_numpy(out_np)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    # torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    result = {"rank": rank, "selector": sel_name, "selector_exact": sel_exact, "methods": {}}

    touched = {"rows": None}  # indices the last sparse_sum wrote (None: clear everything)

    def sparse_sum(idx: np.ndarray, val: np.ndarray) -> None:
        cnt = torch.tensor([len(idx)], dtype=torch.int64)
        counts = torch.zeros(world, dtype=torch.int64)
        gather(counts, cnt)
        c = counts.tolist()
        kmax = max(c)
        buf = np.zeros(2 * kmax, np.int32)
        buf[:len(idx)] = idx
        buf[kmax:kmax + len(idx)] = val.view(np.int32)
        allbuf = torch.empty(world * 2 * kmax, dtype=torch.int32)
        gather(allbuf, torch.from_numpy(buf))
        a = allbuf.numpy().reshape(world, 2 * kmax)
        # the result buffer is reused: only what the last round wrote needs clearing (a 100 MB
        # memset would cost more than the sum itself)
        if touched["rows"] is None:
            out_np[:] = 0
        else:
            for t in touched["rows"]:
                out_np[t] = 0
        rows = [a[r, :c[r]] for r in range(world)]
        for r in range(world):
            out_np[rows[r]] += a[r, kmax:kmax + c[r]].view(np.float32)
        touched["rows"] = rows

    cpu: dict[str, list[float]] = {}  # CPU seconds (user + sys, all threads) of the last timed()

    def timed(fn, before=None) -> list[float]:
        times, cpu["last"] = [], []
        for i in range(args.warmup + args.rounds):
            if before:
                before()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - t0)
            cpu["last"].append(time.process_time() - c0)
        cpu["last"] = cpu["last"][args.warmup:]
        return times[args.warmup:]

    def sparse_transport(rec: dict) -> None:
        """The sparse methods' transport: allgather of the given selection (idx0, val0), its sum
        checked against the selection's reference."""
        touched["rows"] = None  # another method may have left the buffer dense
        rec["transport"] = timed(lambda: sparse_sum(idx0, val0))
        rec["cpu_transport"] = cpu["last"]
        rec["check"] = _check(out_np, np.load(d / "ref_sparse.npy", mmap_mode="r"),
                              np.load(d / "abs_sparse.npy", mmap_mode="r"), world)

    def sparse_end_to_end(rec: dict, step, tag: str, label: str) -> None:
        """The sparse methods' end to end: time ``step()`` (select from the dense gradient, then
        sparse_sum; returns the (indices, values) it sent), then check the last round's result
        against the float64 sum of what every host sent in it. The ranks exchange that through
        files in the work dir (``{tag}_idx{r}.npy``, ``{tag}_val{r}.npy``), not through Gloo."""
        sent = {}

        def run():
            sent["idx"], sent["val"] = step()
        rec["end_to_end"] = timed(run)
        rec["cpu_end_to_end"] = cpu["last"]
        say(f"  {label}: median {np.median(rec['end_to_end']):.4f} s")
        np.save(d / f"{tag}_idx{rank}.npy", sent["idx"])
        np.save(d / f"{tag}_val{rank}.npy", sent["val"])
        dist.barrier()
        ref_e = np.zeros(numel, np.float64)
        abs_e = np.zeros(numel, np.float32)
        for r in range(world):
            ir, vr = np.load(d / f"{tag}_idx{r}.npy"), np.load(d / f"{tag}_val{r}.npy")
            ref_e[ir] += vr
            abs_e[ir] += np.abs(vr)
        rec["check_end_to_end"] = _check(out_np, ref_e, abs_e, world)
        rec["selected_per_host_end_to_end"] = int(len(sent["idx"]))

    for m in args.methods:
        rec = {}
        if m == "gloo_dense":
            def dense():
                dist.all_reduce(out_t)
            rec["transport"] = timed(dense, before=lambda: np.copyto(out_np, g))
            rec["cpu_transport"] = rec["cpu_end_to_end"] = cpu["last"]
            say(f"  gloo_dense: median {np.median(rec['transport']):.4f} s")
            rec["check"] = _check(out_np, np.load(d / "ref_dense.npy", mmap_mode="r"),
                                  np.load(d / "abs_dense.npy", mmap_mode="r"), world)
            rec["end_to_end"] = rec["transport"]  # nothing to select: the same operation
        elif m == "gloo_sparse_allgather":
            sparse_transport(rec)
            say(f"  gloo_sparse_allgather transport: median {np.median(rec['transport']):.4f} s")

            def e2e():
                i = select(g, k)
                v = g[i]
                sparse_sum(i, v)
                return i, v
            sparse_end_to_end(rec, e2e, "sel", "gloo_sparse_allgather end to end")
        elif m == "dgc_allgather":
            from host_lib.compress import select_topk

            sparse_transport(rec)
            resid = np.zeros(numel, np.float32)
            rng = np.random.default_rng(rank)

            def e2e_ef():
                i, v = select_topk(g, meta["density"], "fast", rng=rng, residual_out=resid)
                resid[i] = 0  # sent: DGC keeps no remainder of what went out
                sparse_sum(i.astype(np.int64), v)
                return i, v
            sparse_end_to_end(rec, e2e_ef, "dgc", "dgc_allgather end to end (error feedback)")
            del resid
        else:
            raise SystemExit(f"unknown method {m}")
        result["methods"][m] = rec
    dist.barrier()
    (d / f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(d: Path, methods, rounds: int, warmup: int, threads: int, op_timeout: float) -> list[str]:
    return [sys.executable, "-m", "benchmarks.allreduce.baselines", "--worker", "--dir", str(d),
            "--methods", ",".join(methods), "--rounds", str(rounds), "--warmup", str(warmup),
            "--threads", str(threads), "--op-timeout", str(op_timeout)]


def _launch_loopback(argv: list[str], world: int, timeout: float, cpus: list[int] | None, progress) -> None:
    """Run ``argv`` as ranks 0..world-1 on 127.0.0.1; any failing rank or the timeout stops all."""
    port = _free_port()
    procs = []
    env0 = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                      os.environ.get("PYTHONPATH")])),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    errs = []
    try:
        for r in range(world):
            pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
            f = tempfile.TemporaryFile()
            errs.append(f)
            procs.append(subprocess.Popen(pin + argv, env={**env0, "RANK": str(r)}, cwd=REPO_ROOT,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=None if r == 0 else f))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"baselines did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            r, rc = bad[0]
            errs[r].seek(0)
            tail = errs[r].read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"baseline rank {r} failed (exit {rc}): {' | '.join(tail)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in errs:
            f.close()


def run_baselines(workdir, methods=METHODS, rounds: int = 5, warmup: int = 1, testbed=None,
                  cpus: list[int] | None = None, timeout: float = 600.0, threads: int = 1,
                  progress=None) -> dict:
    """Run the Gloo baselines over the inputs in ``workdir`` (see :func:`prepare_workdir`).

    Args:
        testbed: a ``testbed.Testbed`` that is up: ranks run in its host namespaces (pinned to its
            host CPUs when it was brought up with cpu_split). None: loopback, pinned to ``cpus``.
        progress: callable taking one line (default: print to stderr).
    Returns:
        ``{name: {"transport": stats, "end_to_end": stats, "bytes_per_host": {...},
        "check": {...}, ...}}`` where stats = ``{"median_s", "min_s", "max_s", "rounds_s"}`` and a
        round's time is the slowest rank's.
    Raises:
        RuntimeError: a rank failed or the run timed out (message names the rank / cause).
    """
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    d = Path(workdir)
    meta = load_meta(d)
    world = meta["world"]
    methods = list(methods)
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown baseline {m!r} (known: {', '.join(METHODS)})")
    for p in [*d.glob("result*.json"), *d.glob("sel*.npy")]:
        p.unlink()
    argv = _worker_argv(d, methods, rounds, warmup, threads, op_timeout=max(30.0, timeout))
    say(f"baselines: {', '.join(methods)} on {world} hosts, {meta['numel']} entries, k={meta['k']}, "
        f"{rounds} rounds after {warmup} warm-up ({'testbed ' + testbed.prefix if testbed else 'loopback'})")
    if testbed is not None:
        res = testbed.run(argv, timeout=timeout, echo=lambda line: say(line) if line.startswith("[rank 0]") else None,
                          env={"PYTHONPATH": str(REPO_ROOT)}, master_port=_free_port())
        if not res.ok:
            raise RuntimeError(f"baselines on testbed failed: {res.summary()}")
    else:
        _launch_loopback(argv, world, timeout, cpus, say)
    per_rank = []
    for r in range(world):
        p = d / f"result{r}.json"
        if not p.exists():
            raise RuntimeError(f"rank {r} wrote no result")
        per_rank.append(json.loads(p.read_text()))
    out = {}
    counts = meta["overlap"]["per_host_k"]
    for m in methods:
        rec = {}
        for phase in ("transport", "end_to_end"):
            t = np.max(np.array([pr["methods"][m][phase] for pr in per_rank]), axis=0)
            rec[phase] = {"median_s": float(np.median(t)), "min_s": float(t.min()),
                          "max_s": float(t.max()), "rounds_s": [float(x) for x in t]}
        for ck in ("check", "check_end_to_end"):
            if ck in per_rank[0]["methods"][m]:
                cs = [pr["methods"][m][ck] for pr in per_rank]
                worst = max(cs, key=lambda c: -1 if c["max_err_over_tol"] != c["max_err_over_tol"]
                            else c["max_err_over_tol"])
                rec[ck] = {**worst, "ok": all(c["ok"] for c in cs), "ranks_checked": world}
        # CPU seconds (user + sys, the rank process's own accounting) per round, one per rank:
        # the median over the timed rounds of the transport phase, and of the end-to-end phase
        rec["host_cpu_s_per_round"] = [float(np.median(pr["methods"][m]["cpu_transport"]))
                                       for pr in per_rank]
        rec["host_cpu_s_per_round_end_to_end"] = [float(np.median(pr["methods"][m]["cpu_end_to_end"]))
                                                  for pr in per_rank]
        rec["bytes_per_host"] = bytes_per_host(m, world, meta["numel"], counts)
        rec["selector"] = per_rank[0]["selector"] if m != "gloo_dense" else None
        rec["median_s"] = rec["transport"]["median_s"]
        out[m] = rec
    return out


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Gloo baseline worker (started by run_baselines).")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--op-timeout", type=float, default=600.0)
    return _worker(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
