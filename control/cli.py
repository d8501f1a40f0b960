"""``dosa ctl ...``: attach/detach the dataplane, install jobs and workers, read counters, serve the
join API. Every failure a user can cause is one DosaError sentence (no traceback)."""
from __future__ import annotations

import json
import os
import signal
import sys

from dosa import wire
from dosa.errors import DosaError
from dataplane.layout import BUF_DTYPE
from dataplane.loader import DEFAULT_POOL_BUFFERS
from dosa.job import DEFAULT_SLOTS, DPU_MODES, RESULT_MODES, DpuMode, ResultMode
from dosa.net import DEFAULT_CONTROL_PORT


def _instance(args) -> str:
    return args.pin_dir or args.instance


def _common(p) -> None:
    p.add_argument("--instance", default="default",
                   help="dataplane instance name (pins in /sys/fs/bpf/dosa/NAME; default: default)")
    p.add_argument("--pin-dir", default=os.environ.get("DOSA_PIN_DIR") or None,
                   help="pin directory under /sys/fs/bpf instead of an instance name (default "
                        "$DOSA_PIN_DIR: `dosa testbed exec dN` sets it to that DPU's)")


def _hostport(s: str) -> tuple[str, int]:
    from dosa.net import hostport_arg

    return hostport_arg(s)


def register(sub) -> None:
    p = sub.add_parser("ctl", help="control plane: attach the XDP dataplane, jobs, workers, counters")
    csub = p.add_subparsers(dest="ctl_cmd", metavar="CMD")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    _register_dataplane(csub)
    _register_jobs(csub)
    _register_workers(csub)
    _register_stats(csub)
    _register_serve(csub)
    _register_secret(csub)


def _register_dataplane(csub) -> None:
    """``ctl attach`` / ``ctl detach``: the XDP dataplane on an interface."""
    a = csub.add_parser("attach", help="load (if needed) and attach the XDP dataplane to an interface")
    _common(a)
    a.add_argument("--iface", "--dev", dest="iface", required=True, help="network interface")
    a.add_argument("--netns", help="network namespace of the interface (ip netns name)")
    a.add_argument("--xdp-mode", choices=("auto", "native", "skb"), default="auto")
    a.add_argument("--port", type=int, default=wire.DEFAULT_PORT, help="UDP port carrying dosa")
    a.add_argument("--pool-buffers", type=int, default=DEFAULT_POOL_BUFFERS,
                   help="aggregation buffers in the pool, 288 KiB each (a job holds 2 a slot; "
                        f"default {DEFAULT_POOL_BUFFERS})")
    a.add_argument("--pstate-slots", type=int, default=65536, help="(job, aggregation slot) states")
    a.add_argument("--wstate-slots", type=int, default=262144, help="(slot, parity, worker) states")
    a.set_defaults(func=cmd_attach)

    d = csub.add_parser("detach", help="detach the dataplane (and unload it after the last interface)")
    _common(d)
    d.add_argument("--iface", "--dev", dest="iface", required=True)
    d.add_argument("--netns")
    d.add_argument("--keep-state", action="store_true", help="keep the pinned maps (jobs, buffers)")
    d.set_defaults(func=cmd_detach)


def _register_jobs(csub) -> None:
    """``ctl job add | rm | ls``."""
    j = csub.add_parser("job", help="install / remove / list jobs")
    jsub = j.add_subparsers(dest="job_cmd", metavar="CMD")
    j.set_defaults(func=lambda a: (j.print_help(), 2)[1])
    ja = jsub.add_parser("add", help="install a job in this DPU's dataplane")
    _common(ja)
    ja.add_argument("--job", type=int, required=True, help="job id (1..2^32-1)")
    ja.add_argument("--workers", type=int, required=True)
    ja.add_argument("--numel", type=int, required=True)
    ja.add_argument("--partition-size", type=int, default=wire.DEFAULT_PARTITION_SIZE)
    ja.add_argument("--num-dpus", type=int, default=1)
    ja.add_argument("--dpu-index", type=int, default=0)
    ja.add_argument("--scale-exp", type=int, default=16)
    ja.add_argument("--mode", choices=RESULT_MODES, default=ResultMode.SUM.value)
    ja.add_argument("--port", type=int, default=wire.DEFAULT_PORT)
    ja.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                    help="aggregation slots here: the job's window of partitions in flight (sets its memory)")
    ja.set_defaults(func=cmd_job_add)
    jr = jsub.add_parser("rm", help="remove a job (its flows and memory)")
    _common(jr)
    jr.add_argument("--job", type=int, required=True)
    jr.add_argument("--control", type=_hostport, default=os.environ.get("DOSA_CONTROL") or None,
                    metavar="ADDR:PORT",
                    help="remove it through this control plane, from every DPU of the job and its "
                         "registry (default $DOSA_CONTROL: `dosa testbed exec dN` sets it), signed "
                         "with the operator key of $DOSA_SECRET_FILE; without: from this dataplane's maps")
    jr.set_defaults(func=cmd_job_rm)
    jl = jsub.add_parser("ls", help="list jobs: from the control plane with their leases, or the "
                                    "dataplane's maps")
    _common(jl)
    jl.add_argument("--json", action="store_true")
    jl.add_argument("--control", type=_hostport, default=os.environ.get("DOSA_CONTROL") or None,
                    metavar="ADDR:PORT",
                    help="ask this control plane (jobs, members, leases; default $DOSA_CONTROL: "
                         "`dosa testbed exec dN` sets it) instead of reading the maps")
    jl.set_defaults(func=cmd_job_ls)


