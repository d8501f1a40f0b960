"""The demo's training on loopback (no privilege): 4 DDP ranks with the dosa hook, summed by a real
userspace DPU worker, reach the dense Gloo accuracy within 1 point; the fallback is agreed across
ranks; a failing rank stops everything."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import torch  # noqa: F401  (a required dependency: missing = an error, not a skip)
import sklearn  # noqa: F401

from dosa.app.demo import DemoConfig, LoopbackCluster, run_demo, free_port  # noqa: E402
from dosa.app.demo.clusters import rank_base_env  # noqa: E402
from testbed.runner import run_ranks  # noqa: E402
from dosa.errors import DosaError  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_with_the_dosa_hook_reaches_dense_accuracy_within_one_point(tmp_path, monkeypatch):
    started = []
    orig = LoopbackCluster.start_workers

    def spy(self, *a, **kw):
        try:
            return orig(self, *a, **kw)
        finally:
            started.extend(p.pid for p in self.workers)

    monkeypatch.setattr(LoopbackCluster, "start_workers", spy)
    # small DDP buckets: several per step, so the hook's one-round-per-step concatenation is used
    cfg = DemoConfig(hosts=4, dpus=1, density=0.01, epochs=10, backend="loopback",
                     out=str(tmp_path), timeout=200, extra_train_args=["--bucket-cap-mb", "0.03"])
    s = run_demo(cfg, echo=lambda line: None)
    dosa, dense = s["runs"]["dosa"], s["runs"]["dense"]
    print(f"dosa {dosa['test_accuracy']:.4f} dense {dense['test_accuracy']:.4f} "
          f"gap {s['accuracy_gap_points']:+.2f} points")
    assert dosa["replicas_consistent"] and dense["replicas_consistent"]
    assert dense["test_accuracy"] > 0.9, "the dense baseline itself did not train"
    assert (dense["test_accuracy"] - dosa["test_accuracy"]) * 100 <= 1.0, s["accuracy_gap_points"]
    hooks = dosa["hook"]
    assert all(h["fallbacks"] == 0 and h["dosa_rounds"] == dosa["steps"] for h in hooks)
    assert all(h["buckets_per_step"] > 1 for h in hooks)
    assert all(abs(h["mean_density"] - 0.01) < 0.002 for h in hooks)
    # sparse traffic: far below the ring allreduce's volume
    assert dosa["bytes_per_step"] * 10 < dense["bytes_per_step"]
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["within_target"] is True and written["runs"]["dosa"]["steps"] == dosa["steps"]
    if s["plot"]:
        assert (tmp_path / "loss.png").stat().st_size > 1000
    assert started and not any(_alive(p) for p in started), "a DPU worker outlived the demo"


@pytest.mark.timeout(120)
def test_fallback_is_agreed_across_ranks_warns_once_and_still_trains(tmp_path):
    """Rank 0 can create its dosa client (a valid job config), rank 1 cannot (none): both must
    fall back together, each warning exactly once, and the model still trains."""
    with LoopbackCluster(hosts=2, dpus=1, numel=DemoConfig().numel, workdir=tmp_path,
                         echo=None) as cluster:
        specs = cluster.rank_specs(free_port(socket.SOCK_STREAM))
        del specs[1].env["DOSA_JOB_CONFIG"]
        out = tmp_path / "r{rank}.json"
        run_ranks(specs, [sys.executable, "-m", "examples.train_digits", "--comm", "dosa",
                          "--epochs", "2", "--quiet", "--json", str(out)], tmp_path, timeout=100, echo=False,
                  base_env=rank_base_env({"DOSA_CONTROL_ADDR": "", "DOSA_CONTROL_PORT": ""})).check()
    for r in range(2):
        log = (tmp_path / f"rank{r}.err").read_text()
        assert log.count("DosaUnavailableWarning") == 1, log
        run = json.loads(Path(str(out).replace("{rank}", str(r))).read_text())["runs"][0]
        assert run["hook"]["fallbacks"] == 1 and run["hook"]["dosa_rounds"] == 0
        assert run["hook"]["dense_steps"] == run["steps"]
        assert run["test_accuracy"] > 0.8 and run["replicas_consistent"]
    assert "unavailable on 1 other rank" in (tmp_path / "rank0.out").read_text() + (tmp_path / "rank0.err").read_text()


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_demo_clearly_and_stops_everything(tmp_path):
    cluster_pids = []
    cfg = DemoConfig(hosts=2, epochs=1, backend="loopback", out=str(tmp_path), timeout=100,
                     extra_train_args=["--lr", "-1"])  # every rank exits 2 at argument parsing
    orig_exit = LoopbackCluster.__exit__

    def spy_exit(self, *exc):
        cluster_pids.extend(p.pid for p in self.workers)
        return orig_exit(self, *exc)

    LoopbackCluster.__exit__ = spy_exit
    try:
        with pytest.raises(DosaError, match=r"rank \d failed \(exit status 2\)"):
            run_demo(cfg, echo=lambda line: None)
    finally:
        LoopbackCluster.__exit__ = orig_exit
    assert cluster_pids and not any(_alive(p) for p in cluster_pids)
    assert not (tmp_path / "demo.json").exists()


@pytest.mark.timeout(150)
def test_dosa_demo_cli_writes_its_files_and_its_exit_status_follows_the_target(tmp_path):
    """`dosa demo` end to end through the CLI (what `make demo` runs), short: 1 epoch on 2 hosts.
    Exit 0 exactly when dosa is within the target, 1 otherwise; 2 for bad arguments."""
    dosa = [sys.executable, "-m", "dosa", "demo"]
    bad = subprocess.run([*dosa, "--hosts", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--hosts must be between 2 and 64" in bad.stderr
    assert "Traceback" not in bad.stderr
    r = subprocess.run([*dosa, "--backend", "loopback", "--hosts", "2", "--epochs", "1", "--json",
                        "--out", str(tmp_path), "--timeout", "120"],
                       capture_output=True, text=True, timeout=140)
    summary = json.loads(r.stdout)
    assert r.returncode == (0 if summary["within_target"] else 1), r.stderr[-2000:]
    assert summary["backend"] == "loopback" and set(summary["runs"]) == {"dosa", "dense"}
    assert (tmp_path / "demo.json").exists()


def _procs_mentioning(text: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace") and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.timeout(120)
def test_ctrl_c_during_training_stops_every_process_the_demo_started(tmp_path):
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "dosa", "demo", "--backend", "loopback", "--hosts", "2",
                          "--epochs", "50", "--out", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in p.stdout:  # wait until the ranks are training
            seen.append(line)
            if line.startswith("[dosa] epoch 1/"):
                break
        assert _procs_mentioning(str(tmp_path)), "".join(seen)
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=60)[0]
        assert p.returncode == 130, rest
        assert "interrupted" in rest
        deadline = time.monotonic() + 10
        while _procs_mentioning(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _procs_mentioning(str(tmp_path)) == [], "ranks or DPU workers outlived Ctrl-C"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
