"""The testbed and batched sockets: ``--mtu`` sets every link; on impaired links a host's GSO datagram
reaches the fabric as its packets (so loss and duplication act per packet), on clean links whole."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
# one UdpEndpoint.send of 440 full-size packets to d0 (10 GSO datagrams of 44)
SEND = f"""
import sys, numpy as np
sys.path.insert(0, {str(ROOT)!r})
from dosa.wire import PacketBatch
from dosa.transport import UdpEndpoint
from dosa.net import addr_arrays
ep = UdpEndpoint((sys.argv[1], 0))
b = PacketBatch.empty(440)
b.lengths[:] = 1472
t = addr_arrays([(sys.argv[2], 9)])
ep.send(b, np.arange(440), np.full(440, t[0][0]), np.full(440, t[1][0]))
print(ep.send_datagrams)
"""


def _rx_packets(tb, port: str) -> int:
    out = tb.exec_in("fab", ["ip", "-j", "-s", "link", "show", "dev", port], check=True).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["packets"])


def _send_burst(tb) -> int:
    nodes = {n["name"]: n for n in tb.status()["nodes"]}
    out = tb.exec_in("h0", [sys.executable, "-c", SEND, nodes["h0"]["address"],
                            nodes["d0"]["address"]], check=True).stdout
    return int(out.split()[-1])


@pytest.mark.parametrize("impaired", [False, True])
def test_gso_datagrams_reach_an_impaired_fabric_as_packets(impaired):
    kw = dict(loss="0.001") if impaired else {}
    with scratch_testbed(hosts=1, dpus=1, services=False, **kw) as tb:
        before = _rx_packets(tb, "h0")
        assert _send_burst(tb) == 10  # the host's socket handed the kernel 10 GSO datagrams
        got = _rx_packets(tb, "h0") - before
        if impaired:
            assert got >= 440  # every packet crossed the link on its own (plus ARP)
        else:
            assert got < 40  # the veth carried the datagrams whole


def test_mtu_sets_every_link_and_bad_values_are_one_sentence(tmp_path):
    from dosa.errors import DosaError
    from testbed.core import Testbed
    from testbed.testing import unique_prefix

    with pytest.raises(DosaError, match="--mtu 9000 outside 576..3500"):
        Testbed(prefix=unique_prefix(), state_dir=tmp_path).up(1, 1, services=False, mtu=9000)
    with scratch_testbed(hosts=2, dpus=1, services=False, mtu=3500) as tb:
        st = tb.status()
        assert st["config"]["mtu"] == 3500
        for n in st["nodes"]:
            assert [i["mtu"] for i in n["interfaces"]] == [3500], n
        ports = {i["name"]: i["mtu"] for i in st["fabric"]["interfaces"]}
        assert ports["h0"] == ports["h1"] == ports["d0"] == 3500
