"""Compile and attach testbed/impair.c (random loss / duplication, the reorder classifier),
install a link's egress qdiscs, and probe for netem.

The object is compiled once per ``up`` with the probabilities as constants (clang, ~0.2 s) and
loaded by ``tc`` itself; the kernel keeps the program alive as long as the filter exists, and the
filter dies with the namespace, so ``down`` has nothing extra to remove.
"""
from __future__ import annotations

import platform
from pathlib import Path

from dosa.errors import DosaError

from testbed import ns
from testbed.shaping import Shaping

SOURCE = Path(__file__).with_name("impair.c")


def build(shaping: Shaping, out_dir: Path) -> Path:
    out = out_dir / "impair.o"
    out_dir.mkdir(parents=True, exist_ok=True)
    defines = [f"-D{k}={v}" for k, v in shaping.impair_defines().items()]
    ns.sh(["clang", "-O2", "-target", "bpf", f"-I/usr/include/{platform.machine()}-linux-gnu",
           *defines, "-c", str(SOURCE), "-o", str(out)], what="compiling testbed/impair.c")
    return out


def attach(namespace: str, dev: str, obj: Path) -> None:
    """Both directions of the link through bridge port ``dev``: ingress = from the node,
    egress = towards the node."""
    ns.tc("qdisc", "add", "dev", dev, "clsact", ns=namespace)
    ns.tc("filter", "add", "dev", dev, "ingress", "bpf", "da", "obj", str(obj), "sec", "tc_in",
          ns=namespace)
    ns.tc("filter", "add", "dev", dev, "egress", "bpf", "da", "obj", str(obj), "sec", "tc_out",
          ns=namespace)


def segment_at_node(namespace: str, dev: str) -> None:
    """Make interface ``dev`` (a node's, or the bridge's port towards a node) cut UDP GSO
    datagrams into their packets itself (software GSO, ``tx-udp-segmentation off``), so that the
    link's impairment sees every packet, and a userspace DPU's sharded sockets receive packets
    (the kernel steers a datagram by its first packet).

    A veth hands a GSO datagram (up to 64 packets, dosa.transport) to its peer whole when it
    can; the bridge port's tc programs would then drop, duplicate or delay all its packets at once.
    With segmentation at the node the fabric carries only the packets themselves, as a real NIC
    puts them on the wire. The node's own egress qdisc still sees the whole datagram: tbf counts
    its bytes exactly (per-segment headers included); the reorder classifier there holds or passes
    it whole."""
    ns.sh(["ip", "netns", "exec", namespace, "ethtool", "-K", dev, "tx-udp-segmentation", "off"],
          what=f"turning off UDP segmentation offload on {dev} in {namespace}")


def apply_qdiscs(namespace: str, dev: str, shaping: Shaping, obj: Path | None = None) -> None:
    """Install ``shaping``'s egress qdiscs on ``dev`` (tbf, netem, or the HTB reordering layout with
    its classifier from ``obj``, which ``build(shaping, ...)`` made). Remove them with
    ``tc qdisc del dev DEV root``."""
    for cmd in shaping.qdisc_commands(dev):
        ns.tc(*cmd, ns=namespace)
    if shaping.uses_htb_reorder:
        if obj is None:
            raise DosaError("reordering needs the compiled testbed/impair.c (impair.build)")
        ns.tc(*shaping.reorder_filter_command(dev, str(obj)), ns=namespace)


def require_netem(namespace: str) -> None:
    """Raise a clear error when the kernel has no netem qdisc (probed on the namespace's lo)."""
    p = ns.sh(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem"], check=False)
    if p.returncode != 0:
        raise DosaError("--delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this "
                        "kernel does not have (nor fq or etf, the other qdiscs that can hold a "
                        "packet for a time); --reorder, --link-rate, --loss and --dup work "
                        "without it")
    ns.sh(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False)
