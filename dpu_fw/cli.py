"""``dosa dpu run``: the DPU worker."""
from __future__ import annotations

import argparse
import logging
import os

from dosa.errors import DosaError
from dosa.job import DPU_MODES


def _addr(s: str) -> tuple[str, int]:
    from dosa.net import hostport_arg

    return hostport_arg(s)


def register(sub) -> None:
    p = sub.add_parser("dpu", help="DPU-side services")
    dsub = p.add_subparsers(dest="dpu_cmd", metavar="CMD")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    r = dsub.add_parser("run", help="run the DPU worker (results, shadow copies, retransmission; "
                                    "userspace mode also merges)")
    r.add_argument("--mode", choices=DPU_MODES, default="xdp")
    r.add_argument("--job-config", action="append", default=[], metavar="FILE",
                   help="a job's JSON config (dosa.job.JobConfig); repeatable")
    r.add_argument("--dpu-index", type=int, default=None,
                   help="this DPU's index in the jobs' DPU list (default: found from --addr)")
    r.add_argument("--addr", help="IPv4 address to listen on (default: the job config's)")
    r.add_argument("--port", type=int, help="UDP port (default: the job config's)")
    r.add_argument("--iface", help="the DPU's interface (informational; XDP is attached by the control plane)")
    r.add_argument("--instance", help="dataplane instance whose pinned maps to open (XDP mode)")
    r.add_argument("--pin-dir", help="pin directory of the dataplane instance (its last component is "
                                     "the instance name)")
    r.add_argument("--control", type=_addr, metavar="ADDR:PORT",
                   help="control plane API to learn jobs from (in XDP mode jobs are also read from the maps)")
    r.add_argument("--state-dir", help="userspace mode: keep merge state in files here so a restarted "
                                       "worker continues (e.g. /dev/shm/dosa-dpu0)")
    r.add_argument("--gtopk-density", type=float, default=0.01,
                   help="density of gtopk jobs discovered from the dataplane maps (default 0.01)")
    r.add_argument("--pid-file", help="written with the worker's pid once it is ready")
    r.add_argument("--stats-file", help="keep this JSON file of the worker's counters (per job) current, "
                                        "for the control process's /metrics (ctl serve --worker-stats)")
    r.add_argument("--workers", type=int, default=1, metavar="N",
                   help="worker processes, one per DPU core (1..8): the slots are sharded over them, "
                        "each with its own completions, shadow copies and NACK scan (default 1)")
    r.add_argument("--cpus", help="CPUs to pin the workers to, e.g. 0-3 or 2,3 (worker i takes the "
                                  "i-th, round robin; default: not pinned)")
    r.add_argument("--shard", help=argparse.SUPPRESS)  # I/N: run as shard I of N (set by --workers)
    r.add_argument("--duration", type=float, help="stop after this many seconds")
    r.add_argument("-v", "--verbose", action="store_true")
    r.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from dosa.job import JobConfig

    from .worker import DpuWorker, install_signal_handlers

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s dpu %(levelname)s %(message)s")
    jobs = [JobConfig.load(f) for f in args.job_config]
    idx = args.dpu_index
    if idx is None:
        if jobs and args.addr:
            found = [i for i, (a, _) in enumerate(jobs[0].dpus) if a == args.addr]
            if not found:
                raise DosaError(f"{args.addr} is not one of job {jobs[0].job_id}'s DPUs")
            idx = found[0]
        elif jobs:
            idx = 0
    bind = None
    if args.addr or args.port:
        if jobs and idx is not None:
            da, dp = jobs[0].dpus[idx]
        else:
            da, dp = "0.0.0.0", None
        bind = (args.addr or da, args.port or dp)
        if bind[1] is None:
            from dosa.wire import DEFAULT_PORT
            bind = (bind[0], DEFAULT_PORT)
    instance = args.pin_dir or args.instance
    if args.control is None and args.mode != "xdp" and not jobs:
        raise DosaError("give --job-config FILE or --control ADDR:PORT to learn the jobs to serve")
    if args.control is None and args.mode == "xdp" and not jobs and bind is None:
        raise DosaError("XDP mode without --job-config needs --addr (and --port)")
    if idx is None:
        idx = 0
    if bind is None and jobs:
        bind = jobs[0].dpus[idx]
    if bind is None:
        raise DosaError("give --addr/--port, or a job config naming this DPU's address")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise DosaError(f"--workers must lie in 1..{MAX_WORKERS}, got {args.workers}")
    cpus = parse_cpus(args.cpus) if args.cpus else None
    if args.workers > 1 and args.shard is None:
        from .shards import run_shards

        return run_shards(args, bind, idx, cpus)
    shard, shards = parse_shard(args.shard) if args.shard else (0, 1)
    if cpus:
        os.sched_setaffinity(0, {cpus[shard % len(cpus)]})
    sock = None
    if os.environ.get("DOSA_DPU_SOCKET_FD"):  # the shard's socket of the parent's reuseport group
        import socket

        sock = socket.socket(fileno=int(os.environ.pop("DOSA_DPU_SOCKET_FD")))
    # the maps are the worker's own (opened in DpuWorker): the source reads them once it exists
    worker = None
    source = _source(args, bind, lambda: worker.maps)
    worker = DpuWorker(jobs, idx, mode=args.mode, bind=bind, state_dir=args.state_dir,
                       instance=instance, discover=source, shard=shard, shards=shards, sock=sock)
    install_signal_handlers(worker)
    worker.stats_file = args.stats_file
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    try:
        prof = os.environ.get("DOSA_DPU_PROFILE")  # a cProfile dump of the worker loop, for tuning
        if prof:
            import cProfile

            cProfile.runctx("worker.run(args.duration)", globals(), locals(), prof)
        else:
            worker.run(args.duration)
    finally:
        worker.close()
        for path in (args.pid_file, args.stats_file):  # a stopped worker has no counters to serve
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if args.verbose:
            print({k: v for k, v in worker.totals().items() if v})
    return 0


#: worker processes one dpu run may start: one completion ring each (dataplane.layout.MAX_SHARDS)
MAX_WORKERS = 8


def parse_cpus(text: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6]; a DosaError sentence for anything else."""
    out: list[int] = []
    try:
        for part in text.split(","):
            a, _, b = part.partition("-")
            out += list(range(int(a), int(b or a) + 1))
    except ValueError:
        raise DosaError(f"--cpus {text!r} is not a CPU list like 0-3 or 2,3") from None
    if not out or min(out) < 0:
        raise DosaError(f"--cpus {text!r} is not a CPU list like 0-3 or 2,3")
    return out


def parse_shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    return int(i), int(n)


def _source(args, bind, maps):
    """The discover() of the worker's job sources (dpu_fw.discovery), or None: the job files only."""
    from .discovery import control_discovery, jobs_from_maps, maps_and_control

    if args.control is not None:
        if args.mode == "xdp":
            return lambda: maps_and_control(maps(), bind, args.control, args.gtopk_density)()
        return control_discovery(args.control, bind)
    if args.mode == "xdp" and not args.job_config:
        return lambda: jobs_from_maps(maps(), bind, args.gtopk_density)
    return None
