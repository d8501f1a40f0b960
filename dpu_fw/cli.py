"""``dosa dpu run``: the DPU worker."""
from __future__ import annotations

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
    if args.control is not None:
        from_control = _control_discovery(args.control, bind)
        if args.mode == "xdp":
            from .xdp_backend import jobs_from_maps

            def discover():
                # a job created through another DPU's control plane is in this DPU's maps (its
                # flows too) but not in this control plane's registry
                # maps first, then the control plane's fuller view overrides: read the other way
                # round, a join landing between the two reads would let the maps' partial view win
                got = {j.job_id: j for j in jobs_from_maps(worker.maps, bind, args.gtopk_density)}
                ctl = from_control()
                if ctl is None:  # unreachable this time: do not take the maps' view for the truth
                    return None
                got.update({j.job_id: j for j in ctl})
                return list(got.values())
        else:
            discover = from_control
    elif args.mode == "xdp" and not jobs:
        if bind is None:
            raise DosaError("XDP mode without --job-config needs --addr (and --port)")
        from .xdp_backend import jobs_from_maps

        def discover():
            return jobs_from_maps(worker.maps, bind, args.gtopk_density)
    elif not jobs:
        raise DosaError("give --job-config FILE or --control ADDR:PORT to learn the jobs to serve")
    else:
        discover = None
    if idx is None:
        idx = 0
    if bind is None and jobs:
        bind = jobs[0].dpus[idx]
    if bind is None:
        raise DosaError("give --addr/--port, or a job config naming this DPU's address")
    worker = DpuWorker(jobs, idx, mode=args.mode, bind=bind, state_dir=args.state_dir,
                       instance=instance, discover=discover)
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
            print({k: v for k, v in worker.stats.items() if v})
    return 0


def _control_discovery(control, bind):
    """Jobs the control plane knows whose every worker has joined (None when it cannot be asked:
    the worker then changes nothing). This DPU's index in a job is its position in the job's DPU
    list (matched by address): DpuWorker.add_job checks it per job."""
    from dosa.join import request

    from dosa.job import JobConfig

    log = logging.getLogger("dosa.dpu")

    def discover():
        try:
            views = request(control, "GET", "/v1/jobs", timeout=2.0).get("jobs", [])
        except DosaError as e:
            log.warning("%s", e)
            return None
        out = []
        for v in views:
            try:  # incomplete ones too (None hosts): the worker keeps serving a job members leave
                out.append(JobConfig.from_view(v, partial=True))
            except DosaError as e:
                log.warning("%s", e)
        return out

    return discover
