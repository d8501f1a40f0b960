"""`dosa demo` on a real namespace testbed (root): 4 hosts, 1 DPU with the XDP dataplane, DDP with
the dosa hook then dense Gloo; a short run (accuracy is checked on loopback, where it is cheaper).
The testbed must be gone afterwards."""
from __future__ import annotations

import json
import subprocess

import pytest

import torch  # noqa: F401  (a required dependency: missing = an error, not a skip)
import sklearn  # noqa: F401

from dosa.app.demo import DemoConfig, run_demo  # noqa: E402


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_demo_on_the_testbed_trains_through_the_xdp_dataplane_and_tears_down(tmp_path):
    from testbed.testing import force_cleanup, unique_prefix

    prefix = unique_prefix("dm")
    cfg = DemoConfig(hosts=4, dpus=1, epochs=2, backend="testbed", out=str(tmp_path), timeout=240,
                     testbed_prefix=prefix, tta_epochs=1)
    try:
        s = run_demo(cfg, echo=lambda line: None)
        assert _namespaces(prefix) == [], "the demo left namespaces behind"
    finally:
        force_cleanup(prefix)
    dosa, dense = s["runs"]["dosa"], s["runs"]["dense"]
    assert s["backend"] == "testbed"
    assert dosa["replicas_consistent"] and dense["replicas_consistent"]
    assert all(h["fallbacks"] == 0 and h["dosa_rounds"] == dosa["steps"] for h in dosa["hook"])
    assert dosa["test_accuracy"] > 0.5 and dense["test_accuracy"] > 0.5  # 2 epochs: it learns
    assert dosa["bytes_per_step"] * 10 < dense["bytes_per_step"]
    # the DPU's XDP dataplane merged the data packets (its counters, read through the control plane)
    d0 = s["dpu_stats"]["d0"]
    assert d0.get("attachments"), d0
    assert sum(d0["outcomes"].values()) > 0, d0
    assert json.loads((tmp_path / "demo.json").read_text())["backend"] == "testbed"
    # the time-to-accuracy story: both methods trained a full epoch on the shaped testbed, plotted
    tta = s["time_to_accuracy"]
    assert set(tta["methods"]) == {"dosa_sum", "gloo_dense"}
    assert all(m["steps"] > 0 and m["curve"] for m in tta["methods"].values())
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000


@pytest.mark.root
@pytest.mark.timeout(150)
def test_auto_backend_says_why_and_runs_on_loopback_when_the_testbed_cannot_come_up(tmp_path):
    """`make demo` (backend auto) must still show dosa working when the testbed fails to come up,
    and say so; an explicit --backend testbed fails instead."""
    from dosa.errors import DosaError

    bad = dict(hosts=2, epochs=1, out=str(tmp_path), timeout=120, testbed_prefix="Not A Prefix")
    with pytest.raises(DosaError, match="prefix"):
        run_demo(DemoConfig(backend="testbed", **bad), echo=lambda line: None)
    lines = []
    s = run_demo(DemoConfig(backend="auto", **bad), echo=lines.append)
    assert s["backend"] == "loopback" and "prefix" in s["testbed_error"]
    assert any("running on loopback instead" in line for line in lines)
    assert s["runs"]["dosa"]["hook"][0]["dosa_rounds"] == s["runs"]["dosa"]["steps"]
