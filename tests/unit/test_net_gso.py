"""UDP GSO sends and GRO receives (dosa._net via UdpEndpoint) over loopback: they really batch
(system calls and datagrams counted, far fewer than packets), cut runs where the rules say, deliver
every packet intact, and fall back to one datagram per packet when the path refuses GSO."""
from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest

from dosa.wire import PacketBatch
from dosa import _net
from dosa.transport import UdpEndpoint, batching
from dosa.net import addr_arrays

pytestmark = pytest.mark.skipif(not batching()["gso"] or not batching()["gro"],
                                reason="this kernel has no UDP GSO/GRO (fallback tested below)")


def _batch(lengths) -> PacketBatch:
    """Packets of the given lengths, each starting with its u32 number, the rest random."""
    n = len(lengths)
    b = PacketBatch.empty(n)
    b.lengths[:] = lengths
    rng = np.random.default_rng(n)
    b.data[:] = rng.integers(0, 256, b.data.shape, dtype=np.uint8)
    b.data[:, :4] = np.arange(n, dtype=np.uint32).view(np.uint8).reshape(n, 4)
    return b


def _receive(ep: UdpEndpoint, want: int, deadline: float = 5.0) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    end = time.monotonic() + deadline
    while len(got) < want and time.monotonic() < end:
        b, _, _ = ep.recv(0.2)
        for i in range(len(b)):
            p = b.packet(i)
            got[int(np.frombuffer(p[:4], np.uint32)[0])] = p
    return got


def _expected_runs(lengths, dest, limit=_net.MAX_GSO_SEGMENTS) -> int:
    """Datagrams the GSO rule makes: equal lengths to one destination, the short one last."""
    runs, k, n = 0, 0, len(lengths)
    while k < n:
        seg, tot, j = lengths[k], lengths[k], 1
        k += 1
        while k < n and j < limit and dest[k] == dest[k - j] and 0 < lengths[k] <= seg \
                and tot + lengths[k] <= 65507:
            tot += lengths[k]
            j += 1
            k += 1
            if lengths[k - 1] < seg:
                break
        runs += 1
    return runs


@pytest.fixture
def pair():
    rx, tx = UdpEndpoint(("127.0.0.1", 0)), UdpEndpoint(("127.0.0.1", 0))
    yield rx, tx
    rx.close()
    tx.close()


def test_gso_sends_a_round_in_one_call_and_gro_receives_it_in_few(pair):
    rx, tx = pair
    # partitions of 13 packets: 12 full, the last short (as the packetizer lays them out)
    per = [1472] * 12 + [300]
    lengths = per * 40
    b = _batch(lengths)
    table = addr_arrays([rx.address])
    assert tx.send_to_table(b, table) == len(b)
    assert tx.send_calls == 1
    assert tx.send_datagrams == 40 == _expected_runs(lengths, np.zeros(len(b)))
    got = _receive(rx, len(b))
    assert sorted(got) == list(range(len(b)))
    assert all(got[i] == b.packet(i) for i in range(len(b)))
    assert rx.recv_packets == len(b)
    assert rx.recv_datagrams <= 40 and rx.recv_calls < 10


def test_gso_runs_break_at_destination_length_segment_and_byte_limits(pair):
    rx, tx = pair
    other = UdpEndpoint(("127.0.0.1", 0))
    try:
        rng = np.random.default_rng(3)
        lengths = [int(x) for x in rng.choice([40, 700, 1472], 600, p=[0.1, 0.2, 0.7])]
        lengths += [1472] * 150  # a long run: cut at 44 segments by the 65,507-byte bound
        lengths += [100] * 200  # short packets: cut at the segment limit
        n = len(lengths)
        dest = rng.integers(0, 2, n)
        dest[600:] = 0
        b = _batch(lengths)
        b.dest[:] = dest
        table = addr_arrays([rx.address, other.address])
        assert tx.send_to_table(b, table) == n
        assert tx.send_datagrams == _expected_runs(lengths, dest)
        assert tx.send_datagrams < n
        got = {**_receive(rx, int((dest == 0).sum())), **_receive(other, int((dest == 1).sum()))}
        assert sorted(got) == list(range(n))
        assert all(got[i] == b.packet(i) for i in range(n))
    finally:
        other.close()


def test_gro_receiver_keeps_what_does_not_fit_the_slots_for_the_next_call():
    rx = UdpEndpoint(("127.0.0.1", 0), recv_slots=7)
    tx = UdpEndpoint(("127.0.0.1", 0))
    try:
        b = _batch([1472] * 300)
        tx.send_to_table(b, addr_arrays([rx.address]))
        sizes, got = [], {}
        end = time.monotonic() + 5
        while len(got) < 300 and time.monotonic() < end:
            r, _, _ = rx.recv(0.2)
            sizes.append(len(r))
            for i in range(len(r)):
                got[int(np.frombuffer(r.packet(i)[:4], np.uint32)[0])] = r.packet(i)
        assert max(sizes) == 7
        assert sorted(got) == list(range(300))
        assert rx.recv_datagrams < 300 / 10
    finally:
        rx.close()
        tx.close()


def test_without_gso_every_packet_is_its_own_datagram(pair, monkeypatch):
    rx, _ = pair
    monkeypatch.setenv("DOSA_GSO", "0")
    monkeypatch.setenv("DOSA_GRO", "0")
    tx = UdpEndpoint(("127.0.0.1", 0))
    plain = UdpEndpoint(("127.0.0.1", 0))
    try:
        assert tx.gso_segs == 0 and not plain.gro
        b = _batch([1472] * 100)
        tx.send_to_table(b, addr_arrays([plain.address]))
        assert tx.send_datagrams == 100 and tx.send_calls == 1
        got = _receive(plain, 100)
        assert len(got) == 100 and plain.recv_datagrams == 100
    finally:
        tx.close()
        plain.close()


def test_a_path_that_refuses_gso_falls_back_once_and_loses_nothing(pair, caplog):
    rx, tx = pair
    # the kernel refuses GSO (EINVAL) on a socket that sends without UDP checksums
    tx.sock.setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK
    b = _batch([1472] * 90)
    with caplog.at_level(logging.WARNING, logger="dosa.net"):
        assert tx.send_to_table(b, addr_arrays([rx.address])) == 90
        assert tx.send_to_table(b, addr_arrays([rx.address])) == 90
    assert tx.gso_segs == 0
    assert sum("GSO refused" in r.getMessage() for r in caplog.records) == 1
    got = _receive(rx, 90)
    assert sorted(got) == list(range(90))
    assert tx.sent_packets == 180
