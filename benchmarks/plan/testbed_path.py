"""The testbed's path, measured (root): what a packet or a byte costs the CPUs between two of its
namespaces, for ``dosa plan --validate`` (benchmarks.plan.costs.PathCosts).

On the testbed the fabric is the kernel: a veth pair and a bridge whose work runs on the sending
core, the segmenting of a GSO datagram before a DPU's XDP program included, and the bridge's copies
of a multicast result. Loopback has none of that, so the validation measures the testbed's own:

* **TCP** (what Gloo's ring and allgather pay): h0 sends to h1 through the fabric at the validation's
  link rate; both processes' CPU over the bytes.
* **a host's data packets** (dosa's sends): GSO datagrams from h0 to h1 with the segmentation made at
  h1's bridge port, as the port towards a DPU running XDP makes it; h0's CPU a packet is the host's
  send, h1's (a frame at a time, GRO off on a veth) stands for the DPU's frame receive.
* **the DPU's results**: GSO datagrams from h0 to a multicast group h1 and h2 joined, and to h1 alone;
  the sender's CPU a packet with two copies and with one gives the send and each host's copy; the
  receivers' CPU a packet is a host's GRO receive (the send itself is in dosa bench dpu's completion
  figure; only the copies are the path's).

A scratch testbed of three hosts (no DPU, no services) is brought up for each link rate and always
torn down; the senders and receivers are pinned to the hosts' CPUs (``cpu_split``) as the bench's
ranks are.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from dosa import wire
from dosa.errors import DosaError

from benchmarks.plan.costs import PathCosts

PORT = 17999
GROUP = "239.77.9.9"


def _probe(tb, node: str, args: list[str], cpus) -> subprocess.Popen:
    return tb.popen_in(node, [sys.executable, "-m", "benchmarks.plan.path_probe", *args], cpus=cpus,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen, what: str, timeout: float = 60.0) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise DosaError(f"the testbed path measurement ({what}) did not finish in {timeout:g} s") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise DosaError(f"the testbed path measurement ({what}) failed: {(err or out).strip()[-300:]}")
    return json.loads(lines[-1])


def _ready(p: subprocess.Popen, what: str) -> None:
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise DosaError(f"the testbed path measurement ({what}) did not start: {line.strip() or p.stderr.read()[-300:]}")


def _udp(tb, cpus, dest_node: str, dest: str, seg: int, packets: int, receivers: list[str],
         group: str | None = None) -> tuple[dict, list[dict]]:
    recvs = [_probe(tb, r, ["udp-recv", str(PORT), str(seg)] + ([group] if group else []), cpus)
             for r in receivers]
    for r in recvs:
        _ready(r, "udp receiver")
    send = _result(_probe(tb, "h0", ["udp-send", dest, str(PORT), str(seg), str(packets)], cpus),
                   f"udp to {dest_node}")
    return send, [_result(r, "udp receiver") for r in recvs]


def _tcp(tb, cpus, dest: str, mbytes: int) -> float:
    r = _probe(tb, "h1", ["tcp-recv", str(PORT)], cpus)
    _ready(r, "tcp receiver")
    s = _result(_probe(tb, "h0", ["tcp-send", dest, str(PORT), str(mbytes)], cpus), "tcp sender")
    got = _result(r, "tcp receiver")
    return (s["cpu_s"] + got["cpu_s"]) / max(1, got["bytes"]) * 1e9


def measure(link_rates: list[str | None], mtu: int = wire.MAX_MTU, packets: int = 60_000,
            tcp_mbytes: int = 200, say=None) -> dict[str | None, PathCosts]:
    """PathCosts of the testbed for each link rate (None: unshaped): the UDP figures measured once
    on an unshaped fabric (shaping would drop a burst, not change a packet's cost), TCP at each
    rate (TCP paces itself to the shaper, and the shaper's work is part of its cost)."""
    from testbed.testing import scratch_testbed

    say = say or (lambda m: None)
    seg = wire.max_udp_payload(mtu)
    per = lambda r: r["cpu_s"] / max(1, r["packets"]) * 1e9  # noqa: E731
    with scratch_testbed(hosts=3, dpus=0, services=False, cpu_split=True, mtu=mtu) as tb:
        st = tb.status()
        cpus = st["nodes"][0]["cpus"]
        addr = {n["name"]: n["address"] for n in st["nodes"]}
        say("the testbed's path: UDP data packets (segmented at the port, as before XDP)")
        port = "h1"  # the bridge port towards h1 segments, as a port towards a DPU's XDP does
        tb.exec_in("fab", ["ethtool", "-K", port, "tx-udp-segmentation", "off"], check=True)
        data_send, data_recv = _udp(tb, cpus, "h1", addr["h1"], seg, packets, ["h1"])
        tb.exec_in("fab", ["ethtool", "-K", port, "tx-udp-segmentation", "on"], check=True)
        say("the testbed's path: results to one host and to a multicast group of two")
        uni, _ = _udp(tb, cpus, "h1", addr["h1"], seg, packets, ["h1"])
        multi, grecv = _udp(tb, cpus, "group", GROUP, seg, packets, ["h1", "h2"], GROUP)
    copy = max(0.0, per(multi) - per(uni))
    udp = {"udp_send_ns_per_packet": per(data_send),
           "udp_recv_ns_per_packet": sum(per(r) for r in grecv) / len(grecv),
           "dpu_rx_ns_per_packet": per(data_recv[0]),
           "dpu_tx_ns_per_copy": copy,
           "raw": {"data_send": data_send, "data_recv": data_recv, "unicast": uni,
                   "multicast": multi, "multicast_recv": grecv}}
    out: dict[str | None, PathCosts] = {}
    for rate in link_rates:
        with scratch_testbed(hosts=2, dpus=0, services=False, link_rate=rate, cpu_split=True,
                             mtu=mtu) as tb:
            st = tb.status()
            say(f"the testbed's path: TCP at {rate or 'no shaping'}")
            tcp = _tcp(tb, st["nodes"][0]["cpus"], st["nodes"][1]["address"], tcp_mbytes)
        out[rate] = PathCosts(udp["udp_send_ns_per_packet"], udp["udp_recv_ns_per_packet"], tcp,
                              udp["dpu_rx_ns_per_packet"], udp["dpu_tx_ns_per_copy"], source=f"testbed path, link {rate or 'unshaped'}",
                              measured={"mtu": mtu, "packets": packets, "tcp_mbytes": tcp_mbytes,
                                        "udp": udp["raw"], "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    return out
