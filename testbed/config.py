"""Names, addresses and limits of a namespace testbed: everything derived from (prefix, subnet, N, M)
lives here so the builder, ``down`` (which must work from namespace names alone) and ``status`` agree.

A testbed is identified by its *prefix*: namespaces are ``<prefix>-h<i>``, ``<prefix>-d<j>`` and
``<prefix>-fab``; its state file, run directory and BPF pin directory carry the prefix too, so two
testbeds with different prefixes (a user's and the test suite's) never touch each other.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dosa import wire
from dosa.errors import DosaError

#: the checkout the testbed runs (services and ranks start with their working directory here)
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PREFIX = "dosa"
DEFAULT_SUBNET = "10.77.0.0/24"
#: Environment variables that override the defaults (tests set DOSA_TESTBED_PREFIX).
ENV_PREFIX = "DOSA_TESTBED_PREFIX"
ENV_SUBNET = "DOSA_TESTBED_SUBNET"
ENV_STATE_DIR = "DOSA_TESTBED_STATE_DIR"
ENV_SERVICES = "DOSA_TESTBED_SERVICES"  # module:function replacing testbed.services.dpu_services

STATE_DIR = "/run/dosa"
BPF_ROOT = "/sys/fs/bpf"
BRIDGE = "br0"
NODE_IFACE = "eth0"  # the one interface inside each host / DPU namespace
MULTICAST_NET = "224.0.0.0/4"

#: Host i gets subnet[HOST_BASE + i], DPU j gets subnet[DPU_BASE + j].
HOST_BASE = 10
DPU_BASE = 200
MAX_HOSTS = wire.MAX_WORKERS  # a host is a worker of the job: worker_id < MAX_WORKERS
MAX_DPUS = 50
DEFAULT_MASTER_PORT = 29500  # torchrun's default
#: Ranks one host namespace may run as a node (``run(ranks_per_node=)``): a GPU machine has up to
#: 8-16; the bound only keeps a typo from starting thousands of processes.
MAX_RANKS_PER_NODE = 64
#: Link MTU (``up(mtu=)``, ``dosa testbed up --mtu``): by default the largest that works on the
#: testbed's path, wire.MAX_MTU (native XDP on a veth takes frames up to about one page without
#: multi-buffer; jobs on the testbed get the same MTU, so dosa's packets are as large as the links).
DEFAULT_MTU = wire.MAX_MTU
MIN_MTU = wire.MIN_MTU
MAX_MTU = wire.MAX_MTU

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix or ""):
        raise DosaError(f"testbed prefix {prefix!r} must be 1-8 lowercase letters/digits starting "
                        "with a letter")
    return prefix


def check_ranks_per_node(n) -> int:
    """``ranks_per_node`` as an int in 1..MAX_RANKS_PER_NODE, or a DosaError sentence."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_RANKS_PER_NODE:
        raise DosaError(f"ranks per node must be an integer in 1..{MAX_RANKS_PER_NODE}, not {n!r}")
    return n


def default_prefix() -> str:
    return check_prefix(os.environ.get(ENV_PREFIX, DEFAULT_PREFIX))


def ns_regex(prefix: str) -> re.Pattern:
    """Matches exactly the namespaces a testbed with this prefix creates (used by ``down``)."""
    return re.compile(rf"^{re.escape(prefix)}-(h\d+|d\d+|fab)$")


@dataclass(frozen=True)
class Node:
    role: str  # "host" | "dpu"
    index: int
    namespace: str
    address: str  # IPv4 without prefix length
    mac: str
    fabric_port: str  # the veth end on the bridge, inside the fabric namespace
    fabric_mac: str

    @property
    def name(self) -> str:
        return f"{self.role[0]}{self.index}"  # h0, d1


@dataclass(frozen=True)
class Layout:
    """Names and addresses of a testbed of ``hosts`` hosts and ``dpus`` DPUs."""

    prefix: str
    hosts: int
    dpus: int
    subnet: str = DEFAULT_SUBNET
    nodes: tuple[Node, ...] = field(init=False)

    def __post_init__(self):
        check_prefix(self.prefix)
        check_count("--hosts", self.hosts, 1, MAX_HOSTS)
        check_count("--dpus", self.dpus, 0, MAX_DPUS)
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as e:
            raise DosaError(f"testbed subnet {self.subnet!r} is not an IPv4 network ({e})") from None
        if net.prefixlen > 24:
            raise DosaError(f"testbed subnet {self.subnet} is too small; use a /24 or larger")
        nodes = []
        for role, count, base, tag in (("host", self.hosts, HOST_BASE, 1), ("dpu", self.dpus, DPU_BASE, 2)):
            for i in range(count):
                nodes.append(Node(
                    role=role, index=i, namespace=f"{self.prefix}-{role[0]}{i}",
                    address=str(net[base + i]),
                    mac=f"02:d0:5a:{tag:02x}:00:{i:02x}",
                    fabric_port=f"{role[0]}{i}", fabric_mac=f"02:d0:5a:{tag | 0x80:02x}:00:{i:02x}"))
        object.__setattr__(self, "nodes", tuple(nodes))

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen

    @property
    def fabric_ns(self) -> str:
        return fabric_ns(self.prefix)

    @property
    def host_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "host"]

    @property
    def dpu_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "dpu"]

    def node(self, name: str) -> Node:
        """Look a node up by short name (``h0``) or namespace (``dosa-h0``)."""
        for n in self.nodes:
            if name in (n.name, n.namespace):
                return n
        raise DosaError(f"testbed {self.prefix!r} has no node {name!r}")


def fabric_ns(prefix: str) -> str:
    return f"{prefix}-fab"


def check_count(flag: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise DosaError(f"{flag} must be an integer from {lo} to {hi}, not {value!r}")
    return value


def state_dir() -> Path:
    return Path(os.environ.get(ENV_STATE_DIR, STATE_DIR))


def state_file(prefix: str, directory: Path | None = None) -> Path:
    """``/run/dosa/testbed.json`` for the default prefix, ``testbed-<prefix>.json`` otherwise."""
    d = directory or state_dir()
    return d / ("testbed.json" if prefix == DEFAULT_PREFIX else f"testbed-{prefix}.json")


def run_dir(prefix: str, directory: Path | None = None) -> Path:
    """Per-testbed runtime directory (pid files, service logs); removed by ``down``."""
    return (directory or state_dir()) / prefix


PIN_ROOT = f"{BPF_ROOT}/dosa"  # the dataplane loader's root (dataplane/loader.py)


def pin_dir(prefix: str) -> Path:
    """Where this testbed's DPUs pin their BPF programs and maps (``<dir>/<dpu>``); removed by
    ``down``. Under the dataplane's root but in a directory of its own: removing it never touches
    another testbed's or a standalone ``dosa ctl`` instance."""
    return Path(PIN_ROOT) / f"tb-{prefix}"
