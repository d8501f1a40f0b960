"""``--reorder`` without netem: HTB fast/slow lanes on both egresses of each host link and the
``reorder`` classifier of testbed/impair.c. Numbered UDP datagrams go from h0 to h1 across the
fabric; the receiver counts how many arrive after a higher-numbered one ("late"), duplicates and
losses, and the slow class's counters show how many packets the classifier picked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dosa.errors import DosaError
from testbed.shaping import SLOW_MIN_BPS, UNSHAPED_REF_BPS, Shaping
from testbed.testing import scratch_testbed, unique_prefix

pytestmark = pytest.mark.timeout(60)

PORT = 17990
COUNT = 3000
PAYLOAD = 1000

# receiver: binds, prints "ready", counts until COUNT datagrams or 1.5 s of silence, prints JSON
RECEIVER = r"""
import json, socket, struct, sys
addr, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE: the test measures the link only
s.bind((addr, port)); s.settimeout(1.5)
print("ready", flush=True)
seqs = []
try:
    while len(seqs) < count * 2:
        seqs.append(struct.unpack_from("!I", s.recv(4096))[0])
        if len(seqs) >= count and len(set(seqs)) == count:
            s.settimeout(0.3)  # all there: wait a moment for duplicates only
except socket.timeout:
    pass
high, late = -1, 0
for q in seqs:
    late += q < high
    high = max(high, q)
print(json.dumps({"received": len(seqs), "unique": len(set(seqs)), "late": late}))
"""

SENDER = r"""
import os, socket, struct, sys
addr, port, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# one CPU: a veth transmit queues to the receiving side's backlog of the CPU the sender runs on, so
# a sender that migrates mid-stream can reorder two packets itself, whatever the links do (the
# rare 'late': 1 of an unimpaired link); what is measured here is the links' reordering
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # blocking: a full queue waits, never drops
pad = b"x" * (size - 4)
for i in range(count):
    s.sendto(struct.pack("!I", i) + pad, (addr, port))
