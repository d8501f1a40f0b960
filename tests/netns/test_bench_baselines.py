"""The benchmark at tiny sizes: real Gloo processes (loopback, and a testbed's host namespaces), the
raw packet-rate measurement over a veth pair, and the JSON document ``dosa bench allreduce`` writes.
Every method's result is checked against the float64 reference sum by every rank."""
from __future__ import annotations

import json
import subprocess

import pytest

from dosa import wire
from benchmarks.allreduce import baselines as B
from benchmarks.allreduce import gradients as G
from benchmarks.allreduce import limit as L
from benchmarks.allreduce import report as R

import torch  # noqa: F401  (a required dependency: missing = an error, not a skip)


@pytest.mark.timeout(90)  # ~15 s on an idle machine: mostly 3 processes importing torch
def test_bench_cli_loopback_schema_and_sums(tmp_path, capsys):
    """`dosa bench allreduce` without the dosa paths: 3 Gloo processes on loopback, 10k entries;
    JSON/PNG written, the table printed, every method checked against the reference sum."""
    from dosa.app.cli import main

    rc = main(["bench", "allreduce", "--paths", "", "--hosts", "3", "--numel", "10000", "--density",
               "0.02", "--rounds", "2", "--warmup", "1", "--packet-rate-seconds", "0", "--timeout", "80",
               "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    assert "gloo_sparse_allgather" in out and "overlap" in err  # table on stdout, progress on stderr
    disk = json.loads((tmp_path / "b.json").read_text())
    R.validate(disk)
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    run = disk["runs"][0]
    assert run["hosts"] == 3 and set(run["methods"]) == {*B.METHODS, "limit"}
    assert set(disk["methods"]) == set(run["methods"])
    assert 0 < run["overlap"]["mean_pairwise_jaccard"] < 1
    for name in B.METHODS:
        rec = run["methods"][name]
        assert rec["check"]["ok"] and rec["check"]["ranks_checked"] == 3, rec["check"]
        for ph in ("transport", "end_to_end"):
            assert len(rec[ph]["rounds_s"]) == 2
            assert 0 < rec[ph]["min_s"] <= rec[ph]["median_s"] <= rec[ph]["max_s"]
        assert rec["bytes_per_host"]["sent"] > 0
    assert run["methods"]["gloo_sparse_allgather"]["check_end_to_end"]["ok"]
    assert run["methods"]["gloo_dense"]["bytes_per_host"]["sent"] == round(2 * 2 / 3 * 10_000 * 4)


@pytest.mark.root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mtu", [wire.DEFAULT_MTU, wire.MAX_MTU])
def test_packet_rate_over_own_veth_pair(mtu):
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    pr = L.measure_packet_rate(0.3, mtu=mtu)
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert pr["sent"] > 1000 and 0 < pr["received"] <= pr["sent"]
    assert pr["pps"] > 0 and pr["gbit_s"] > 0
    assert pr["payload_bytes"] == wire.max_udp_payload(mtu)  # full-size datagrams of the job's MTU
    assert not {n for n in after - before if n.startswith("dpr")}  # its namespaces are gone


@pytest.mark.root
@pytest.mark.timeout(90)
def test_baselines_in_testbed_namespaces():
    """2 ranks, each in its own host namespace of a shaped testbed: results still equal the sum."""
    from testbed.core import Testbed

    tb = Testbed(prefix="tbench")
    tb.down()  # a previous crashed run of this test
    tb.up(hosts=2, dpus=1, link_rate="1gbit", cpu_split=True, services=False)
    wd = None
    try:
        wd = B.prepare_workdir(G.make_gradients(2, 10_000, 0.5), 0.05)
        res = B.run_baselines(wd, rounds=2, warmup=1, testbed=tb, timeout=70, progress=lambda m: None)
        for name in B.METHODS:
            assert res[name]["check"]["ok"], res[name]["check"]
    finally:
        tb.down()
        if wd is not None:
            B._rm_workdir(wd)
    assert not tb.existing_namespaces()


@pytest.mark.root
@pytest.mark.timeout(150)
def test_bench_cli_with_dosa_xdp(tmp_path, capsys):
    """The joined command: dosa's XDP path (benchmarks.allreduce.dosa_paths, its own testbed) beside the baselines on a
    shaped testbed; every method's result verified, ratios to dosa_xdp present."""
    from dosa.app.cli import main

    rc = main(["bench", "allreduce", "--paths", "xdp", "--hosts", "2", "--numel", "20000",
               "--rounds", "2", "--warmup", "1", "--link-rate", "1gbit", "--testbed",
               "--testbed-prefix", "tbjoin", "--packet-rate-seconds", "0.3", "--timeout", "100",
               "--json", str(tmp_path / "j.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    doc = json.loads((tmp_path / "j.json").read_text())
    R.validate(doc)
    ms = doc["methods"]
    assert set(ms) == {"dosa_xdp", *B.METHODS, "limit"}
    for name in ("dosa_xdp", *B.METHODS):
        assert ms[name]["check"]["ok"], (name, ms[name]["check"])
        assert "transport" in ms[name]["ratio_to_dosa_xdp"]
    assert ms["dosa_xdp"]["ratio_to_dosa_xdp"]["transport"] == 1.0
    # dosa end to end (dense gradient in, selection + error feedback, dense sum out), checked exactly
    assert ms["dosa_xdp"]["check_end_to_end"]["ok"], ms["dosa_xdp"]["check_end_to_end"]
    assert ms["dosa_xdp"]["check_end_to_end"]["rounds_checked"] == 2 * 3
    assert ms["dosa_xdp"]["ratio_to_dosa_xdp"]["end_to_end"] == 1.0
    assert ms["limit"]["packet_rate_pps"] > 0
