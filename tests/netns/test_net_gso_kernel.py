"""The kernel's own UDP counters agree that UdpEndpoint batches: in a fresh network namespace (so no
other traffic counts), 440 full-size packets sent with GSO and received with GRO are 10 datagrams
each way in /proc/net/snmp, and 440 each way with DOSA_GSO=0 / DOSA_GRO=0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = f"""
import json, subprocess, sys
sys.path.insert(0, {str(ROOT)!r})
import numpy as np
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from dosa.net import addr_arrays
from dosa.wire import PacketBatch
from dosa.transport import UdpEndpoint

def udp():
    rows = [l.split() for l in open("/proc/net/snmp") if l.startswith("Udp:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))

rx, tx = UdpEndpoint(("127.0.0.1", 0)), UdpEndpoint(("127.0.0.1", 0))
b = PacketBatch.empty(440)
b.lengths[:] = 1472
before = udp()
t = addr_arrays([rx.address])
tx.send(b, np.arange(440), np.full(440, t[0][0]), np.full(440, t[1][0]))
got = 0
while got < 440:
    r, _, _ = rx.recv(1.0)
    if not len(r):
        break
    got += len(r)
after = udp()
print(json.dumps({{"got": got, "out": after["OutDatagrams"] - before["OutDatagrams"],
                   "in": after["InDatagrams"] - before["InDatagrams"]}}))
"""


def _run(env: dict) -> dict:
    p = subprocess.run(["unshare", "--net", sys.executable, "-c", SCRIPT], capture_output=True,
                       text=True, timeout=50, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_kernel_counts_one_datagram_per_44_packets_with_gso_and_gro():
    assert _run({}) == {"got": 440, "out": 10, "in": 10}


def test_the_kernel_counts_one_datagram_per_packet_without_them():
    assert _run({"DOSA_GSO": "0", "DOSA_GRO": "0"}) == {"got": 440, "out": 440, "in": 440}
