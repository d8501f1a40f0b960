"""The testbed's topology steps over netlink (pyroute2), in this process: namespaces, links,
addresses, routes and the pfifo qdisc, without starting an ``ip``/``tc`` process per step.

Each step prints its iproute2 equivalent with ``DOSA_TESTBED_TRACE=1``, so a person can still replay
a build by hand. What pyroute2 does not serve stays with the tools (ns.ip / ns.tc): the shaping
qdiscs and the BPF filters loaded from an object file (docs/testbed.md, *How the steps run*).

    with Netlink() as nl:                    # one netlink socket per namespace, closed on exit
        nl.netns_add("t-h0")
        nl.link_set("t-h0", "lo", up=True)
"""
from __future__ import annotations

import errno
import os
import socket

from pyroute2 import NetNS, netns
from pyroute2.netlink.exceptions import NetlinkError

from dosa.errors import DosaError

from . import ns as _ns

IFF_UP = 0x1

def _trace(cmd: str) -> None:
    if _ns.TRACE:
        import sys

        print("+ " + cmd, file=sys.stderr)


def _fail(cmd: str, e: Exception) -> DosaError:
    code = getattr(e, "code", None) or getattr(e, "errno", None)
    why = os.strerror(code) if isinstance(code, int) and code > 0 else str(e)
    return DosaError(f"{cmd} failed: {why}")


def netns_del(name: str) -> bool:
    """``ip netns del NAME``; False when it was not there (or could not be removed)."""
    _trace(f"ip netns del {name}")
    try:
        netns.remove(name)
        return True
    except OSError:
        return False


