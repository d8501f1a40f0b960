"""`dosa demo --offload`: the augmentation and validation services run on the DPU (inside the DPU's
namespace on the testbed, pinned to the DPU CPUs), every host reads its shard from them, rank 0's
snapshots are validated there, and the summary compares the time per epoch with the same training
done on the hosts. Small sizes: what is checked is the wiring and the summary, not the speed-up
(wall-clock ratios are printed, never asserted)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch  # noqa: F401  (a required dependency: missing = an error, not a skip)
import sklearn  # noqa: F401

from dosa.app.demo import DemoConfig, run_demo  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _check_offload_section(o: dict, hosts: int, epochs: int) -> None:
    host, off = o["modes"]["host"], o["modes"]["offload"]
    print(f"host {host['seconds_per_epoch']:.3f} s/epoch, offloaded {off['seconds_per_epoch']:.3f} "
          f"s/epoch, ratio {o['ratio_offload_over_host']:.3f}, val acc {off['val_accuracy']:.4f}")
    for m in (host, off):
        assert 0 < m["seconds_per_epoch"] < 60 and len(m["epoch_seconds_rank0"]) == epochs
        assert 0.3 < m["val_accuracy"] <= 1.0, m["val_accuracy_per_epoch"]  # it learns
        assert len(m["val_accuracy_per_epoch"]) == epochs
        assert m["steps_per_epoch"] > 0 and m["batches"] == hosts * epochs * m["steps_per_epoch"]
    assert math.isclose(o["ratio_offload_over_host"],
                        off["seconds_per_epoch"] / host["seconds_per_epoch"])
    assert 0.05 < o["ratio_offload_over_host"] < 20
    # every batch of every host came from the DPU service, every validation ran there
    assert off["remote_batches"] == off["batches"] and off["local_batches"] == 0
    assert not off["fell_back"] and off["validated_on_dpu"] == epochs and not off["warnings"]
    assert host["remote_batches"] == 0 and host["local_batches"] == host["batches"]
    # the same batches from the same weights: both modes trained identically
    assert o["identical_training"] is True
    assert off["val_accuracy_per_epoch"] == host["val_accuracy_per_epoch"]
    # the services ran pinned to the DPU CPUs, disjoint from the hosts' CPUs
    if o["dpu_cpus"]:
        dpu = {int(c) for c in o["dpu_cpus"].split(",")}
        assert not dpu & {int(c) for c in o["host_cpus"].split(",")}
        for svc in o["services"]:
            assert len(svc["processes"]) == 2
            for p in svc["processes"]:
                assert set(p["cpus"]) == dpu and p["in_netns"] is True, p


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_offload_on_the_testbed_serves_every_batch_from_the_dpu_namespace(tmp_path):
    from testbed.testing import force_cleanup, unique_prefix

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--offload pins hosts and DPUs to disjoint CPUs: needs 2 CPUs")
    prefix = unique_prefix("do")
    cfg = DemoConfig(hosts=2, dpus=1, epochs=1, backend="testbed", out=str(tmp_path), timeout=100,
                     testbed_prefix=prefix, offload=True, offload_epochs=2,
                     tta_methods="")  # the time-to-accuracy stage has its own test (test_demo_testbed)
    pids = []
    try:
        s = run_demo(cfg, echo=lambda line: None)
        assert _namespaces(prefix) == [], "the demo left namespaces behind"
    finally:
        force_cleanup(prefix)
    assert s["backend"] == "testbed"
    written = json.loads((tmp_path / "demo.json").read_text())
    o = written["offload"]
    _check_offload_section(o, hosts=2, epochs=2)
    (svc,) = o["services"]
    assert svc["netns"] == f"{prefix}-d0"
    assert not svc["augment"].startswith("127.") and svc["augment"].split(":")[0] == \
        svc["validate"].split(":")[0], svc  # the DPU's fabric address, reached from the hosts
    pids = [p["pid"] for p in svc["processes"]]
    assert not any(_alive(p) for p in pids), "an offload service outlived the demo"
    # the dosa-vs-dense part still ran, through the DPU's dataplane
    assert s["runs"]["dosa"]["replicas_consistent"] and s["runs"]["dense"]["replicas_consistent"]
    assert sum(s["dpu_stats"]["d0"]["outcomes"].values()) > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_offload_on_loopback_through_the_cli_json(tmp_path):
    """No privilege: `dosa demo --backend loopback --offload --json` runs the services on 127.0.0.1
    (pinned to the second half of the CPUs) and prints the offload section."""
    out = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "dosa", "demo", "--backend", "loopback", "--hosts", "2",
                        "--epochs", "1", "--offload", "--offload-epochs", "2", "--out", str(out),
                        "--timeout", "100", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=115)
    assert p.returncode in (0, 1), p.stderr[-2000:]
    s = json.loads(p.stdout)
    assert p.returncode == (0 if s["within_target"] else 1)
    assert s["backend"] == "loopback"
    _check_offload_section(s["offload"], hosts=2, epochs=2)
    assert all(svc["netns"] is None and svc["augment"].startswith("127.0.0.1:")
               for svc in s["offload"]["services"])
    assert json.loads((out / "demo.json").read_text())["offload"]["modes"]["offload"]["local_batches"] == 0
