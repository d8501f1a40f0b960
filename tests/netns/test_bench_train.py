"""``dosa bench train`` at a small size (a few steps per method on a 2-host testbed): the JSON has the
issue's schema and every method really trained (not a timed assertion)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
METHODS = ("dosa_sum", "dosa_gtopk", "gloo_dense", "gloo_sparse_allgather", "powersgd")


def test_small_bench_train_writes_the_schema_and_every_method_trains(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    p = subprocess.run([sys.executable, "-m", "dosa", "bench", "train", "--hosts", "2", "--max-steps", "6",
                        "--eval-every", "3", "--blocking-steps", "3", "--json", str(out), "--plot", str(png)],
                       cwd=REPO, capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[1/6] dosa_sum" in p.stdout and "step 6/6" in p.stdout  # progress while it runs
    r = json.loads(out.read_text())
    assert set(r["methods"]) == set(METHODS)
    assert r["target_accuracy"] == pytest.approx(r["methods"]["gloo_dense"]["final_accuracy"] - 0.5)
    for name, m in r["methods"].items():
        for key in ("final_accuracy", "time_to_target_s", "curve", "bytes_per_step"):
            assert key in m, (name, key)
        assert m["steps"] == 6 and [c["step"] for c in m["curve"]] == [3, 6], name
        assert m["bytes_per_step"] > 0 and m["replicas_identical"], name
        assert m["time_to_target_s"] is None or m["time_to_target_s"] <= m["curve"][-1]["wall_s"]
        first = m["curve"][0]
        assert first["wall_s"] > 0 and 0 <= first["accuracy"] <= 100
    for dosa in ("dosa_sum", "dosa_gtopk"):
        h = r["methods"][dosa]["hook"]
        assert h["overlap"] and h["rounds"] == 6 and h["buckets_per_step"] > 1
    ov = r["overlap"]
    assert ov["hook_block_s_per_step_overlap"] > 0 and ov["hook_block_s_per_step_blocking"] > 0
    assert set(r["ratios"]) == {"dosa_sum", "dosa_gtopk"}
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_time_to_target_is_the_first_evaluation_at_or_above_it_and_null_when_never():
    from benchmarks.train import summarize

    def rec(accs):
        return {"final_accuracy": accs[-1], "step_seconds_median": 0.1, "numel": 10,
                "curve": [{"step": i + 1, "wall_s": float(i + 1), "accuracy": a} for i, a in enumerate(accs)]}

    r = summarize({"gloo_dense": rec([50, 90, 96]), "dosa_sum": rec([80, 95.5, 95.0]),
                   "powersgd": rec([10, 20, 30])})
    assert r["target_accuracy"] == 95.5
    assert r["methods"]["gloo_dense"]["time_to_target_s"] == 3.0
    assert r["methods"]["dosa_sum"]["time_to_target_s"] == 2.0
    assert r["methods"]["powersgd"]["time_to_target_s"] is None
    q = r["ratios"]["dosa_sum"]
    assert q["ttt_over_dense"] == pytest.approx(2 / 3, abs=1e-3) and q["ttt_over_powersgd"] is None
    assert q["accuracy_gap_vs_dense"] == -1.0
