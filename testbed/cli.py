"""``dosa testbed up|status|down|run|capture|exec`` and ``dosa deploy``."""
from __future__ import annotations

import argparse
import json
import sys

from dosa.errors import DosaError
from dosa.job import DPU_MODES

from testbed import config

RUN_EPILOG = ("Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
              "MASTER_PORT and DOSA_* variables (docs/testbed.md).")


def register(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default=None,
                        help=f"testbed name prefix (default ${config.ENV_PREFIX} or "
                             f"{config.DEFAULT_PREFIX!r})")
    tb = sub.add_parser("testbed", help="namespace testbed: hosts, DPUs and a fabric on this machine")
    tsub = tb.add_subparsers(dest="testbed_cmd", metavar="ACTION")
    tb.set_defaults(func=lambda a: (tb.print_help(), 2)[1])

    up = tsub.add_parser("up", parents=[common], help="build the testbed and start the DPU side")
    up.add_argument("--hosts", type=int, required=True, help="number of host namespaces (ranks)")
    up.add_argument("--dpus", type=int, default=1, help="number of DPU namespaces (default 1)")
    up.add_argument("--link-rate", help="rate of each host link, e.g. 10gbit, 100mbit (tbf)")
    up.add_argument("--delay", help="one-way delay per direction, e.g. 200us (needs the netem "
                                    "qdisc, which this kernel lacks)")
    up.add_argument("--loss", help="random loss per direction in percent, e.g. 1%%")
    up.add_argument("--dup", help="random duplication per direction in percent")
    up.add_argument("--reorder", help="percent of UDP packets per direction held in a slow lane "
                                      "that later packets overtake, e.g. 5%% (HTB + tc BPF)")
    up.add_argument("--shape-dpus", action="store_true",
                    help="shape the DPU links too (default: host links only)")
    up.add_argument("--cpu-split", action="store_true",
                    help="pin hosts and DPUs to disjoint CPUs (first half / second half)")
    up.add_argument("--mode", choices=DPU_MODES, default="xdp",
                    help="DPU dataplane: XDP program, or the worker merging from a socket")
    up.add_argument("--dpu-workers", type=int, default=1, metavar="N",
                    help="DPU worker processes per DPU (dosa dpu run --workers N; with --cpu-split "
                         "pinned to the DPUs' cores; default 1)")
    up.add_argument("--no-services", action="store_true",
                    help="topology only: do not start the control plane and DPU workers")
    up.add_argument("--subnet", default=None, help=f"IPv4 network (default {config.DEFAULT_SUBNET})")
    up.add_argument("--mtu", type=int, default=None,
                    help=f"MTU of every link (default {config.DEFAULT_MTU}, at most "
                         f"{config.MAX_MTU}: the largest frame native XDP takes on a veth)")
    up.add_argument("--ready-timeout", type=float, default=120.0,
                    help="seconds to wait for the DPU services to become ready")
    up.add_argument("--tls", action="store_true",
                    help="the control planes serve HTTPS, with certificates of a CA made for this "
                         "testbed (ranks get it in DOSA_CONTROL_CA)")
    up.set_defaults(func=cmd_up)

    st = tsub.add_parser("status", parents=[common], help="what is up: namespaces, addresses, processes")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)

    down = tsub.add_parser("down", parents=[common], help="remove everything (idempotent)")
    down.set_defaults(func=cmd_down)

    run = tsub.add_parser("run", parents=[common], help="run a command on every host (one rank each)",
                          epilog=RUN_EPILOG)
    _run_args(run)
    run.set_defaults(func=cmd_run)

    cap = tsub.add_parser("capture", parents=[common],
                          help="run a command on every host while recording the fabric")
    cap.add_argument("--out", required=True, help="pcap file to write")
    cap.add_argument("--filter", default=None, help="tcpdump filter expression, e.g. 'udp'")
    _run_args(cap)
    cap.set_defaults(func=cmd_capture)

    rs = tsub.add_parser("restart", parents=[common],
                         help="restart a DPU's worker (or control plane) and record the new process",
                         description="Kill the recorded process of the service, start the same command "
                                     "again in the DPU's namespace, wait until it is ready; `status` "
                                     "then reports the new pid as alive (docs/testbed.md).")
    rs.add_argument("node", help="the DPU, e.g. d0")
    rs.add_argument("--service", choices=("dpu", "ctl"), default="dpu",
                    help="dpu: the DPU worker (default); ctl: the control plane")
    rs.set_defaults(func=cmd_restart)

    ex = tsub.add_parser("exec", parents=[common], help="run a command inside one node (h0, d0, fab)")
    ex.add_argument("node")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    ex.set_defaults(func=cmd_exec)

    dep = sub.add_parser("deploy", help="install dosa on real hosts/DPUs over ssh, start the DPU side")
    dep.add_argument("--inventory", required=True, help="TOML inventory (testbed/examples/inventory.toml)")
    dep.add_argument("--dry-run", action="store_true", help="print every command, run nothing")
    dep.add_argument("--stop", action="store_true", help="only stop the DPU services")
    dep.set_defaults(func=cmd_deploy)


