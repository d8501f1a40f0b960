"""The testbed's topology: reachability (ICMP, UDP, multicast) across the fabric, status, shaping."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.timeout(90)]

# UDP receiver: binds PORT (joins GROUP when given), prints "ready", counts datagrams until IDLE
# seconds pass without one, prints the count and the distinct payloads.
RECV = r"""
import socket, struct, sys
group, port, idle = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE
s.bind(("0.0.0.0", port))
if group:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                 struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton("0.0.0.0")))
print("ready", flush=True)
s.settimeout(10)  # the first datagram may take a while (sender start-up)
n, seen = 0, set()
try:
    while True:
        data = s.recv(2048)
        n += 1
        seen.add(data)
        s.settimeout(idle)
except socket.timeout:
    pass
print(n, len(seen), flush=True)
"""
# UDP sender: N datagrams "i" to DST:PORT, paced so that no socket buffer overflows.
SEND = r"""
import socket, sys, time
dst, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
for i in range(n):
    s.sendto(str(i).encode(), (dst, port))
    if i % 50 == 49:
        time.sleep(0.002)
"""


def udp_exchange(tb, sender: str, receivers: list[str], dst: str, n: int, group: str = "",
                 port: int = 9999, idle: float = 0.5) -> list[tuple[int, int]]:
    """Send n datagrams from ``sender`` to ``dst``; return (received, distinct) per receiver."""
    procs = [tb.popen_in(r, [sys.executable, "-c", RECV, group, str(port), str(idle)],
                         stdout=subprocess.PIPE, text=True) for r in receivers]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        tb.exec_in(sender, [sys.executable, "-c", SEND, dst, str(port), str(n)], check=True, timeout=30)
        out = []
        for p in procs:
            got, distinct = map(int, p.stdout.readline().split())
            out.append((got, distinct))
        return out
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_hosts_one_dpu_reach_each_other_by_icmp_udp_and_multicast():
    with scratch_testbed(hosts=2, dpus=1, services=False) as tb:
        st = tb.status()
        addr = {n["name"]: n["address"] for n in st["nodes"]}
        for src, dst in (("h0", "h1"), ("h0", "d0"), ("h1", "d0"), ("d0", "h1")):
            p = tb.exec_in(src, ["ping", "-c", "1", "-W", "2", addr[dst]])
            assert p.returncode == 0, f"{src} cannot ping {dst}: {p.stdout}{p.stderr}"
        # unicast UDP host -> DPU, and DPU -> host
        assert udp_exchange(tb, "h0", ["d0"], addr["d0"], 200) == [(200, 200)]
        assert udp_exchange(tb, "d0", ["h1"], addr["h1"], 200) == [(200, 200)]
        # one multicast send reaches the other host and the DPU (bridge floods, route on eth0)
        assert udp_exchange(tb, "h0", ["h1", "d0"], "239.77.0.1", 100, group="239.77.0.1") == \
            [(100, 100), (100, 100)]


def test_status_json_describes_nodes_addresses_and_roles():
    with scratch_testbed(hosts=2, dpus=1, services=False) as tb:
        env = {**os.environ, "DOSA_TESTBED_PREFIX": tb.prefix,
               "DOSA_TESTBED_STATE_DIR": str(tb.state_dir)}
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "status", "--json"], env=env,
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        st = json.loads(p.stdout)
        assert st["up"] is True and st["prefix"] == tb.prefix
        assert st["config"]["hosts"] == 2 and st["config"]["dpus"] == 1
        nodes = {n["name"]: n for n in st["nodes"]}
        assert set(nodes) == {"h0", "h1", "d0"}
        assert [nodes[x]["role"] for x in ("h0", "h1", "d0")] == ["host", "host", "dpu"]
        assert nodes["h1"]["namespace"] == f"{tb.prefix}-h1"
        addrs = set()
        for n in nodes.values():
            (iface,) = n["interfaces"]
            assert iface["name"] == "eth0" and iface["up"]
            assert iface["addresses"] == [n["address"] + "/24"]
            addrs.add(n["address"])
        assert len(addrs) == 3
        fab = st["fabric"]
        assert fab["namespace"] == f"{tb.prefix}-fab"
        ports = {i["name"]: i for i in fab["interfaces"]}
        assert {"br0", "h0", "h1", "d0"} <= set(ports)
        assert all(ports[x]["master"] == "br0" for x in ("h0", "h1", "d0"))
        assert st["processes"] == []
        assert st["env"]["MASTER_ADDR"] == nodes["h0"]["address"]
        assert st["env"]["DOSA_CONTROL_ADDR"] == nodes["d0"]["address"]


def _qdisc(tb, node: str, dev: str) -> str:
    return tb.exec_in(node, ["tc", "qdisc", "show", "dev", dev], check=True).stdout


def _filters(tb, dev: str, hook: str) -> str:
    return tb.exec_in("fab", ["tc", "filter", "show", "dev", dev, hook], check=True).stdout


def test_shaping_puts_rate_on_both_ends_of_host_links_only():
    with scratch_testbed(hosts=2, dpus=1, services=False, link_rate="100mbit", loss="0.5",
                         dup="0.5") as tb:
        for node, dev in (("h0", "eth0"), ("h1", "eth0"), ("fab", "h0"), ("fab", "h1")):
            out = _qdisc(tb, node, dev)
            assert "tbf" in out and "rate 100Mbit" in out, f"{node}/{dev}: {out}"
        for dev in ("h0", "h1"):
            for hook in ("ingress", "egress"):
                assert "impair" in _filters(tb, dev, hook), f"no loss/dup program on {dev} {hook}"
        assert "tbf" not in _qdisc(tb, "d0", "eth0")
        assert "tbf" not in _qdisc(tb, "fab", "d0")
        assert "impair" not in _filters(tb, "d0", "ingress")
        st = tb.status()
        assert st["config"]["shaping"]["rate_bps"] == 100_000_000


def test_loss_and_duplication_happen_at_the_configured_rates():
    # 30% loss on h0's link (h0 -> fabric), nothing on d0's: about 70% of 2000 datagrams arrive
    with scratch_testbed(hosts=1, dpus=1, services=False, loss="30") as tb:
        d0 = tb.status()["nodes"][1]["address"]
        [(got, distinct)] = udp_exchange(tb, "h0", ["d0"], d0, 2000)
        assert got == distinct
        assert 0.62 * 2000 < got < 0.78 * 2000, got  # binomial sd ~ 1%: 8 sd margin
    with scratch_testbed(hosts=1, dpus=1, services=False, dup="30") as tb:
        d0 = tb.status()["nodes"][1]["address"]
        [(got, distinct)] = udp_exchange(tb, "h0", ["d0"], d0, 2000)
        assert distinct == 2000
        assert 1.22 * 2000 < got < 1.38 * 2000, got
