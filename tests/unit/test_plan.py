"""``dosa plan`` (benchmarks/plan): the model's equations on cases worked by hand, the DPU costs'
file and fallback, the validation's comparison, and the command's JSON interface and plot."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.plan import costs as C
from benchmarks.plan import validate as V
from benchmarks.plan.model import Cluster, Workload, predict
from dosa import wire
from dosa.errors import DosaError

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _costs(**path) -> C.Costs:
    host = C.HostCosts(encode_ns_per_entry=1.0, packetize_ns_per_entry=4.0, intake_ns_per_result_entry=15.0,
                       fold_back_ns_per_sent_entry=10.0, round_ns=0.0, add_ns_per_entry=0.3, scatter_add_ns_per_entry=11.0, clear_ns_per_entry=7.0,
                       gloo_ring_ns_per_byte=0.6, gloo_allgather_ns_per_byte=1.4, tcp_loopback_ns_per_byte=0.3)
    p = dict(udp_send_ns_per_packet=700.0, udp_recv_ns_per_packet=200.0, tcp_ns_per_byte=0.5,
             dpu_rx_ns_per_packet=1000.0, dpu_tx_ns_per_copy=0.0)
    p.update(path)
    return C.Costs(host, C.load_dpu(None) if not (REPO / "docs/performance_dpu.json").exists() else
                   C.DpuCosts(20.0, 45.0, 17000.0, 20.7, source="test"), C.PathCosts(**p))


def test_a_link_bound_ring_takes_its_bytes_over_the_rate():
    c = Cluster(nodes=4, link_gbps=1.0, host_device="cuda", step_latency_s=0.0)
    p = predict("ring_allreduce", c, Workload("m", 10_000_000), _costs())
    assert p.bound == "link"
    assert p.round_s == pytest.approx(2 * 3 / 4 * 4e7 * 8 / 1e9)


def test_on_the_testbed_host_work_adds_up_over_the_hosts():
    w = Workload("m", 10_000_000)
    own = predict("ring_allreduce", Cluster(nodes=4, link_gbps=1000.0, step_latency_s=0.0), w, _costs())
    shared = predict("ring_allreduce", Cluster(nodes=4, link_gbps=1000.0, shared_host_cores=1,
                                               step_latency_s=0.0), w, _costs())
    assert own.bound == shared.bound == "host"
    assert shared.round_s == pytest.approx(4 * own.round_s)


def test_dosa_traffic_is_the_wire_format_and_one_wave_adds_the_stages_up():
    w = Workload("m", 4 * wire.DEFAULT_PARTITION_SIZE, density=0.01, union_fraction=0.5, slots=64)
    c = Cluster(nodes=2, link_gbps=1.0, dpu_cores=1, dpu_link_gbps=math.inf, step_latency_s=0.0)
    p = predict("dosa_sum", c, w, _costs()).parts
    k_p = round(0.01 * wire.DEFAULT_PARTITION_SIZE)
    sparse, _ = wire.encoded_bytes(k_p, wire.DEFAULT_PARTITION_SIZE, wire.MAX_MTU)
    assert p["bytes_out_per_node"] == pytest.approx(4 * int(sparse))
    assert p["waves"] == 1  # 4 partitions, 64 slots: all in flight at once
    stages = [p[s] for s in ("host_s", "link_out_s", "link_in_s", "dpu_link_s", "dpu_cores_s")]
    assert p["network_s"] == pytest.approx(sum(stages))  # nothing to overlap with in one wave
    many = predict("dosa_sum", c, Workload("m", 640 * wire.DEFAULT_PARTITION_SIZE, slots=64), _costs()).parts
    assert many["waves"] == 10
    top = max(many[s] for s in ("host_s", "link_out_s", "link_in_s", "dpu_link_s", "dpu_cores_s"))
    assert top < many["network_s"] < top * 1.5


def test_gtopk_returns_less_than_sum_and_nodes_of_several_ranks_split_the_host_work():
    w = Workload("m", 25_600_000)
    c = Cluster(nodes=16, ranks_per_node=1, link_gbps=25.0, dpus=16)
    s, g = predict("dosa_sum", c, w, _costs()), predict("dosa_gtopk", c, w, _costs())
    assert g.parts["bytes_in_per_node"] < s.parts["bytes_in_per_node"]
    c8 = Cluster(nodes=16, ranks_per_node=8, link_gbps=25.0, dpus=16)
    s8 = predict("dosa_sum", c8, w, _costs())
    assert s8.parts["host_s"] == pytest.approx(s.parts["host_s"] / 8, rel=0.01)  # (partitions a slice job)
    assert s8.parts["intra_node_s"] > 0 and s.parts["intra_node_s"] == 0
    assert s8.parts["bytes_out_per_node"] == pytest.approx(s.parts["bytes_out_per_node"], rel=0.02)
    with pytest.raises(ValueError, match="unknown method"):
        predict("carrier_pigeon", c, w, _costs())


def test_dpu_costs_come_from_the_bench_file_or_a_labelled_fallback(tmp_path):
    f = tmp_path / "dpu.json"
    f.write_text(json.dumps({"xdp_merge_ns_per_entry": 3.0, "completion_ns_per_result_entry": 9.0,
                             "settle_ns_per_partition": 1000.0, "userspace_merge_ns_per_entry": 5.0,
                             "other": 1}))
    d = C.load_dpu(str(f))
    assert (d.xdp_merge_ns_per_entry, d.completion_ns_per_result_entry, d.source) == (3.0, 9.0, str(f))
    f.write_text(json.dumps({"xdp_merge_ns_per_entry": 3.0}))
    with pytest.raises(DosaError, match="lack completion_ns_per_result_entry"):
        C.load_dpu(str(f))
    with pytest.raises(DosaError, match="cannot read the DPU costs"):
        C.load_dpu(str(tmp_path / "missing.json"))
    if not C.DEFAULT_DPU_COSTS.exists():
        d = C.load_dpu(None)
        assert d.source == "fallback" and d.xdp_merge_ns_per_entry == 20.0
        assert all(d.notes[k] for k in C.DPU_KEYS)


def test_validation_compares_each_setting_with_the_median_of_its_runs():
    setup = V.ValidationSetup(link_rates=("1gbit",), hosts=(2,), numel=1_000_000, repeat=3,
                              methods=("ring_allreduce",))

    def doc(s):
        return {"runs": [{"hosts": 2, "overlap": {"union_over_total": 0.8},
                          "methods": {"gloo_dense": {"median_s": s}}}]}
    costs = _costs()
    pred = predict("ring_allreduce", Cluster(nodes=2, link_gbps=1.0, dpu_cores=1, dpu_link_gbps=math.inf,
                                             shared_host_cores=1), Workload("v", 1_000_000), costs).round_s
    docs = {("1gbit", "sum"): [doc(pred * 0.5), doc(pred * 1.1), doc(pred * 3)]}
    (c,) = V.compare(setup, docs, lambda rate: costs, shared_host_cores=1)
    assert {k: c[k] for k in ("link", "hosts", "method")} == {"link": "1gbit", "hosts": 2, "method": "ring_allreduce"}
    assert c["measured_s"] == pytest.approx(pred * 1.1) and c["ok"]
    docs = {("1gbit", "sum"): [doc(pred * 2)]}
    (c,) = V.compare(setup, docs, lambda rate: costs, shared_host_cores=1)
    assert not c["ok"] and "NOT kept" in V.format_checks([c])
    assert V.rate_gbps("500mbit") == 0.5
    with pytest.raises(DosaError, match="a link rate is a number"):
        V.rate_gbps("fast")


def test_the_command_writes_the_predictions_interface_and_a_plot(tmp_path):
    costs = _costs()
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"costs": costs.as_dict()}))
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    p = subprocess.run([sys.executable, "-m", "dosa", "plan", "--host-costs", str(earlier), "--json", str(out),
                        "--plot", str(png), "--model", "tiny:1e6", "--nodes", "4", "--link-gbps", "10,100"],
                       cwd=REPO, capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    preds = doc["predictions"]
    assert len(preds) == 2 * 4  # two link rates x four methods
    for r in preds:
        assert {"model", "numel", "link_gbps", "nodes", "method", "round_s", "bound"} <= set(r)
        assert r["model"] == "tiny" and r["numel"] == 1_000_000 and r["nodes"] == 4 and r["round_s"] > 0
    assert {r["method"] for r in preds} == {"dosa_sum", "dosa_gtopk", "ring_allreduce", "sparse_allgather"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "tiny" in p.stdout and "dosa_sum" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "dosa", "plan", "--host-costs", str(earlier), "--nodes", "65"],
                         cwd=REPO, capture_output=True, text=True, timeout=50)
    assert bad.returncode == 2 and "at most 64 workers" in bad.stderr