def _run_args(p) -> None:
    p.add_argument("--timeout", type=float, default=None, help="seconds before every rank is killed")
    p.add_argument("--log-dir", default=None, help="where rank<i>.out/.err go (default under /tmp)")
    p.add_argument("--master-port", type=int, default=config.DEFAULT_MASTER_PORT)
    p.add_argument("--quiet", action="store_true", help="do not echo the ranks' output")
    p.add_argument("--ranks-per-node", type=int, default=1, metavar="L",
                   help="run L ranks in every host namespace, as the local ranks of one node that "
                        "share its address and link (LOCAL_RANK, LOCAL_WORLD_SIZE; default 1)")
    p.add_argument("--torchrun", action="store_true",
                   help="start one real torchrun agent per host (c10d rendezvous over the fabric); "
                        "the command is then SCRIPT ARGS")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")


def _cmd(args) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise DosaError("no command given (put it after `--`)")
    return cmd


def _tb(args):
    from testbed.core import Testbed
    return Testbed(prefix=args.prefix, subnet=getattr(args, "subnet", None))


def cmd_up(args) -> int:
    tb = _tb(args)
    tb.progress = True  # a bar on a terminal, plain lines otherwise (dosa.progress)
    st = tb.up(args.hosts, args.dpus, link_rate=args.link_rate, delay=args.delay, loss=args.loss,
               dup=args.dup, reorder=args.reorder, shape_dpus=args.shape_dpus,
               cpu_split=args.cpu_split, mode=args.mode, services=not args.no_services,
               ready_timeout=args.ready_timeout, mtu=args.mtu, tls=args.tls,
               dpu_workers=args.dpu_workers)
    _print_status(st)
    return 0


def cmd_status(args) -> int:
    st = _tb(args).status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        _print_status(st)
    return 0 if st["up"] else 1


def _print_status(st: dict) -> None:
    if not st.get("config"):
        stale = st.get("stale_namespaces") or []
        print(f"testbed {st['prefix']!r} is down" +
              (f" (left-over namespaces {', '.join(stale)}: run `dosa testbed down`)" if stale else ""))
        return
    c = st["config"]
    print(f"testbed {st['prefix']!r}: {'up' if st['up'] else 'NOT fully up (' + str(st['status']) + ')'}"
          f", {c['hosts']} host(s), {c['dpus']} DPU(s), {c['subnet']}, mode {c['mode']}"
          + (f", hosts on CPUs {c['host_cpus']}, DPUs on CPUs {c['dpu_cpus']}" if c["cpu_split"] else ""))
    shaping = _shaping_line(c.get("shaping") or {}, c.get("shape_dpus"))
    if shaping:
        print(shaping)
    for n in st["nodes"]:
        ifs = "; ".join(f"{i['name']} {','.join(i['addresses'])} {i['mac']}"
                        + (f" qdisc {'+'.join(i['qdiscs'])}" if i["qdiscs"] else "")
                        + (" xdp" if i["xdp"] else "") for i in n["interfaces"])
        print(f"  {n['name']:4} {n['role']:4} {n['namespace']:12} {ifs or '(namespace missing)'}")
    fab = st["fabric"]
    print(f"  fabric {fab['namespace']} bridge {fab['bridge']}: "
          + ", ".join(i["name"] + ("(" + "+".join(q for q in i["qdiscs"] if q != "noqueue") + ")"
                                   if [q for q in i["qdiscs"] if q != "noqueue"] else "")
                      for i in fab["interfaces"]))
    for p in st["processes"]:
        again = f" (restarted {p['restarts']}x)" if p.get("restarts") else ""
        print(f"  {p['name']:10} pid {p['pid']:<7} {'alive' if p['alive'] else 'DEAD'}{again}  log {p['log']}")


