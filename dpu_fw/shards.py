"""``dosa dpu run --workers N``: one worker process per DPU core, the slots sharded over them.

Shard i serves the slots with slot % N == i: their completions (in XDP mode the program writes
them to ring i, dosa_xdp.c ring_output), their shadow copies and NACK scan. Asks and duplicates may
reach any shard (they only read). In userspace mode the shards share the DPU's port through a
reuseport group this parent creates, in shard order, with a classic BPF program that hands each
packet to the socket of its partition's shard (partition % N): each shard merges its partitions
alone. (UDP GRO is off on those sockets: GRO may coalesce one host's packets of several
partitions into one buffer, which the kernel steers by its first packet.)

The parent starts the shards (``--shard i/N``), pins them (``--cpus``), writes its pid file once
every shard is ready, merges their counters into the one stats file /metrics reads, forwards
SIGTERM, and stops them all (exit status 1) when one dies: a DPU with a dead shard would stall the
rounds of its slots.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

from dosa.errors import DosaError

from . import policy

log = logging.getLogger("dosa.dpu")

# classic BPF (linux/filter.h): A = the u16 at payload offset 14 (the dosa header's partition);
# A %= N; return A, the index of the reuseport group's socket
_BPF_LD_H_ABS, _BPF_ALU_MOD_K, _BPF_RET_A = 0x28, 0x94, 0x16
SO_ATTACH_REUSEPORT_CBPF = 51
PARTITION_OFFSET = 14


def steering_program(shards: int) -> bytes:
    """The sock_fprog's filter: socket index = partition % shards."""
    from dosa.wire import HEADER_DTYPE

    if HEADER_DTYPE.fields["partition"][1] != PARTITION_OFFSET:
        raise DosaError("the dosa header's partition field moved: update the steering program")
    ins = [(_BPF_LD_H_ABS, 0, 0, PARTITION_OFFSET), (_BPF_ALU_MOD_K, 0, 0, shards), (_BPF_RET_A, 0, 0, 0)]
    return b"".join(struct.pack("HBBI", *i) for i in ins)


def reuseport_group(bind: tuple[str, int], shards: int) -> list[socket.socket]:
    """``shards`` UDP sockets bound to ``bind`` in one reuseport group, in shard order, steering
    each packet to its partition's shard."""
    import ctypes

    socks = []
    try:
        for _ in range(shards):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(bind)
        prog = steering_program(shards)
        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(buf))
        socks[0].setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    except OSError as e:
        for s in socks:
            s.close()
        raise DosaError(f"cannot make the shards' reuseport group on {bind[0]}:{bind[1]}: "
                        f"{e.strerror or e}") from None
    return socks


def _child_argv(args, i: int, n: int) -> list[str]:
    argv = [sys.executable, "-m", "dosa", "dpu", "run", "--mode", args.mode, "--shard", f"{i}/{n}"]
    for f in args.job_config:
        argv += ["--job-config", f]
    for flag, value in (("--dpu-index", args.dpu_index), ("--addr", args.addr), ("--port", args.port),
                        ("--iface", args.iface), ("--instance", args.instance), ("--pin-dir", args.pin_dir),
                        ("--gtopk-density", args.gtopk_density), ("--duration", args.duration),
                        ("--cpus", args.cpus)):
        if value is not None:
            argv += [flag, str(value)]
    if args.control is not None:
        argv += ["--control", f"{args.control[0]}:{args.control[1]}"]
    if args.state_dir:
        argv += ["--state-dir", f"{args.state_dir}/shard{i}"]
    if args.stats_file:
        argv += ["--stats-file", f"{args.stats_file}.shard{i}"]
    if args.pid_file:
        argv += ["--pid-file", f"{args.pid_file}.shard{i}"]
    if args.verbose:
        argv.append("-v")
    return argv


def merge_stats(paths: list[str], out: str) -> None:
    """The shards' stats files summed into ``out`` (the one file control/metrics.py reads)."""
    stats, jobs, meta = collections.Counter(), {}, {}
    for p in paths:
        try:
            with open(p) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        meta = meta or {k: doc.get(k) for k in ("dpu_index", "mode")}
        stats.update(doc.get("stats", {}))
        for j, c in doc.get("jobs", {}).items():
            jobs.setdefault(j, collections.Counter()).update(c)
    doc = {"pid": os.getpid(), "time": time.time(), **meta, "shards": len(paths),
           "stats": dict(stats), "jobs": {j: dict(c) for j, c in jobs.items()}}
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, out)


def run_shards(args, bind: tuple[str, int], dpu_index: int, cpus: list[int] | None) -> int:
    n = args.workers
    if args.mode == "xdp":
        from .worker import open_maps

        with open_maps(args.pin_dir or args.instance) as maps:
            maps.set_shards(n)
    socks = reuseport_group(bind, n)  # XDP mode: the asks and duplicates XDP passes up
    procs: list[subprocess.Popen] = []
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    rc = 0
    try:
        for i in range(n):
            env = dict(os.environ, DOSA_DPU_SOCKET_FD=str(socks[i].fileno()))
            if args.mode != "xdp":
                env["DOSA_GRO"] = "0"  # see the module docstring
            procs.append(subprocess.Popen(_child_argv(args, i, n), env=env,
                                          pass_fds=(socks[i].fileno(),)))
        for s in socks:
            s.close()  # the shards hold them now
        ready = [f"{args.pid_file}.shard{i}" for i in range(n)] if args.pid_file else []
        while ready and not stop["now"]:
            if all(os.path.exists(p) for p in ready):
                with open(args.pid_file, "w") as f:
                    f.write(f"{os.getpid()}\n")
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        stats = [f"{args.stats_file}.shard{i}" for i in range(n)] if args.stats_file else []
        while not stop["now"]:
            dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                i, code = dead[0]
                if code != 0 or args.duration is None:
                    log.error("DPU worker shard %d of %d exited (status %s): stopping the others",
                              i, n, code)
                    rc = 1
                break
            if stats:
                merge_stats(stats, args.stats_file)
            time.sleep(policy.STATS_EVERY)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for path in (args.pid_file, args.stats_file):
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    return rc
