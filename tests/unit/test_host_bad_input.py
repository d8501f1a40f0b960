"""Bad input to host_lib gets a clear exception (or a defined result), never garbage."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dosa import wire
from dosa.app.cli import main as dosa_main
from dosa.wire import Flags, PacketType, PartitionMap
from host_lib.compress import select_topk
from host_lib.encoder import RoundEncoder
from dosa.packetizer import (
    packetize, packetize_partition_result, packetize_results, parse_batch, results_to_dense,
    results_to_sparse,
)
from host_lib.quantize import quantize

pytestmark = pytest.mark.timeout(120)

PMAP = PartitionMap(1000, partition_size=100, num_dpus=2)
ARGS = dict(job_id=1, worker_id=0, round=0, scale_exp=0)


def _batch(*packets: bytes) -> wire.PacketBatch:
    return wire.PacketBatch.from_packets(list(packets))


GOOD = wire.build_packet(wire.Header(flags=Flags.LAST), np.array([[5, 1]]))


# ---------------------------------------------------------------------------------- packetize
@pytest.mark.parametrize("idx, vals, msg", [
    ([1000], [1], r"index 1000 at position 0 is outside \[0, 1000\)"),
    ([3, 2], [1, 1], "sorted ascending and unique; position 1"),
    ([2, 2], [1, 1], "sorted ascending and unique"),
    ([1, 2], [1], "2 indices but 1 values"),
    ([-1], [1], "u32"),
    ([1], [2**31], "s32"),
    ([1], [1.5], "integers"),
    ([[1]], [[1]], "1-D"),
])
def test_packetize_rejects(idx, vals, msg):
    with pytest.raises(ValueError, match=msg):
        packetize(np.array(idx), np.array(vals), PMAP, **ARGS)


def test_packetize_rejects_too_many_entries_for_one_partition():
    pmap = PartitionMap(140_000, partition_size=65_536)
    idx = np.arange(0, 256 * 240 + 1, dtype=np.uint32)
    with pytest.raises(ValueError, match=r"partition 0 has 61441 entries, which needs 257 packets"):
        packetize(idx, np.ones(len(idx), np.int32), pmap, encoding="sparse", **ARGS)
    # 61440 still fit exactly 256 packets
    b = packetize(idx[:-1], np.ones(len(idx) - 1, np.int32), pmap, encoding="sparse", **ARGS)
    assert len(b) == 256 + 2
    # sent the default way, such a partition is one dense run: 171 packets of 360 values
    b = packetize(idx, np.ones(len(idx), np.int32), pmap, **ARGS)
    assert len(b) == 171 + 2
    # at the smallest MTU a sparse-enough partition can still overflow, with a sentence
    spread = np.arange(0, 65_536, 2, dtype=np.uint32)[:256 * 86 + 1]
    with pytest.raises(ValueError, match=r"needs 257 packets.*at MTU 576"):
        packetize(spread, np.ones(len(spread), np.int32), pmap, mtu=576, **ARGS)


@pytest.mark.parametrize("field, value", [("job_id", 0), ("worker_id", 64), ("round", -1),
                                          ("scale_exp", 63), ("flags", int(Flags.LAST)),
                                          ("flags", 0x100)])
def test_packetize_rejects_bad_header_arguments(field, value):
    with pytest.raises(ValueError):
        packetize([1], [1], PMAP, **{**ARGS, "flags": 0, field: value})


def test_packetize_rejects_bad_partition_subsets():
    with pytest.raises(ValueError, match="sorted"):
        packetize([1], [1], PMAP, **ARGS, partitions=[1, 0])
    with pytest.raises(ValueError, match=r"0\.\.9"):
        packetize([1], [1], PMAP, **ARGS, partitions=[0, 10])


def test_partition_result_rejects_indices_outside_its_partition():
    with pytest.raises(ValueError, match="outside partition 1"):
        packetize_partition_result([99, 150], [1, 1], job_id=1, partition=1, round=0, scale_exp=0,
                                   bounds=(100, 200))
    with pytest.raises(ValueError, match="outside"):
        packetize_results([1000], [1], PMAP, job_id=1, round=0, scale_exp=0)


# ---------------------------------------------------------------------------------- parse
def test_truncated_buffers():
    for n in (0, 1, 31):
        with pytest.raises(wire.TruncatedPacket, match="packet 1:"):
            parse_batch(_batch(GOOD, GOOD[:n]))
    # header intact but the payload cut: a count mismatch
    with pytest.raises(wire.CountMismatch, match="packet 0: count 1 needs a 40-byte payload, packet has 39"):
        parse_batch(_batch(GOOD[:-1]))


@pytest.mark.parametrize("offset, value, exc", [
    (0, 0x00, wire.BadMagic), (4, 1, wire.BadVersion), (4, 3, wire.BadVersion), (5, 99, wire.BadType), (5, 0, wire.BadType),
    (27, 1, wire.BadField), (7, 0x80, wire.BadField),
])
def test_wrong_magic_version_type_fields(offset, value, exc):
    raw = bytearray(GOOD)
    raw[offset] = value
    with pytest.raises(exc, match="^packet 2:"):
        parse_batch(_batch(GOOD, GOOD, bytes(raw)))


def test_count_vs_length():
    h = wire.Header(flags=Flags.LAST)
    body = np.array([[1, 1], [2, 2]])
    raw = wire.build_packet(h, body)
    with pytest.raises(wire.CountMismatch):
        parse_batch(_batch(raw + b"\0" * 6))  # two entries announced, three carried
    too_many = bytearray(raw)
    too_many[22:24] = (wire.RX_MAX_SPARSE_ENTRIES + 1).to_bytes(2, "big")
    with pytest.raises(wire.CountMismatch, match=f"exceeds the maximum {wire.RX_MAX_SPARSE_ENTRIES}"):
        parse_batch(_batch(bytes(too_many)))


def test_drop_mode_keeps_good_packets_and_counts_bad_ones():
    bad = bytearray(GOOD)
    bad[0] = 0
    p = parse_batch(_batch(GOOD, bytes(bad), GOOD[:10], GOOD), on_error="drop")
    assert p.dropped == 2 and list(p.kept) == [0, 3] and list(p.indices) == [5, 5]
    with pytest.raises(ValueError, match="on_error"):
        parse_batch(_batch(GOOD), on_error="ignore")


def test_batch_length_beyond_stride_is_rejected():
    b = _batch(GOOD)
    b.lengths[0] = wire.STRIDE + 1
    with pytest.raises(ValueError, match="lengths"):
        parse_batch(b)


def test_results_helpers_on_bad_results():
    r1 = packetize_results([5], [1], PMAP, job_id=1, round=0, scale_exp=1, partitions=[0])
    r2 = packetize_results([150], [1], PMAP, job_id=1, round=0, scale_exp=2, partitions=[1])
    both = wire.PacketBatch(np.concatenate([r1.data, r2.data]), np.concatenate([r1.lengths, r2.lengths]),
                            np.concatenate([r1.dest, r2.dest]))
    with pytest.raises(ValueError, match="disagree on scale_exp"):
        results_to_sparse(parse_batch(both))
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        results_to_dense(parse_batch(r2), 100)


# ---------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("method", ["exact", "fast"])
def test_nonfinite_gradients_raise_naming_count_and_index(bad, method):
    g = np.ones(100_000, np.float32)
    g[[12, 99_000]] = bad
    with pytest.raises(ValueError, match=r"2 non-finite .* first at index 12"):
        select_topk(g, 0.01, method)
    enc = RoundEncoder(len(g), 0.01, 2, method=method)
    with pytest.raises(ValueError, match="index 12"):
        enc.encode(g, 0)
    assert np.isfinite(enc.residual).all()  # the residual never holds NaN/Inf
    with pytest.raises(ValueError, match="index 12"):
        quantize(g, 0, 2)


def test_empty_tensors_give_empty_results():
    for method in ("exact", "fast"):
        idx, vals = select_topk(np.zeros(0, np.float32), 0.5, method)
        assert len(idx) == len(vals) == 0
    enc = RoundEncoder(0, 0.5, 2)
    er = enc.encode(np.zeros(0, np.float32), 3)
    assert len(er) == 0 and er.scale_exp == 3
    b = packetize(er.indices, er.values, PartitionMap(1), **ARGS)
    assert len(b) == 1 and wire.parse_packet(b.packet(0))[0].count == 0


def test_encoder_rejects_wrong_size_and_bad_density():
    enc = RoundEncoder(10, 0.5, 2)
    with pytest.raises(ValueError, match="11 entries, the encoder was made for 10"):
        enc.encode(np.zeros(11, np.float32), 0)
    with pytest.raises(ValueError, match="density"):
        RoundEncoder(10, 1.5, 2)
    with pytest.raises(ValueError, match="density"):
        RoundEncoder(10, -0.1, 2)
    with pytest.raises(ValueError, match="floating"):
        select_topk(np.array(["a"]), 0.5)


# ---------------------------------------------------------------------------------- CLI
def test_bench_host_cli_bad_arguments_are_one_line_errors(capsys):
    assert dosa_main(["bench", "host", "--numel", "0"]) == 2
    assert "--numel" in capsys.readouterr().err
    assert dosa_main(["bench", "host", "--density", "2"]) == 2


def test_bench_host_cli_small_run_writes_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    rc = dosa_main(["bench", "host", "--numel", "300000", "--repeat", "1", "--exact-repeat", "1",
                    "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("numel", "density", "k", "exact_ms", "fast_ms", "ratio_exact_over_fast", "fast_selected",
                "quantize_ms", "packetize_ms", "parse_ms", "packetize_plus_parse_ms", "targets"):
        assert key in r
    assert r["k"] == 3000 and r["targets"]["fast_selected_within_20pct_of_k"]
    assert "ratio exact/fast" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["exact", "fast"])
def test_residual_overflow_to_inf_is_rejected_and_residual_stays_finite(method):
    enc = RoundEncoder(100_000, 0.0, 2, method=method)
    big = np.zeros(100_000, np.float32)
    big[7] = 3e38
    enc.encode(big, 0)  # density 0: all of it stays in the residual
    with pytest.raises(ValueError, match="index 7"):
        enc.encode(big, 0)  # 3e38 + 3e38 overflows float32
    assert np.isfinite(enc.residual).all() and enc.residual[7] == np.float32(3e38)