def _shaping_line(sh: dict, shape_dpus: bool) -> str:
    """``  links (hosts): rate 1000Mbit/s, loss 1%, reorder 5% (slow lane 50Mbit/s)`` or ''."""
    from testbed.shaping import Shaping
    s = Shaping.from_json(sh)
    parts = [f"rate {s.rate_bps / 1e6:g}Mbit/s"] if s.rate_bps else []
    parts += [f"delay {s.delay_s * 1e6:g}us"] if s.delay_s else []
    parts += [f"{k} {v:g}%" for k, v in (("loss", s.loss_pct), ("dup", s.dup_pct)) if v]
    if s.reorder_pct:
        lane = f" (slow lane {s.slow_lane_bps() / 1e6:g}Mbit/s)" if s.uses_htb_reorder else ""
        parts.append(f"reorder {s.reorder_pct:g}%{lane}")
    return f"  links ({'hosts and DPUs' if shape_dpus else 'hosts'}), per direction: " + \
        ", ".join(parts) if parts else ""


def cmd_down(args) -> int:
    r = _tb(args).down()
    what = f"{len(r['namespaces'])} namespace(s), {r['processes']} process(es)"
    print(f"testbed {r['prefix']!r} down: removed {what}"
          + (", pinned maps" if r["pin_dir_removed"] else "")
          + (", state file" if r["state_file_removed"] else ""))
    return 0


def cmd_run(args) -> int:
    res = _tb(args).run(_cmd(args), timeout=args.timeout, log_dir=args.log_dir,
                        echo=not args.quiet, master_port=args.master_port, torchrun=args.torchrun,
                        ranks_per_node=args.ranks_per_node)
    return _report_run(res)


def _report_run(res) -> int:
    print(f"dosa: {res.summary()}", file=sys.stderr if not res.ok else sys.stdout)
    if res.ok:
        return 0
    return 124 if res.timed_out else 1


def cmd_capture(args) -> int:
    flt = args.filter.split() if args.filter else None
    stats, res = _tb(args).capture(args.out, _cmd(args), timeout=args.timeout, bpf_filter=flt,
                                   log_dir=args.log_dir, echo=not args.quiet,
                                   master_port=args.master_port, torchrun=args.torchrun,
                                   ranks_per_node=args.ranks_per_node)
    drops = f", {stats.dropped_by_kernel} dropped by the kernel" if stats.dropped_by_kernel else ""
    print(f"dosa: captured {stats.packets} packets to {stats.path}{drops}")
    return _report_run(res)


def cmd_exec(args) -> int:
    tb = _tb(args)
    st = tb._require_state()
    env = {}
    dpus = {n.name: n for n in tb.layout(st).dpu_nodes}
    if args.node in dpus:  # `dosa ctl ...` inside a DPU finds its dataplane and control plane
        env["DOSA_PIN_DIR"] = str(tb.pin_dir / dpus[args.node].name)
        env["DOSA_CONTROL"] = f"{dpus[args.node].address}:{st['control_port']}"
    env.update(tb.credential_env(args.node))  # a DPU's `dosa ctl` is the operator, a host a host
    p = tb.exec_in(args.node, _cmd(args), capture=False, env=env)
    return p.returncode


def cmd_restart(args) -> int:
    from testbed.restart import restart_service

    rec = restart_service(_tb(args), args.node, args.service)
    print(f"dosa: restarted {rec['name']}: pid {rec['pid']} (restart {rec['restarts']}), log {rec['log']}")
    return 0


def cmd_deploy(args) -> int:
    from testbed import deploy
    inv = deploy.load_inventory(args.inventory)
    steps = deploy.plan(inv, stop_only=args.stop)
    if args.dry_run:
        for s in steps:
            print(f"# {s.target}: {s.what}")
            print(s.shell())
        if not args.stop:
            print("# then, on each host, train with (torchrun adds RANK/WORLD_SIZE/MASTER_*):")
            for i, h in enumerate(inv.hosts):
                env = " ".join(f"{k}={v}" for k, v in deploy.host_env(inv, i).items())
                print(f"#   {h.name}: {env} torchrun ...")
        return 0
    deploy.execute(steps)
    print(f"dosa: deployed to {len(inv.hosts)} host(s) and {len(inv.dpus)} DPU(s)")
    return 0
