"""benchmarks.allreduce without processes or namespaces: gradients, overlap, saved files, the traffic model
behind ``limit`` (checked against the real packetizer), the reference check and the report."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dosa import wire
from dosa import packetizer
from benchmarks.allreduce import baselines as B
from benchmarks.allreduce import gradients as G
from benchmarks.allreduce import limit as L
from benchmarks.allreduce import report as R

pytestmark = pytest.mark.timeout(60)


def test_deterministic_and_per_host_consistent():
    a = G.make_gradients(3, 5000, 0.4, seed=7)
    b = G.make_gradients(3, 5000, 0.4, seed=7)
    c = G.make_gradients(3, 5000, 0.4, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], a[1])
    np.testing.assert_array_equal(G.host_gradient(2, 3, 5000, 0.4, seed=7), a[2])
    assert all(g.dtype == np.float32 and g.shape == (5000,) for g in a)


@pytest.mark.parametrize("c", [0.0, 0.5, 0.9])
def test_correlation_between_hosts_is_the_one_asked(c):
    n = 200_000
    g = G.make_gradients(2, n, c, seed=1)
    s = G.layer_scales(n, seed=1)
    x, y = g[0] / s, g[1] / s  # undo the common layer scale: what remains is the mixture
    r = np.corrcoef(x, y)[0, 1]
    assert abs(r - c) < 0.05, r


def test_heavy_tails():
    g = G.make_gradients(1, 200_000, 0.5, seed=2)[0] / G.layer_scales(200_000, seed=2)
    kurt = np.mean(g.astype(np.float64) ** 4) / np.mean(g.astype(np.float64) ** 2) ** 2
    assert kurt > 6  # a Gaussian has 3


def test_overlap_grows_with_correlation():
    n, k = 100_000, 1000
    jac = []
    for c in (0.0, 0.5, 0.95, 1.0):
        sets = [G.topk_indices(g, k) for g in G.make_gradients(4, n, c, seed=3)]
        jac.append(G.overlap_stats(sets)["mean_pairwise_jaccard"])
    assert jac[0] < jac[1] < jac[2] < jac[3] == 1.0


def test_overlap_stats_known_sets():
    st = G.overlap_stats([np.array([1, 2, 3, 4]), np.array([3, 4, 5, 6])])
    assert st["mean_pairwise_jaccard"] == pytest.approx(2 / 6)
    assert st["union"] == 6 and st["union_over_total"] == pytest.approx(6 / 8)


def test_topk_exact():
    g = np.array([0.1, -5, 3, 0.2, -4, 1], np.float32)
    np.testing.assert_array_equal(G.topk_indices(g, 3), [1, 2, 4])
    with pytest.raises(ValueError):
        G.topk_indices(g, 0)


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_save_load_roundtrip(tmp_path, suffix):
    gr = G.make_gradients(3, 1000, 0.3)
    p = G.save_gradients(tmp_path / f"g{suffix}", gr)
    back = G.load_gradients(p)
    assert len(back) == 3
    for x, y in zip(gr, back):
        np.testing.assert_array_equal(x, y)


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        G.load_gradients(tmp_path / "nope.npz")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a .npz"):
        G.load_gradients(tmp_path / "junk.pt")
    np.savez(tmp_path / "uneven.npz", a=np.zeros(3, np.float32), b=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="different lengths"):
        G.load_gradients(tmp_path / "uneven.npz")
    np.savez(tmp_path / "nan.npz", a=np.array([np.nan], np.float32))
    with pytest.raises(ValueError, match="NaN"):
        G.load_gradients(tmp_path / "nan.npz")


def test_npz_keys_in_natural_order(tmp_path):
    arrs = {f"host{i}": np.full(2, i, np.float32) for i in range(12)}
    np.savez(tmp_path / "g.npz", **arrs)
    back = G.load_gradients(tmp_path / "g.npz")
    assert [int(b[0]) for b in back] == list(range(12))


def test_real_model_gradients_are_correlated(tmp_path):
    gr = G.real_model_gradients(world=3, steps=2, hidden=(32,))
    assert len(gr) == 3 and len({len(g) for g in gr}) == 1
    assert len(gr[0]) == 64 * 32 + 32 + 32 * 10 + 10
    assert all(np.isfinite(g).all() for g in gr)
    r = np.corrcoef(gr[0], gr[1])[0, 1]
    assert 0.05 < r < 0.9999  # same model, different data: related, not equal
    back = G.load_gradients(G.save_gradients(tmp_path / "real.pt", gr))
    np.testing.assert_array_equal(back[1], gr[1])


@pytest.mark.parametrize("mtu", [wire.DEFAULT_MTU, wire.MAX_MTU])
def test_dosa_traffic_matches_the_packetizer(mtu):
    numel, psize = 300_000, 1 << 14
    gr = G.make_gradients(3, numel, 0.5, seed=4)
    sets = [G.topk_indices(g, 3000) for g in gr]
    tr = L.dosa_traffic(sets, numel, dpus=2, partition_size=psize, multicast=False, mtu=mtu)
    pmap = wire.PartitionMap(numel, psize, 2)
    for h, idx in zip(tr["hosts"], sets):
        b = packetizer.packetize(idx.astype(np.uint32), np.ones(len(idx), np.int32), pmap,
                                 job_id=1, worker_id=0, round=0, scale_exp=0, mtu=mtu)
        assert h["packets_out"] == len(b)
        wire_bytes = int(b.lengths.sum()) + len(b) * (wire.ETH_HDR_LEN + wire.IPV4_HDR_LEN + wire.UDP_HDR_LEN)
        assert h["bytes_out"] == wire_bytes
    union = np.unique(np.concatenate(sets))
    rb = packetizer.packetize_results(union.astype(np.uint32), np.ones(len(union), np.int32), pmap,
                                      job_id=1, round=0, scale_exp=0, mtu=mtu)
    assert tr["hosts"][0]["packets_in"] == len(rb)
    assert tr["result_entries"] == len(union)
    assert sum(d["packets_out"] for d in tr["dpus"]) == 3 * len(rb)  # unicast fan-out
    lim = L.link_limit(tr, "1gbit", packet_rate=1e5)
    busiest = max(max(h["bytes_out"], h["bytes_in"]) for h in tr["hosts"])
    assert lim["link_s"] == pytest.approx(busiest * 8 / 1e9)
    assert lim["packets_s"] == pytest.approx(max(d["packets_out"] for d in tr["dpus"]) / 1e5)
    assert lim["median_s"] == max(lim["link_s"], lim["packets_s"])
    mc = L.dosa_traffic(sets, numel, dpus=2, partition_size=psize, mtu=mtu)  # multicast: one copy a packet
    assert sum(d["packets_out"] for d in mc["dpus"]) == len(rb)


def test_parse_rate():
    assert L._parse_rate("1gbit") == 1e9 and L._parse_rate("100mbit") == 1e8
    assert L._parse_rate(None) is None
    with pytest.raises(ValueError):
        L._parse_rate("fast")


def test_reference_check_catches_a_wrong_sum():
    gr = G.make_gradients(3, 1000, 0.5)
    ref = G.dense_reference(gr)
    absx = np.sum([np.abs(g) for g in gr], axis=0).astype(np.float32)
    good = (gr[2] + gr[1] + gr[0]).astype(np.float32)
    assert B._check(good, ref, absx, 3)["ok"]
    bad = good.copy()
    bad[17] += 1e-3 * max(1e-6, abs(bad[17]))
    bad[18] = 0.0 if abs(good[18]) > 1e-6 else 1.0
    assert not B._check(bad, ref, absx, 3)["ok"]


def _doc():
    def rec(t):
        return {"transport": {"median_s": t, "min_s": t * 0.9, "max_s": t * 1.2, "rounds_s": [t]},
                "end_to_end": {"median_s": 2 * t, "min_s": 2 * t, "max_s": 2 * t, "rounds_s": [2 * t]},
                "check": {"ok": True}, "bytes_per_host": {"sent": 10, "received": 20}}
    runs = [{"hosts": h, "methods": {"dosa_xdp": rec(0.01 * h), "gloo_dense": rec(0.1 * h),
                                     "limit": {"median_s": 0.005}}} for h in (2, 4)]
    return R.document({"numel": 100, "density": 0.01}, runs)


def test_report_ratios_table_plot(tmp_path):
    doc = _doc()
    R.validate(doc)
    assert doc["methods"]["gloo_dense"]["ratio_to_dosa_xdp"]["transport"] == pytest.approx(10)
    assert doc["methods"]["limit"]["ratio_to_dosa_xdp"]["transport"] == pytest.approx(0.125)
    t = R.table(doc)
    assert "10.00" in t and "against hosts" in t
    R.write_json(doc, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["schema"] == R.SCHEMA
    png = R.plot(doc, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_validate_rejects_broken_docs():
    doc = _doc()
    doc["runs"][0]["methods"]["gloo_dense"]["transport"]["min_s"] = 1.0
    with pytest.raises(ValueError, match="min <= median"):
        R.validate(doc)
    with pytest.raises(ValueError, match="schema"):
        R.validate({"schema": "x"})


def test_real_model_size_follows_numel():
    for n in (5_000, 1_000_000, 25_000_000):
        got = G.mlp_numel(G.hidden_for_numel(n))
        assert abs(got - n) / n < 0.02, (n, got)
    with pytest.raises(ValueError):
        G.hidden_for_numel(10)


def test_torch_saved_list_of_numpy_arrays(tmp_path):
    import torch
    gr = G.make_gradients(2, 300, 0.5)
    torch.save(gr, tmp_path / "np.pt")
    back = G.load_gradients(tmp_path / "np.pt")
    np.testing.assert_array_equal(back[1], gr[1])
    torch.save({"not": "a list"}, tmp_path / "dict.pt")
    with pytest.raises(ValueError, match="list of per-host"):
        G.load_gradients(tmp_path / "dict.pt")
