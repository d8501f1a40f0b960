"""Batched UDP send/receive (dosa._net via dosa.transport.UdpEndpoint) over loopback."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from dosa import wire
from dosa.wire import PacketBatch
from dosa import _net
from dosa.transport import UdpEndpoint
from dosa.net import addr_arrays


def _drain(ep, want, deadline=5.0):
    got = []
    end = time.monotonic() + deadline
    while sum(len(b) for b in got) < want and time.monotonic() < end:
        b, ip, port = ep.recv(0.2)
        got.append(PacketBatch(b.data.copy(), b.lengths.copy(), b.dest.copy()))
    return got


def test_send_batch_reaches_per_packet_destinations_intact():
    rx = [UdpEndpoint(("127.0.0.1", 0)) for _ in range(2)]
    tx = UdpEndpoint(("127.0.0.1", 0))
    try:
        n = 3000  # more than one sendmmsg call (1024) and one recvmmsg call
        batch = PacketBatch.empty(n)
        rng = np.random.default_rng(1)
        batch.lengths[:] = rng.integers(8, 1473, n)  # >= 8: the id below must fit
        for i in range(n):
            batch.data[i, :8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
        batch.data[:, 8:] = rng.integers(0, 256, (n, batch.data.shape[1] - 8), dtype=np.uint8)
        batch.dest[:] = np.arange(n) % 2
        table = addr_arrays([r.address for r in rx])
        assert tx.send_to_table(batch, table) == n
        for d, r in enumerate(rx):
            got = _drain(r, n // 2)
            lengths = np.concatenate([b.lengths for b in got])
            data = np.concatenate([b.data for b in got])
            assert len(lengths) == n // 2
            ids = data[:, :8].copy().view(np.int64).reshape(-1)
            assert sorted(ids.tolist()) == list(range(d, n, 2))
            for k in range(len(ids)):
                i = ids[k]
                assert lengths[k] == batch.lengths[i]
                assert np.array_equal(data[k, :lengths[k]], batch.data[i, :batch.lengths[i]])
        assert tx.sent_packets == n and tx.sent_bytes == int(batch.lengths.sum())
    finally:
        for e in (*rx, tx):
            e.close()


def test_recv_times_out_empty_and_drops_oversized_datagrams():
    ep = UdpEndpoint(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        b, _, _ = ep.recv(0.2)
        assert len(b) == 0 and 0.15 < time.monotonic() - t0 < 2.0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"x" * (wire.stride_for_mtu(wire.MAX_MTU) + 1), ep.address)  # over any MTU's slot
            s.sendto(b"y" * 10, ep.address)
        got = _drain(ep, 1)
        assert [int(x) for b in got for x in b.lengths] == [10]
        assert ep.truncated == 1
    finally:
        ep.close()


def test_send_batch_validates_rows_and_destinations():
    ep = UdpEndpoint(("127.0.0.1", 0))
    try:
        b = PacketBatch.empty(2)
        b.lengths[:] = 10
        ip, port = addr_arrays([ep.address])
        with pytest.raises(ValueError):
            _net.send_batch(ep.fd, b.data, b.lengths, np.array([5], np.int64), ip, port, 1.0)
        with pytest.raises(ValueError):
            _net.send_batch(ep.fd, b.data, b.lengths, np.array([0, 1], np.int64), ip, port, 1.0)
    finally:
        ep.close()
