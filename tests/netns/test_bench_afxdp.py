"""`dosa bench afxdp` measures real deliveries: every method's frames (dosa's UDP GSO sends, plain
sendmmsg, and the C AF_XDP copy-mode sender) are counted by the receiver's native XDP program, so
a malformed AF_XDP frame (bad IPv4 header, wrong port) or a sender that only posted descriptors
would show as a received fraction below 1; and the run leaves no namespace behind."""
from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_every_method_delivers_every_frame_and_leaves_nothing():
    from benchmarks import afxdp

    before = _netns()
    r = afxdp.run(packets=20_000, repeat=1)
    assert set(r["methods"]) == set(afxdp.METHODS)
    assert r["config"]["payload"] == 3500 - 28
    for m, x in r["methods"].items():
        assert x["packets"] == 20_000, m
        assert x["received_fraction"] >= 0.99, (m, x["received_fraction"])
        assert x["sender_cpu_us_per_packet"] > 0 and x["machine_cpu_us_per_packet"] > 0, m
    assert r["config"]["udp_gso_segments"] > 1  # the GSO method did batch
    assert _netns() == before


def test_payload_larger_than_a_frame_is_refused_in_one_sentence():
    from benchmarks import afxdp
    from dosa.errors import DosaError

    with pytest.raises(DosaError, match="--payload must be 1..3472"):
        afxdp.run(packets=1000, payload=4000, mtu=3500)