class Netlink:
    """Netlink sockets into the testbed's namespaces (opened on first use, one each)."""

    def __init__(self):
        self._socks: dict[str, NetNS] = {}

    def __enter__(self) -> "Netlink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks = {}

    def _in(self, name: str) -> NetNS:
        if name not in self._socks:
            self._socks[name] = NetNS(name)
        return self._socks[name]

    def _index(self, name: str, dev: str, cmd: str) -> int:
        found = self._in(name).link_lookup(ifname=dev)
        if not found:
            raise DosaError(f"{cmd} failed: no device {dev} in namespace {name}")
        return found[0]

    def _do(self, cmd: str, fn) -> None:
        _trace(cmd)
        try:
            fn()
        except (NetlinkError, OSError) as e:
            raise _fail(cmd, e) from None

    # ------------------------------------------------------------------------------------- steps
    def netns_add(self, name: str) -> None:
        cmd = f"ip netns add {name}"
        _trace(cmd)
        try:
            netns.create(name)
        except OSError as e:
            raise _fail(cmd, e) from None
        if not os.path.exists(os.path.join(_ns.NETNS_DIR, name)):
            raise DosaError(f"{cmd} failed: {os.strerror(errno.ENOENT)}")

    def bridge_add(self, name: str, dev: str, mac: str) -> None:
        """A bridge without STP (ports forward at once) and without multicast snooping (groups are
        flooded to every port, so they work without an IGMP querier)."""
        self._do(f"ip -n {name} link add {dev} address {mac} type bridge stp_state 0 forward_delay 0 "
                 "mcast_snooping 0",
                 lambda: self._in(name).link("add", ifname=dev, kind="bridge", address=mac, br_stp_state=0,
                                             br_forward_delay=0, br_mcast_snooping=0))

    def veth_add(self, name: str, dev: str, mac: str, peer: str, peer_mac: str, peer_ns: str) -> None:
        """A veth pair: ``dev`` in ``name``, its ``peer`` created straight in ``peer_ns``."""
        self._do(f"ip -n {name} link add {dev} address {mac} type veth peer name {peer} address "
                 f"{peer_mac} netns {peer_ns}",
                 lambda: self._in(name).link("add", ifname=dev, address=mac, kind="veth",
                                             peer={"ifname": peer, "address": peer_mac,
                                                   "net_ns_fd": peer_ns}))

    def link_set(self, name: str, dev: str, *, addrgenmode_none: bool = False, mtu: int | None = None,
                 master: str | None = None, up: bool = False) -> None:
        """``ip -n NAME link set DEV [addrgenmode none] [mtu N] [master BR] [up]`` (no IPv6
        link-local address: no chatter in captures)."""
        words = (["addrgenmode", "none"] if addrgenmode_none else []) + \
            (["mtu", str(mtu)] if mtu is not None else []) + (["master", master] if master else []) + \
            (["up"] if up else [])
        cmd = f"ip -n {name} link set {dev} " + " ".join(words)

        def run():
            s = self._in(name)
            idx = self._index(name, dev, cmd)
            kw = {}
            if addrgenmode_none:
                kw["IFLA_AF_SPEC"] = {"attrs": [["AF_INET6", {"attrs": [["IFLA_INET6_ADDR_GEN_MODE", 1]]}]]}
            if mtu is not None:
                kw["mtu"] = int(mtu)
            if master:
                kw["master"] = self._index(name, master, cmd)
            if kw:
                s.link("set", index=idx, **kw)
            if up:
                s.link("set", index=idx, state="up")
        self._do(cmd, run)

    def addr_add(self, name: str, dev: str, cidr: str) -> None:
        address, _, plen = cidr.partition("/")
        cmd = f"ip -n {name} addr add {cidr} dev {dev}"
        self._do(cmd, lambda: self._in(name).addr("add", index=self._index(name, dev, cmd), address=address,
                                                  prefixlen=int(plen or 32)))

    def route_add(self, name: str, dst: str, dev: str) -> None:
        cmd = f"ip -n {name} route add {dst} dev {dev}"
        self._do(cmd, lambda: self._in(name).route("add", dst=dst, oif=self._index(name, dev, cmd)))

    def qdisc_pfifo(self, name: str, dev: str, limit: int) -> None:
        """``tc -n NAME qdisc replace dev DEV root pfifo limit N``."""
        cmd = f"tc -n {name} qdisc replace dev {dev} root pfifo limit {limit}"
        self._do(cmd, lambda: self._in(name).tc("replace", "pfifo", self._index(name, dev, cmd), limit=int(limit)))

    # ------------------------------------------------------------------------------------- reads
    def interfaces(self, name: str) -> list[dict]:
        """``ip -d addr show`` + ``tc qdisc show`` of namespace ``name`` as testbed.status() reports
        them: every link but lo with its MAC, MTU, up flag, bridge master, IPv4 addresses, XDP
        program and qdisc kinds (one netlink dump each instead of two processes)."""
        _trace(f"ip -n {name} -d addr show; tc -n {name} qdisc show")
        try:
            s = self._in(name)
            links = list(s.get_links())
            addrs = list(s.get_addr(family=socket.AF_INET))
            qdiscs = list(s.get_qdiscs())
        except (NetlinkError, OSError) as e:
            raise _fail(f"ip -n {name} addr show", e) from None
        names = {m["index"]: m.get_attr("IFLA_IFNAME") for m in links}
        inet: dict[int, list[str]] = {}
        for a in addrs:
            inet.setdefault(a["index"], []).append(f"{a.get_attr('IFA_LOCAL') or a.get_attr('IFA_ADDRESS')}"
                                                   f"/{a['prefixlen']}")
        kinds: dict[int, list[str]] = {}
        for q in qdiscs:
            kinds.setdefault(q["index"], []).append(q.get_attr("TCA_KIND"))
        out = []
        for m in links:
            dev = m.get_attr("IFLA_IFNAME")
            if dev == "lo":
                continue
            xdp = m.get_attr("IFLA_XDP")
            prog = xdp.get_attr("IFLA_XDP_PROG_ID") if xdp is not None else None
            master = m.get_attr("IFLA_MASTER")
            out.append({"name": dev, "mac": m.get_attr("IFLA_ADDRESS"), "mtu": m.get_attr("IFLA_MTU"),
                        "up": bool(m["flags"] & IFF_UP), "master": names.get(master) if master else None,
                        "addresses": inet.get(m["index"], []), "xdp": bool(prog), "xdp_prog": prog or None,
                        "qdiscs": kinds.get(m["index"], [])})
        return out