def _register_workers(csub) -> None:
    """``ctl worker add | rm``: a worker's flow."""
    w = csub.add_parser("worker", help="add / remove a worker flow")
    wsub = w.add_subparsers(dest="worker_cmd", metavar="CMD")
    w.set_defaults(func=lambda a: (w.print_help(), 2)[1])
    wa = wsub.add_parser("add", help="allow ADDRESS:PORT to send as WORKER of JOB")
    _common(wa)
    wa.add_argument("--job", type=int, required=True)
    wa.add_argument("--worker", type=int, required=True)
    wa.add_argument("--address", required=True)
    wa.add_argument("--port", type=int, default=wire.DEFAULT_PORT)
    wa.set_defaults(func=cmd_worker_add)
    wr = wsub.add_parser("rm")
    _common(wr)
    wr.add_argument("--job", type=int, required=True)
    wr.add_argument("--worker", type=int, required=True)
    wr.set_defaults(func=cmd_worker_rm)


def _register_stats(csub) -> None:
    """``ctl stats``."""
    s = csub.add_parser("stats", help="counters (drops by reason, merged, completions), jobs, flows")
    _common(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_stats)


def _register_serve(csub) -> None:
    """``ctl serve``: a DPU's control process (the dataplane and the join API)."""
    v = csub.add_parser("serve", help="run this DPU's control process: attach the dataplane (xdp mode) "
                                      "and serve the join API until SIGTERM")
    _common(v)
    v.add_argument("--iface", "--dev", dest="iface", help="interface to attach XDP to (xdp mode)")
    v.add_argument("--worker-stats", metavar="FILE",
                   help="the DPU worker's stats file (dpu run --stats-file): GET /metrics serves it too")
    v.add_argument("--netns")
    v.add_argument("--addr", required=True, help="this DPU's IPv4 address (as jobs list their DPUs)")
    v.add_argument("--listen", type=_hostport,
                   help=f"ADDR:PORT of the API (default: --addr:{DEFAULT_CONTROL_PORT})")
    v.add_argument("--port", type=int, default=wire.DEFAULT_PORT, help="UDP data port of dosa")
    v.add_argument("--mode", choices=DPU_MODES, default=DpuMode.XDP.value)
    v.add_argument("--xdp-mode", choices=("auto", "native", "skb"), default="auto")
    v.add_argument("--pool-buffers", type=int, default=DEFAULT_POOL_BUFFERS,
                   help="aggregation buffers in the pool, 288 KiB each (a job holds 2 a slot)")
    v.add_argument("--keep-state", action="store_true", help="leave the dataplane loaded on exit")
    v.add_argument("--secret-file", default=os.environ.get("DOSA_SECRET_FILE") or None,
                   help="the DPU's secret file (every role; made by `dosa testbed up`, `dosa deploy`, "
                        "`dosa ctl secret`; default $DOSA_SECRET_FILE): every call that changes "
                        "something must be signed with one of its keys")
    v.add_argument("--insecure", action="store_true",
                   help="serve without a secret: anyone who reaches the port may change any job")
    v.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM, its chain)")
    v.add_argument("--tls-key", help="the certificate's private key (PEM)")
    v.add_argument("--tls-ca", default=os.environ.get("DOSA_CONTROL_CA") or None,
                   help="CA certificate of the other DPUs' control planes, when they serve HTTPS "
                        "(default $DOSA_CONTROL_CA)")
    v.set_defaults(func=cmd_serve)


