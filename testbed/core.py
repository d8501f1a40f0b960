"""``Testbed``: bring a namespace testbed up, describe it, run jobs on it, tear it down.

The same class backs the CLI (``dosa testbed ...``), the tests and the benchmarks::

    tb = Testbed(prefix="bench")
    tb.up(hosts=4, dpus=1, link_rate="10gbit", cpu_split=True)
    try:
        tb.run([sys.executable, "train.py"], timeout=600).check()
    finally:
        tb.down()

``down`` never relies on the state file alone: it also finds the testbed's namespaces by name
(``<prefix>-h<i>|d<j>|fab``) and kills every process inside them, so it cleans up after a crashed
``up`` or a stale state file.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dosa.env import RankEnv
from dosa.errors import DosaError
from dosa.job import DPU_MODES, DpuMode

from testbed import config, credentials, impair, ns, state, supervise
from testbed.netlink import Netlink, netns_del
from testbed.capture import CaptureStats, Tcpdump, WireFrames
from testbed.config import BRIDGE, NODE_IFACE, Layout, Node, check_ranks_per_node
from testbed.runner import RankSpec, RunResult, run_ranks, torchrun_argv
from testbed.services import CONTROL_PORT, DATA_PORT, DpuContext, ServiceSpec, dpu_services
from testbed.shaping import Shaping

BRIDGE_MAC = "02:d0:5a:80:00:00"


class Testbed:
    """A testbed identified by ``prefix`` (default: $DOSA_TESTBED_PREFIX or ``dosa``).

    Args:
        prefix: namespace/state prefix; tests use their own so a user's testbed is never touched.
        subnet: IPv4 network of the fabric (default 10.77.0.0/24; never routed outside).
        state_dir: where the state file and run directory live (default /run/dosa).
        services: function DpuContext -> list[ServiceSpec] (default testbed.services.dpu_services).
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, prefix: str | None = None, subnet: str | None = None,
                 state_dir: str | os.PathLike | None = None, services=None):
        self.prefix = config.check_prefix(prefix) if prefix else config.default_prefix()
        self.subnet = subnet or os.environ.get(config.ENV_SUBNET, config.DEFAULT_SUBNET)
        self.state_dir = Path(state_dir) if state_dir else config.state_dir()
        self.state_path = config.state_file(self.prefix, self.state_dir)
        self.run_dir = config.run_dir(self.prefix, self.state_dir)
        self.pin_dir = config.pin_dir(self.prefix)
        self.cred_dir = self.run_dir / "credentials"  # testbed/credentials.py: secret, TLS
        self.services = services or supervise.services_from_env() or dpu_services
        #: show progress while ``up`` builds nodes and starts services (the CLI sets it; dosa.progress)
        self.progress = False

    # ------------------------------------------------------------------ helpers
    def __repr__(self):
        return f"Testbed(prefix={self.prefix!r})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.down()

    def existing_namespaces(self) -> list[str]:
        rx = config.ns_regex(self.prefix)
        return sorted(n for n in ns.list_netns() if rx.match(n))

    def load_state(self) -> dict | None:
        return state.load(self.state_path)

    def _require_state(self) -> dict:
        st = self.load_state()
        if not st or st.get("status") != "up":
            raise DosaError(f"no testbed {self.prefix!r} is up; start one with "
                            f"`dosa testbed up --hosts N --dpus M{self._prefix_flag()}`")
        return st

    def layout(self, st: dict | None = None) -> Layout:
        st = st or self._require_state()
        return Layout(self.prefix, st["hosts"], st["dpus"], st["subnet"])

    def _cred(self, name: str) -> str | None:
        """The path of one of this testbed's credential files, None when it has none."""
        p = self.cred_dir / name
        return str(p) if p.exists() else None

    def credential_env(self, node: str) -> dict:
        """DOSA_SECRET_FILE and DOSA_CONTROL_CA for a command in ``node``: a DPU gets the DPUs'
        file (operator: ``dosa ctl job rm``), a host the hosts' (what ranks get)."""
        dpus = {n.name for n in self.layout().dpu_nodes}
        name = credentials.DPU_SECRET if node in dpus else credentials.HOST_SECRET
        return {"DOSA_SECRET_FILE": self._cred(name) or "", "DOSA_CONTROL_CA": self._cred(credentials.CA_CERT) or ""}

    def namespace(self, name: str) -> str:
        """Namespace of ``h0``/``d1``/``fab`` (or a full namespace name of this testbed)."""
        if name in ("fab", "fabric", config.fabric_ns(self.prefix)):
            return config.fabric_ns(self.prefix)
        if config.ns_regex(self.prefix).match(name):
            return name
        if config.ns_regex(self.prefix).match(f"{self.prefix}-{name}"):
            return f"{self.prefix}-{name}"
        raise DosaError(f"{name!r} is not a node of testbed {self.prefix!r} (use h0, d0, fab)")

    # ------------------------------------------------------------------ up
    def up(self, hosts: int, dpus: int, *, link_rate: str | None = None, delay: str | None = None,
           loss=None, dup=None, reorder=None, shape_dpus: bool = False, cpu_split: bool = False,
           mode: str = "xdp", services: bool = True, ready_timeout: float = 120.0,
           data_port: int = DATA_PORT, control_port: int = CONTROL_PORT, mtu: int | None = None,
           tls: bool = False, dpu_workers: int = 1) -> dict:
        """Build the topology (and start the DPU services unless ``services=False``); return
        ``status()``. On any failure everything built so far is torn down before the error.

        Every testbed gets a deployment secret (testbed/credentials.py, in the run directory): the
        control planes take only signed calls, and the ranks get the hosts' file in
        DOSA_SECRET_FILE. ``tls``: the control planes also serve HTTPS with certificates of a CA
        made for this testbed (the ranks get it in DOSA_CONTROL_CA).

        ``mtu``: of every link, at most ``config.MAX_MTU`` (the largest frame native XDP takes on
        a veth without multi-buffer); default ``config.DEFAULT_MTU``. ``dpu_workers``: worker
        processes per DPU (``dosa dpu run --workers``), pinned to the DPUs' cores with ``cpu_split``."""
        ns.require_root("dosa testbed up")
        mtu = config.DEFAULT_MTU if mtu is None else mtu
        if not isinstance(mtu, int) or not config.MIN_MTU <= mtu <= config.MAX_MTU:
            raise DosaError(f"--mtu {mtu!r} outside {config.MIN_MTU}..{config.MAX_MTU} (the largest "
                            "frame native XDP takes on a veth without multi-buffer)")
        layout = Layout(self.prefix, hosts, dpus, self.subnet)
        shaping = Shaping.parse(link_rate, delay, loss, dup, reorder)
        if mode not in DPU_MODES:
            raise DosaError(f"--mode must be one of {', '.join(DPU_MODES)}, not {mode!r}")
        host_cpus, dpu_cpus = split_cpus() if cpu_split else (None, None)
        found = self.existing_namespaces()
        if found or self.state_path.exists():
            what = ", ".join(found[:4]) + (" ..." if len(found) > 4 else "") if found \
                else f"state file {self.state_path}"
            raise DosaError(f"testbed {self.prefix!r} is already up ({what}); run "
                            f"`dosa testbed down{self._prefix_flag()}` first")
        st = {"prefix": self.prefix, "subnet": self.subnet, "hosts": hosts, "dpus": dpus,
              "shaping": shaping.to_json(), "shape_dpus": shape_dpus, "cpu_split": cpu_split,
              "host_cpus": host_cpus, "dpu_cpus": dpu_cpus, "mode": mode, "services": services, "tls": tls,
              "data_port": data_port, "control_port": control_port, "mtu": mtu,
              "dpu_workers": dpu_workers,
              "nodes": [n.__dict__ for n in layout.nodes], "fabric_ns": layout.fabric_ns,
              "bridge": BRIDGE, "processes": [], "status": "building", "next_job_id": 1,
              "created_at": time.time(), "created_by_pid": os.getpid(),
              "run_dir": str(self.run_dir), "pin_dir": str(self.pin_dir)}
        try:
            state.save(self.state_path, st)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            credentials.make_secret(self.cred_dir)
            if tls:
                credentials.make_tls(self.cred_dir, {n.name: n.address for n in layout.dpu_nodes})
            # userspace shards share the DPU's port by a reuseport group that steers a datagram by
            # its first packet: the hosts' GSO datagrams must reach the DPU as packets (a real NIC
            # sends packets; a veth hands the datagram over whole)
            self._build(layout, shaping, shape_dpus, mtu,
                        segment_to_dpus=mode == DpuMode.USERSPACE and dpu_workers > 1)
            st["status"] = "up" if not services else "starting"
            state.save(self.state_path, st)
            if services and dpus:
                self._start_services(layout, st, ready_timeout)
            if cpu_split and dpus and services and mode == DpuMode.XDP:
                # after the services: a veth has NAPI (and so a thread) only once XDP is attached
                st["dpu_napi_threads"] = self._dpu_receive_on_dpu_cores(layout, dpu_cpus)
            st["status"] = "up"
            state.save(self.state_path, st)
        except BaseException:
            try:
                self.down()
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
        return self.status()

    def _prefix_flag(self) -> str:
        return "" if self.prefix == config.DEFAULT_PREFIX else f" --prefix {self.prefix}"

    def _build(self, layout: Layout, shaping: Shaping, shape_dpus: bool,
               mtu: int = config.DEFAULT_MTU, segment_to_dpus: bool = False) -> None:
        with Netlink() as nl:
            self._build_links(nl, layout, shaping, shape_dpus, mtu, segment_to_dpus)

    def _build_links(self, nl: Netlink, layout: Layout, shaping: Shaping, shape_dpus: bool, mtu: int,
                     segment_to_dpus: bool = False) -> None:
        fab = layout.fabric_ns
        nl.netns_add(fab)
        nl.link_set(fab, "lo", up=True)
        if shaping.netem_args():
            impair.require_netem(fab)
        impair_obj = impair.build(shaping, self.run_dir) if shaping.needs_bpf_object else None
        # no STP (ports forward at once), no multicast snooping (multicast is flooded to all ports,
        # so a group works without IGMP queriers), no IPv6 link-local chatter in captures
        nl.bridge_add(fab, BRIDGE, BRIDGE_MAC)
        # a switch forwards frames; it does not run the IP firewall on them: the kernel's bridge
        # netfilter (built in here) would send every bridged frame through the iptables hooks of
        # the fabric namespace, an allocation and a hook walk per packet on the sender's core
        ns.sh(["ip", "netns", "exec", fab, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0",
               "net.bridge.bridge-nf-call-ip6tables=0", "net.bridge.bridge-nf-call-arptables=0"],
              check=False)
        nl.link_set(fab, BRIDGE, addrgenmode_none=True)
        nl.link_set(fab, BRIDGE, up=True)
        for n in self._track(layout.nodes, "testbed up: nodes", "node"):
            nl.netns_add(n.namespace)
            nl.link_set(n.namespace, "lo", up=True)
            nl.veth_add(fab, n.fabric_port, n.fabric_mac, NODE_IFACE, n.mac, n.namespace)
            nl.link_set(fab, n.fabric_port, addrgenmode_none=True, mtu=mtu)
            nl.link_set(fab, n.fabric_port, master=BRIDGE, up=True)
            nl.link_set(n.namespace, NODE_IFACE, addrgenmode_none=True, mtu=mtu)
            nl.addr_add(n.namespace, NODE_IFACE, f"{n.address}/{layout.prefixlen}")
            nl.link_set(n.namespace, NODE_IFACE, up=True)
            nl.route_add(n.namespace, config.MULTICAST_NET, NODE_IFACE)
            if shaping.needs_bpf_object:  # impair/reorder per packet, not per GSO datagram
                impair.segment_at_node(n.namespace, NODE_IFACE)
            if n.role == "dpu" and segment_to_dpus:
                impair.segment_at_node(fab, n.fabric_port)  # the bridge's port towards the DPU
            if n.role == "dpu":
                # XDP_TX/REDIRECT out of the DPU's eth0 lands on this veth end, which must run NAPI
                # to receive it: GRO on gives it NAPI (docs: PLATFORM.md)
                ns.sh(["ip", "netns", "exec", fab, "ethtool", "-K", n.fabric_port, "gro", "on"],
                      what=f"enabling GRO on {n.fabric_port}")
            if shaping.active and (n.role == "host" or shape_dpus):
                impair.apply_qdiscs(n.namespace, NODE_IFACE, shaping, impair_obj)
                impair.apply_qdiscs(fab, n.fabric_port, shaping, impair_obj)
                if shaping.needs_impair:
                    impair.attach(fab, n.fabric_port, impair_obj)
            elif n.role == "dpu":
                # a queue instead of veth's noqueue on the bridge's port towards the DPU: a burst
                # bigger than the DPU's 256-slot XDP ring then waits (backpressure) instead of being
                # dropped (measured: thousands of retransmissions a 25M-entry round without it)
                nl.qdisc_pfifo(fab, n.fabric_port, 100000)

    @staticmethod
    def _dpu_receive_on_dpu_cores(layout: Layout, dpu_cpus) -> list[int]:
        """Run each DPU's receive (its XDP merge) on the DPU cores, as on a real DPU.

        On a veth the XDP program runs in the NAPI poll of the receiving end, which the kernel
        schedules on the CPU that sent the packet: with ``cpu_split`` the host core would pay for
        the DPU's merge. Threaded NAPI on each DPU's eth0 moves that poll to a kernel thread, pinned
        here to the DPU cores. Returns the pinned thread ids ([] where the kernel refuses, or where
        no XDP program is attached: userspace mode, ``services=False``)."""
        before = ns.napi_threads()
        for n in layout.dpu_nodes:
            # `ip netns exec` mounts the namespace's own /sys, where its eth0 is
            subprocess.run(["ip", "netns", "exec", n.namespace, "sh", "-c",
                            f"echo 1 > /sys/class/net/{NODE_IFACE}/threaded"], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 2.0
        new: list[int] = []
        while time.monotonic() < deadline and len(new) < len(layout.dpu_nodes):
            new = [pid for pid, comm in ns.napi_threads().items()
                   if pid not in before and NODE_IFACE in comm]
            time.sleep(0.02)
        for pid in new:
            try:
                os.sched_setaffinity(pid, dpu_cpus)
            except OSError:
                pass
        return new

    def _start_services(self, layout: Layout, st: dict, ready_timeout: float) -> None:
        host_addrs = tuple(n.address for n in layout.host_nodes)
        per_dpu: list[tuple[Node, list[ServiceSpec]]] = []
        for n in layout.dpu_nodes:
            ctx = DpuContext(index=n.index, iface=NODE_IFACE, address=n.address,
                             host_addrs=host_addrs, mode=st["mode"],
                             pin_dir=str(self.pin_dir / n.name), run_dir=str(self.run_dir),
                             data_port=st["data_port"], control_port=st["control_port"],
                             secret_file=self._cred(credentials.DPU_SECRET),
                             workers=st.get("dpu_workers", 1), cpus=st["dpu_cpus"],
                             tls_cert=self._cred(credentials.cert_files(n.name)[0]),
                             tls_key=self._cred(credentials.cert_files(n.name)[1]),
                             ca_file=self._cred(credentials.CA_CERT))
            per_dpu.append((n, list(self.services(ctx))))
        depth = max((len(s) for _, s in per_dpu), default=0)
        # the k-th service of every DPU, then wait for all of them
        for k in self._track(range(depth), "testbed up: DPU services", "service"):
            started = []
            for n, specs in per_dpu:
                if k < len(specs):
                    started.append(supervise.spawn(n, specs[k], st, self.run_dir))
            state.save(self.state_path, st)
            supervise.wait_ready(started, ready_timeout)

    def _track(self, items, desc: str, unit: str):
        """``items``, with a bar (terminal) or lines (log) when ``self.progress`` is set."""
        if not self.progress:
            return items
        from dosa.progress import track

        return track(items, desc, unit=unit)

    # ------------------------------------------------------------------ down
    def down(self) -> dict:
        """Remove everything of this testbed; idempotent. Returns what was removed."""
        ns.require_root("dosa testbed down")
        st = self.load_state() or {}
        names = set(self.existing_namespaces())
        names |= {n for n in [*(x.get("namespace") for x in st.get("nodes", [])), st.get("fabric_ns")]
                  if n and ns.netns_exists(n)}
        victims = {(r["pid"], r.get("start_time")) for r in st.get("processes", [])
                   if isinstance(r.get("pid"), int)}
        for n in names:
            victims |= {(p, ns.proc_start_time(p)) for p in ns.netns_pids(n)}
        victims = {(p, t) for p, t in victims if p != os.getpid()}
        ns.kill_all(sorted(victims))
        # hosts and DPUs first, the fabric last (deleting a node's namespace deletes its veth pair)
        for n in sorted(names, key=lambda x: x.endswith("-fab")):
            for p in ns.netns_pids(n):  # anything that slipped in since
                ns.kill_all([(p, ns.proc_start_time(p))], grace=0.5)
            netns_del(n)
        left = [n for n in names if ns.netns_exists(n)]
        if left:
            raise DosaError(f"could not delete namespace(s) {', '.join(sorted(left))}")
        pins = self.pin_dir.exists()
        if pins:
            shutil.rmtree(self.pin_dir, ignore_errors=True)
            try:
                self.pin_dir.parent.rmdir()  # /sys/fs/bpf/dosa, only when nothing else is in it
            except OSError:
                pass
        shutil.rmtree(self.run_dir, ignore_errors=True)
        # the control plane's records of this testbed's dataplane instances (control.controller
        # names them after the pin directory: /run/dosa/sys_fs_bpf_dosa_tb-<prefix>_<dpu>.json)
        tag = str(self.pin_dir).strip("/").replace("/", "_")
        for f in Path(config.STATE_DIR).glob(f"{tag}_*"):
            if f.suffix in (".json", ".lock"):
                f.unlink(missing_ok=True)
        had_state = state.remove(self.state_path)
        return {"prefix": self.prefix, "namespaces": sorted(names), "processes": len(victims),
                "pin_dir_removed": pins, "state_file_removed": had_state}

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        """What is live: namespaces, interfaces, addresses, qdiscs, XDP, processes."""
        st = self.load_state()
        live = self.existing_namespaces()
        out = {"prefix": self.prefix, "state_file": str(self.state_path), "up": False,
               "status": st.get("status") if st else None, "namespaces": live}
        if not st:
            out["stale_namespaces"] = live  # namespaces without a state file: run `down`
            return out
        nodes = []
        nl = Netlink()  # one netlink socket per namespace for every read below
        for n in st["nodes"]:
            exists = ns.netns_exists(n["namespace"])
            nodes.append({"name": f"{n['role'][0]}{n['index']}", "role": n["role"], "index": n["index"],
                          "namespace": n["namespace"], "exists": exists, "address": n["address"],
                          "cpus": st["host_cpus"] if n["role"] == "host" else st["dpu_cpus"],
                          "interfaces": nl.interfaces(n["namespace"]) if exists else []})
        fab = st["fabric_ns"]
        fab_exists = ns.netns_exists(fab)
        procs = [{**{k: r[k] for k in ("name", "node", "namespace", "pid", "argv", "log")},
                  "alive": ns.alive(r["pid"], r.get("start_time")),
                  "restarts": r.get("restarts", 0)} for r in st["processes"]]
        cfg = {k: st[k] for k in ("hosts", "dpus", "subnet", "shaping", "shape_dpus", "cpu_split",
                                  "host_cpus", "dpu_cpus", "mode", "services", "data_port",
                                  "control_port")}
        cfg["mtu"] = st.get("mtu")
        cfg["tls"] = st.get("tls", False)
        out.update({
            "up": st.get("status") == "up" and fab_exists and all(x["exists"] for x in nodes),
            "config": cfg, "nodes": nodes,
            "fabric": {"namespace": fab, "exists": fab_exists, "bridge": st["bridge"],
                       "interfaces": nl.interfaces(fab) if fab_exists else []},
            "processes": procs,
            "dpu_napi_threads": st.get("dpu_napi_threads", []),
            "stale_namespaces": sorted(set(live) - {x["namespace"] for x in nodes} - {fab}),
            "env": self.job_env(0, st) if st.get("status") == "up" else None,
        })
        nl.close()
        return out

    # ------------------------------------------------------------------ jobs
    def job_env(self, rank: int, st: dict | None = None, job_id: int | None = None,
                master_port: int = config.DEFAULT_MASTER_PORT, ranks_per_node: int = 1) -> dict:
        """The environment rank ``rank`` runs with (torchrun's variables + dosa's); see
        docs/testbed.md. With ``ranks_per_node`` L > 1, host namespace i is a node holding ranks
        i*L .. i*L+L-1 (torchrun's numbering): they share its address and link, and LOCAL_RANK,
        LOCAL_WORLD_SIZE and GROUP_RANK say so."""
        st = st or self._require_state()
        lay = self.layout(st)
        hosts, dpus = lay.host_nodes, lay.dpu_nodes
        per = check_ranks_per_node(ranks_per_node)
        world = len(hosts) * per
        if not 0 <= rank < world:
            raise DosaError(f"rank {rank} is outside 0..{world - 1}")
        node = hosts[rank // per]
        dosa_env = RankEnv(rank=rank, world_size=world, host_addr=node.address, iface=NODE_IFACE,
                           job_id=job_id if job_id is not None else st.get("next_job_id", 1),
                           port=st["data_port"], dpu_addrs=[d.address for d in dpus],
                           control=(dpus[0].address, st["control_port"]) if dpus else None,
                           secret_file=self._cred(credentials.HOST_SECRET))
        env = {"LOCAL_RANK": rank % per, "LOCAL_WORLD_SIZE": per, "GROUP_RANK": node.index,
               "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world, "MASTER_ADDR": hosts[0].address,
               "MASTER_PORT": master_port, "DOSA_TESTBED": self.prefix, **dosa_env.to_env(),
               # set even when empty: a CA of the caller's own environment must not leak in
               "DOSA_CONTROL_CA": self._cred(credentials.CA_CERT) or ""}
        return {k: str(v) for k, v in env.items()}

    def run(self, argv: list[str], timeout: float | None = None, env: dict | None = None,
            log_dir: str | os.PathLike | None = None, echo=True,
            master_port: int = config.DEFAULT_MASTER_PORT, torchrun: bool = False,
            ranks_per_node: int = 1) -> RunResult:
        """Run ``argv`` in every host namespace concurrently (rank i in ``<prefix>-h<i>``); see
        testbed.runner. ``env`` adds to every rank's environment. ``torchrun``: start one real
        torchrun agent per host instead (c10d rendezvous at the first host's ``master_port``;
        ``argv`` is then ``SCRIPT ARGS``), which sets the torch variables itself.
        ``ranks_per_node`` L: every host namespace is a node running L ranks (a GPU machine's
        local ranks), which share its address and its link; a run reserves L job ids, J..J+L-1
        (DOSA_JOB_ID is J), for the node-aware hook's slice jobs (docs/training.md)."""
        per = check_ranks_per_node(ranks_per_node)
        st = self._require_state()
        job_id = int(st.get("next_job_id", 1))
        st["next_job_id"] = (job_id + per - 1) % (2**32 - 1) + 1
        state.save(self.state_path, st)
        lay = self.layout(st)
        if log_dir is None:
            log_dir = Path(tempfile.gettempdir()) / "dosa-runs" / \
                f"{self.prefix}-job{job_id}-{time.strftime('%Y%m%d-%H%M%S')}"
        n_cpus = len(st["host_cpus"] or os.sched_getaffinity(0))
        specs = []
        for node in lay.host_nodes:
            for local in range(1 if torchrun else per):
                rank = node.index * per + local
                e = self.job_env(rank, st, job_id, master_port, per)
                # torchrun sets OMP_NUM_THREADS=1 when it starts several processes per machine;
                # here all ranks share this machine's CPUs, so the same reasoning applies
                if "OMP_NUM_THREADS" not in os.environ:
                    e["OMP_NUM_THREADS"] = str(max(1, n_cpus // (len(lay.host_nodes) * per)))
                # Gloo/TensorPipe pick their interface from the hostname, which in a namespace
                # resolves to loopback: point them at the fabric interface
                for var in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
                    if var not in os.environ:
                        e[var] = NODE_IFACE
                e.update({k: str(v) for k, v in (env or {}).items()})
                own = None
                if torchrun:
                    own = torchrun_argv(list(argv), nnodes=len(lay.host_nodes), rdzv_id=job_id,
                                        rdzv_endpoint=f"{lay.host_nodes[0].address}:{master_port}",
                                        local_addr=node.address, is_host=node.index == 0,
                                        nproc_per_node=per)
                    rank = node.index  # one agent per node; its workers are numbered by torchrun
                specs.append(RankSpec(rank, node.namespace, e, st["host_cpus"], own))
        return run_ranks(specs, list(argv), Path(log_dir), timeout=timeout, echo=echo)

    def capture(self, out: str | os.PathLike, argv: list[str], timeout: float | None = None,
                bpf_filter: list[str] | None = None, **run_kw) -> tuple[CaptureStats, RunResult]:
        """Run ``argv`` like ``run`` while tcpdump records the fabric bridge into ``out``."""
        st = self._require_state()
        nodes = [(n["namespace"], NODE_IFACE) for n in st["nodes"]]
        with WireFrames(nodes), Tcpdump(st["fabric_ns"], out, bpf_filter) as td:
            try:
                result = self.run(argv, timeout=timeout, **run_kw)
            finally:
                stats = td.stop()
        return stats, result

    def exec_in(self, node: str, argv: list[str], *, check: bool = False, timeout: float | None = None,
                capture: bool = True, input: str | None = None, cpus=None,
                env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``h0``/``d0``/``fab`` (or a full namespace name) and wait."""
        argv = ns.netns_cmd(self.namespace(node), list(argv), cpus)
        return subprocess.run(argv, check=check, timeout=timeout, capture_output=capture, text=True,
                              input=input, env={**os.environ, **(env or {})})

    def popen_in(self, node: str, argv: list[str], cpus=None, **popen_kw) -> subprocess.Popen:
        """Start ``argv`` inside a node without waiting (the caller owns the process)."""
        return subprocess.Popen(ns.netns_cmd(self.namespace(node), list(argv), cpus), **popen_kw)


def split_cpus() -> tuple[list[int], list[int]]:
    """Disjoint CPU sets for hosts (first half) and DPUs (second half) of the CPUs we may use."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise DosaError(f"--cpu-split needs at least 2 CPUs, this process may use {len(cpus)}")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]
