"""Debian's tshark with the generated dissector on a real testbed capture (training through the
XDP dataplane): for every dosa packet, the fields tshark prints equal the scapy layer's --
every header field, every payload block, the absolute indices -- and tshark flags none of them."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from scapy.layers.inet import UDP
from scapy.utils import rdpcap

from dosa import wire, wireshark
from dosa.scapy_layer import BLOCK_FIELDS, Dosa
from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(400)]


def test_tshark_fields_equal_the_scapy_layers_on_a_real_capture(tmp_path):
    if not shutil.which("tshark"):
        pytest.fail("tshark is not installed: run `make setup` (it installs Debian's tshark)")
    pcap = tmp_path / "run.pcap"
    with scratch_testbed(hosts=2, dpus=1) as tb:
        stats, res = tb.capture(pcap, [sys.executable, "-m", "examples.train_digits", "--comm", "dosa",
                                       "--epochs", "1", "--quiet"], timeout=240, echo=False)
        res.check()
    lua = wireshark.write(tmp_path / "dosa.lua")
    fields = [*wireshark.header_field_names(), *wireshark.entry_field_names(), "dosa.drop_reason",
              "_ws.expert.message"]
    rows = {int(r["frame.number"][0]): r for r in wireshark.tshark_fields(pcap, fields, lua)}

    ours, longest = {}, 0
    for i, frame in enumerate(rdpcap(str(pcap)), 1):
        if frame.haslayer(UDP) and frame.haslayer(Dosa):
            ours[i] = frame[Dosa]
            longest = max(longest, len(frame))
    # the job the hook created through the control plane takes its path's MTU (the testbed's 3500),
    # not the protocol's 1500 default: some packet is longer than a 1500-byte MTU's frame
    assert longest > 1514, f"the longest dosa frame has {longest} bytes: the job kept MTU 1500"
    types = {int(p.type) for p in ours.values()}
    assert {int(wire.PacketType.SPARSE_DATA), int(wire.PacketType.SPARSE_RESULT)} <= types, types
    assert sorted(rows) == sorted(ours), "tshark and scapy disagree on which frames are dosa"
    entries = 0
    for n, p in ours.items():
        row = rows[n]
        assert row["dosa.drop_reason"] == ["ok"] and row["_ws.expert.message"] == [], (n, row)
        for f, _, _ in wire.HEADER_FIELDS:
            assert [int(x, 0) for x in row[f"dosa.{f}"]] == [int(getattr(p, f))], (n, f)
        for block, _ in wire.PAYLOAD_BLOCKS[wire.PacketType(p.type)]:
            got = [int(x) for x in row[f"dosa.entry.{block}"]]
            assert got == list(getattr(p, BLOCK_FIELDS[block])), (n, block)
            entries += len(got)
        assert [int(x) for x in row["dosa.entry.index"]] == p.indices(), (n, "index")
    assert entries > 0
    # the one-line summaries, for a reader of the test log
    p = subprocess.run(["tshark", "-n", "-r", str(pcap), "-X", f"lua_script:{lua}", "-Y", "dosa"],
                       capture_output=True, text=True, timeout=60)
    print("\n".join(p.stdout.splitlines()[:8]))