def _register_secret(csub) -> None:
    """``ctl secret``: a deployment's credentials."""
    k = csub.add_parser("secret", help="make a deployment secret: the DPUs' file (every role) and the "
                                       "hosts' (the host key only), mode 0600")
    k.add_argument("--dpu-file", required=True, help="for `ctl serve` and `dosa ctl` on the DPUs")
    k.add_argument("--host-file", required=True, help="for the training hosts (DOSA_SECRET_FILE)")
    k.set_defaults(func=cmd_secret)


def _ctl(args):
    from .controller import Controller

    return Controller(_instance(args))


def cmd_attach(args) -> int:
    from dataplane.loader import LoadConfig

    with _ctl(args) as c:
        c.attach(args.iface, netns=args.netns, mode=args.xdp_mode, port=args.port,
                 config=LoadConfig(pool_buffers=args.pool_buffers, pstate_slots=args.pstate_slots,
                                   wstate_slots=args.wstate_slots))
        where = f" in namespace {args.netns}" if args.netns else ""
        print(f"dosa dataplane {c.instance!r} attached to {args.iface}{where}")
    return 0


def cmd_detach(args) -> int:
    from dataplane import loader

    with _ctl(args) as c:
        if not loader.is_loaded(c.instance) and not c.attachments():
            raise DosaError(f"dataplane instance {c.instance!r} is not loaded")
        c.detach(args.iface, netns=args.netns, keep_state=args.keep_state)
        print(f"dosa dataplane {c.instance!r} detached from {args.iface}"
              + ("" if c.loaded else " and unloaded"))
    return 0


def cmd_job_add(args) -> int:
    with _ctl(args) as c:
        j = c.add_job(args.job, workers=args.workers, numel=args.numel, partition_size=args.partition_size,
                      num_dpus=args.num_dpus, dpu_index=args.dpu_index, scale_exp=args.scale_exp,
                      mode=args.mode, port=args.port, slots=args.slots)
        print(f"job {j.job_id}: {j.workers} workers, {j.numel} entries in {j.num_partitions} partitions, "
              f"{j.num_owned} owned here in {j.slots} aggregation slots: {j.pool_len} pool buffers "
              f"({j.pool_len * BUF_DTYPE.itemsize / 2**20:.1f} MiB) at {j.pool_off}")
    return 0


def cmd_job_rm(args) -> int:
    if args.control is not None:
        from dosa.join import request

        request(args.control, "DELETE", f"/v1/jobs/{args.job}", role="operator")
        print(f"job {args.job} removed from every DPU of it")
        return 0
    with _ctl(args) as c:
        c.remove_job(args.job)
        print(f"job {args.job} removed")
    return 0


def _job_ls_control(args) -> int:
    """The control plane's registry: each job with its generation, members and leases."""
    from dosa.join import request

    jobs = request(args.control, "GET", "/v1/jobs").get("jobs", [])
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no jobs")
    for j in jobs:
        lease = j.get("lease") or {}
        exp = lease.get("expires_in_s")
        print(f"{j['job_id']:>10}  generation {j.get('generation')}  workers {len(j['hosts'])}/"
              f"{j['workers']} joined  numel {j['numel']:>10}  "
              + (f"lease expires in {exp:.1f} s" if exp is not None else "no lease (never expires)"))
        for w, m in sorted((lease.get("members") or {}).items(), key=lambda x: int(x[0])):
            h = next((h for h in j["hosts"] if h["worker_id"] == int(w)), None)
            age = m.get("heartbeat_age_s")
            state = "no lease" if age is None else f"{'alive' if m['alive'] else 'DEAD'}, heartbeat {age:.1f} s ago"
            print(f"{'':>12}worker {w:>2}  {h['address'] + ':' + str(h['port']) if h else '?':<21} {state}")
    return 0


def cmd_job_ls(args) -> int:
    from dataclasses import asdict

    if args.control is not None:
        return _job_ls_control(args)
    with _ctl(args) as c:
        jobs = c.jobs()
        if args.json:
            print(json.dumps([asdict(j) for j in jobs], indent=2))
        else:
            for j in jobs:
                print(f"{j.job_id:>10}  workers {j.workers:>2}  numel {j.numel:>10}  partitions "
                      f"{j.num_partitions:>5} (owned {j.num_owned}, DPU {j.dpu_index}/{j.num_dpus})  "
                      f"port {j.port}")
    return 0