"""


def send_numbered(tb, count: int = COUNT) -> dict:
    """h0 sends ``count`` numbered datagrams to h1; returns the receiver's counts."""
    dst = tb.status()["nodes"][1]["address"]
    rx = tb.popen_in("h1", [sys.executable, "-c", RECEIVER, dst, str(PORT), str(count)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready", rx.stderr.read()
        tb.exec_in("h0", [sys.executable, "-c", SENDER, dst, str(PORT), str(count),
                          str(PAYLOAD)], check=True, timeout=30)
        out, err = rx.communicate(timeout=30)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert rx.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


TCP_SERVER = r"""
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(20)
n = 0
while chunk := c.recv(65536):
    n += len(chunk)
print(n)
"""
TCP_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
c.sendall(b"t" * int(sys.argv[3])); c.close()
"""


def send_tcp(tb, size: int) -> int:
    """h0 sends ``size`` bytes over TCP to h1; returns the bytes h1 received."""
    dst = tb.status()["nodes"][1]["address"]
    srv = tb.popen_in("h1", [sys.executable, "-c", TCP_SERVER, dst, str(PORT)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
        tb.exec_in("h0", [sys.executable, "-c", TCP_CLIENT, dst, str(PORT), str(size)],
                   check=True, timeout=30)
        out, err = srv.communicate(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    assert srv.returncode == 0, err
    return int(out.strip())


def htb_classes(tb, node: str, dev: str) -> dict[str, dict]:
    """``tc -s class show`` of ``dev`` (no JSON for HTB classes in this iproute2), parsed into
    {classid: {"rate": "40Mbit", "ceil": ..., "packets": N}}."""
    text = tb.exec_in(node, ["tc", "-s", "class", "show", "dev", dev], check=True).stdout
    out: dict[str, dict] = {}
    for block in text.split("class htb ")[1:]:
        w = block.split()
        sent = w.index("Sent")
        out[w[0]] = {"rate": w[w.index("rate") + 1], "ceil": w[w.index("ceil") + 1],
                     "packets": int(w[sent + 3])}
    return out


def slow_class_packets(tb, node: str, dev: str) -> int:
    """Packets HTB's slow class 1:20 sent on ``dev`` of ``node``."""
    return htb_classes(tb, node, dev)["1:20"]["packets"]


@pytest.mark.root
def test_reorder_20_percent_delivers_some_udp_late_and_loses_none():
    with scratch_testbed(hosts=2, dpus=0, services=False, reorder="20", loss="0") as tb:
        r = send_numbered(tb)
        picked = slow_class_packets(tb, "h0", "eth0")  # first hop: h0's own egress
        picked_fab = slow_class_packets(tb, "fab", "h1")  # second hop: the bridge port to h1
    assert r["unique"] == COUNT and r["received"] == COUNT, r  # nothing lost, nothing doubled
    # the classifier picks ~20% of the UDP packets at each hop (binomial: 600 +- 22 of 3000)
    assert 0.15 * COUNT < picked < 0.25 * COUNT, picked
    assert 0.15 * COUNT < picked_fab < 0.25 * COUNT, picked_fab
    # held packets are overtaken (about 35% of all arrive late over the two links here, fewer when
    # the sender is slowed down: the slow lane then finds fewer packets queued); never more than
    # were picked
    assert 0.03 * COUNT < r["late"] <= picked + picked_fab, r


@pytest.mark.root
def test_reorder_100_picks_exactly_the_udp_packets_never_arp_or_tcp():
    """Every UDP datagram and nothing else goes to the slow lane (ARP resolution of h1 and a TCP
    connection pass through the fast one), and one FIFO lane keeps its packets in order."""
    with scratch_testbed(hosts=2, dpus=0, services=False, reorder="100") as tb:
        r = send_numbered(tb, 500)
        classes = htb_classes(tb, "h0", "eth0")
        tcp_bytes = send_tcp(tb, 200_000)
        after_tcp = htb_classes(tb, "h0", "eth0")
    assert r == {"received": 500, "unique": 500, "late": 0}
    assert classes["1:20"]["packets"] == 500, classes
    assert classes["1:10"]["packets"] >= 1, classes  # the ARP request
    assert tcp_bytes == 200_000
    assert after_tcp["1:20"]["packets"] == 500, after_tcp  # TCP stayed in the fast lane
    assert after_tcp["1:10"]["packets"] > classes["1:10"]["packets"], after_tcp


@pytest.mark.root
def test_reorder_0_keeps_order_and_installs_no_htb():
    with scratch_testbed(hosts=2, dpus=0, services=False, reorder="0") as tb:
        r = send_numbered(tb)
        qdiscs = tb.exec_in("h0", ["tc", "qdisc", "show", "dev", "eth0"], check=True).stdout
    assert r == {"received": COUNT, "unique": COUNT, "late": 0}
    assert "htb" not in qdiscs


@pytest.mark.root
def test_reorder_composes_with_link_rate_and_duplication():
    """The rate moves from tbf into HTB's parent class; the loss/dup program stays on the bridge
    port's clsact hooks, and its copies pass the classifier like any packet."""
    with scratch_testbed(hosts=2, dpus=0, services=False, reorder="20", link_rate="200mbit",
                         dup="10") as tb:
        r = send_numbered(tb, 2000)
        classes = htb_classes(tb, "h0", "eth0")
        fab_qdiscs = tb.exec_in("fab", ["tc", "qdisc", "show", "dev", "h0"], check=True).stdout
    assert (classes["1:1"]["rate"], classes["1:1"]["ceil"]) == ("200Mbit", "200Mbit"), classes
    assert (classes["1:20"]["rate"], classes["1:20"]["ceil"]) == ("40Mbit", "40Mbit"), classes
    assert classes["1:20"]["packets"] > 0, classes
    assert "htb" in fab_qdiscs and "clsact" in fab_qdiscs and "tbf" not in fab_qdiscs
    assert r["unique"] == 2000 and r["received"] > 2000 and r["late"] > 0, r


@pytest.mark.root
def test_status_json_reports_the_reorder_setting(tmp_path):
    prefix = unique_prefix()
    with scratch_testbed(hosts=2, dpus=0, prefix=prefix, state_dir=tmp_path, services=False,
                         reorder="7.5"):
        env = {**os.environ, "DOSA_TESTBED_PREFIX": prefix, "DOSA_TESTBED_STATE_DIR": str(tmp_path)}
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "status", "--json"], env=env,
                           capture_output=True, text=True, timeout=30)
        text = subprocess.run([sys.executable, "-m", "dosa", "testbed", "status"], env=env,
                              capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "per direction: reorder 7.5% (slow lane 7.5Mbit/s)" in text.stdout, text.stdout
    st = json.loads(p.stdout)
    assert st["config"]["shaping"]["reorder_pct"] == 7.5
    eth0 = next(i for i in st["nodes"][0]["interfaces"] if i["name"] == "eth0")
    assert eth0["qdiscs"][0] == "htb"


@pytest.mark.root
def test_delay_without_netem_is_one_clear_sentence_and_leaves_nothing(tmp_path):
    prefix = unique_prefix()
    from testbed.core import Testbed
    tb = Testbed(prefix=prefix, state_dir=tmp_path)
    try:
        tb.up(2, 0, delay="1ms", services=False)
    except DosaError as e:
        assert "--delay needs the kernel's netem qdisc" in str(e)
        assert not [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
        assert list(tmp_path.iterdir()) == []
        return
    try:  # a kernel with netem: the delay must really be there
        assert "netem" in tb.exec_in("h0", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    finally:
        tb.down()


def test_htb_layout_keeps_the_link_rate_and_sizes_the_slow_lane():
    s = Shaping.parse(rate="1gbit", reorder="5")
    assert s.slow_lane_bps() == 50 * 10**6
    cmds = s.qdisc_commands("eth0")
    assert cmds[0][:8] == ["qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb"]
    parent, fast, slow = cmds[1], cmds[2], cmds[3]
    assert parent[parent.index("rate") + 1] == parent[parent.index("ceil") + 1] == "1000000000bit"
    assert fast[fast.index("rate") + 1] == "950000000bit"
    assert fast[fast.index("ceil") + 1] == "1000000000bit"
    assert slow[slow.index("rate") + 1] == slow[slow.index("ceil") + 1] == "50000000bit"
    assert s.impair_defines()["REORDER_THRESH"] == f"{round(0.05 * 2**32)}ULL"
    # unshaped: sized for UNSHAPED_REF_BPS, never below SLOW_MIN_BPS
    assert Shaping.parse(reorder="20").slow_lane_bps() == UNSHAPED_REF_BPS // 5
    assert Shaping.parse(reorder="0.001").slow_lane_bps() == SLOW_MIN_BPS
    assert Shaping.parse(rate="100kbit", reorder="5").slow_lane_bps() == 100_000  # <= the link
    # with --delay (netem kernels) netem reorders, and no classifier is compiled in
    d = Shaping.parse(delay="1ms", reorder="5")
    assert d.netem_args() == ["delay", "1000us", "reorder", "5%"]
    assert "REORDER_THRESH" not in d.impair_defines() and not d.uses_htb_reorder
    assert Shaping.parse(reorder="0").qdisc_commands("eth0") == []
    assert Shaping.parse(reorder=20) == Shaping.parse(reorder="20%") == Shaping(reorder_pct=20.0)