def cmd_worker_add(args) -> int:
    with _ctl(args) as c:
        c.add_worker(args.job, args.worker, args.address, args.port)
    return 0


def cmd_worker_rm(args) -> int:
    with _ctl(args) as c:
        c.remove_worker(args.job, args.worker)
    return 0


def cmd_stats(args) -> int:
    with _ctl(args) as c:
        st = c.stats()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"instance {st['instance']} ({st['pin_dir']}), attached to "
          + (", ".join(f"{a['ifname']}" + (f"@{a['netns']}" if a["netns"] else "") for a in st["attachments"])
             or "nothing"))
    for k, v in st["outcomes"].items():
        print(f"  {k:<24} {v}")
    print(f"  drops total              {st['drops_total']}")
    for k, v in st["drops"].items():
        if v:
            print(f"    {k:<22} {v}")
    print(f"  jobs: {len(st['jobs'])}, flows: {len(st['flows'])}")
    return 0


def cmd_secret(args) -> int:
    from dosa.auth import make_files

    make_files(args.dpu_file, args.host_file)
    print(f"secret written: {args.dpu_file} (DPUs: ctl serve --secret-file), {args.host_file} "
          "(hosts: DOSA_SECRET_FILE)")
    return 0


def _serve_credentials(args):
    """(secret, TLS context) of `ctl serve`, checked before the dataplane is attached."""
    from dosa.auth import Secret

    from .api.httpd import server_tls

    if args.secret_file is None and not args.insecure:
        raise DosaError("ctl serve needs --secret-file (the DPU's secret file: `dosa testbed up` and "
                        "`dosa deploy` make one, so does `dosa ctl secret`) or --insecure")
    secret = None
    if args.secret_file is not None and not args.insecure:
        secret = Secret.load(args.secret_file)
        missing = [r for r in ("host", "operator", "peer") if not secret.has(r)]
        if missing:
            raise DosaError(f"secret file {args.secret_file} has no {' or '.join(missing)} key: ctl serve "
                            "needs the DPUs' file, not a host's")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise DosaError("--tls-cert and --tls-key go together")
    return secret, (server_tls(args.tls_cert, args.tls_key) if args.tls_cert else None)


def cmd_serve(args) -> int:
    from dataplane.loader import LoadConfig

    from . import metrics  # noqa: F401  GET /metrics needs prometheus-client: missing, ctl serve says so now
    from .api import ControlServer, ControlService

    secret, tls = _serve_credentials(args)
    ctl = None
    if args.mode == DpuMode.XDP:
        if not args.iface:
            raise DosaError("xdp mode needs --iface (the interface to attach the dataplane to)")
        ctl = _ctl(args)
        ctl.attach(args.iface, netns=args.netns, mode=args.xdp_mode, port=args.port,
                   config=LoadConfig(pool_buffers=args.pool_buffers))
    listen = args.listen or (args.addr, DEFAULT_CONTROL_PORT)
    try:
        tag = _instance(args).strip("/").replace("/", "_")
        state = f"/run/dosa/{tag}-api.json"  # the registry survives a restart of this server
        service = ControlService(ctl, address=args.addr, data_port=args.port, control_port=listen[1],
                                 state_path=state, secret=secret, peer_ca=args.tls_ca)
        service.worker_stats = args.worker_stats  # GET /metrics serves the DPU worker's counters too
        server = ControlServer(service, listen[0], listen[1], tls=tls)

        def stop(signum, frame):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)
        how = ("https" if tls else "http") + (", credentials required" if secret else ", NO credentials")
        print(f"dosa control plane serving on {server.address} ({args.mode} mode, {how})", flush=True)
        try:
            server.serve_forever()
        except (SystemExit, KeyboardInterrupt):
            pass
        finally:
            server.httpd.server_close()
    finally:
        if ctl is not None:
            try:
                if not args.keep_state:
                    ctl.detach(args.iface, netns=args.netns)
            except DosaError as e:
                print(f"dosa: {e}", file=sys.stderr)
            ctl.close()
        if not args.keep_state:
            import contextlib
            import os

            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/run/dosa/{_instance(args).strip('/').replace('/', '_')}-api.json")
    return 0
