"""Testbed lifecycle: DPU services supervised (readiness, CPU pinning, killed by down), down leaves
nothing -- also after ``up`` was SIGKILLed --, a second up is refused.

The DPU-side processes here are stand-ins (``fake_services``, plugged in exactly the way
DOSA_TESTBED_SERVICES plugs in any DPU side): what is under test is the supervision, not them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dosa.errors import DosaError
from testbed import config, ns
from testbed.core import Testbed
from testbed.services import ServiceSpec
from testbed.testing import force_cleanup, scratch_testbed, unique_prefix

pytestmark = [pytest.mark.root, pytest.mark.timeout(90)]

# a TCP "control plane" answering "ok <addr>" to every connection
CTL = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
while True:
    c, _ = s.accept(); c.sendall(b"ok " + sys.argv[1].encode()); c.close()
"""
# a "DPU worker" that signals readiness with a file (unless told never to)
WORKER = r"""
import pathlib, sys, time
time.sleep(0.2)
if sys.argv[2] != "never":
    pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(3600)
"""


def fake_services(ctx):
    ready = f"{ctx.run_dir}/{ctx.index}.ready"
    return [ServiceSpec("ctl", [sys.executable, "-c", CTL, ctx.address, str(ctx.control_port)],
                        ready=("tcp", ctx.control_port)),
            ServiceSpec("dpu", [sys.executable, "-c", WORKER, ready,
                                os.environ.get("FAKE_WORKER_READY", "yes")], ready=("file", ready))]


def _leftovers(prefix: str, state_dir: Path) -> list[str]:
    rx = config.ns_regex(prefix)
    left = [f"namespace {n}" for n in ns.list_netns() if rx.match(n)]
    if config.state_file(prefix, state_dir).exists():
        left.append("state file")
    if config.pin_dir(prefix).exists():
        left.append("pin dir")
    if config.run_dir(prefix, state_dir).exists():
        left.append("run dir")
    return left


def test_services_start_ready_pinned_and_down_removes_everything(tmp_path):
    prefix = unique_prefix()
    tb = Testbed(prefix=prefix, state_dir=tmp_path, services=fake_services)
    try:
        st = tb.up(2, 2, cpu_split=True)
        procs = st["processes"]
        assert [p["name"] for p in procs] == ["d0-ctl", "d1-ctl", "d0-dpu", "d1-dpu"]
        assert all(p["alive"] for p in procs)
        # the control plane of DPU 0 is reachable from a host at DOSA_CONTROL_ADDR:PORT
        env = tb.job_env(1)
        p = tb.exec_in("h1", [sys.executable, "-c",
                              "import os, socket; s = socket.create_connection((os.environ['DOSA_CONTROL_ADDR'],"
                              " int(os.environ['DOSA_CONTROL_PORT'])), timeout=5); print(s.recv(64).decode())"],
                       env=env, check=True, timeout=20)
        assert p.stdout.strip() == f"ok {env['DOSA_CONTROL_ADDR']}"
        # --cpu-split: DPU processes on the DPU CPUs, host commands on the host CPUs, disjoint
        host_cpus, dpu_cpus = st["config"]["host_cpus"], st["config"]["dpu_cpus"]
        assert host_cpus and dpu_cpus and not set(host_cpus) & set(dpu_cpus)
        for pr in procs:
            assert sorted(os.sched_getaffinity(pr["pid"])) == dpu_cpus
        r = tb.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                   echo=False, log_dir=tmp_path / "logs").check()
        for rank in r.ranks:
            assert Path(rank.stdout_path).read_text().strip() == str(host_cpus)
        # a pinned-map directory like the control plane makes; down must remove it
        config.pin_dir(prefix).joinpath("d0").mkdir(parents=True)
        pids = [(p["pid"], ns.proc_start_time(p["pid"])) for p in procs]
        report = tb.down()
        assert report["pin_dir_removed"] and report["state_file_removed"]
        assert not any(ns.alive(*p) for p in pids)
        assert _leftovers(prefix, tmp_path) == []
        tb.down()  # idempotent
        assert _leftovers(prefix, tmp_path) == []
    finally:
        force_cleanup(prefix)
        if config.pin_dir(prefix).exists():
            subprocess.run(["rm", "-rf", str(config.pin_dir(prefix))])


def test_down_cleans_up_after_up_was_killed_with_sigkill(tmp_path):
    prefix = unique_prefix()
    env = {**os.environ, "DOSA_TESTBED_PREFIX": prefix, "DOSA_TESTBED_STATE_DIR": str(tmp_path),
           "DOSA_TESTBED_SERVICES": "test_testbed_lifecycle:fake_services",
           "FAKE_WORKER_READY": "never",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    state_path = config.state_file(prefix, tmp_path)
    up = subprocess.Popen([sys.executable, "-m", "dosa", "testbed", "up", "--hosts", "2", "--dpus", "1",
                           "--ready-timeout", "120"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # wait until up is blocked waiting for the never-ready worker: both services are running
        deadline = time.monotonic() + 40
        procs = []
        while time.monotonic() < deadline and up.poll() is None:
            try:
                procs = json.loads(state_path.read_text())["processes"]
            except (OSError, ValueError, KeyError):
                procs = []
            if len(procs) == 2:
                break
            time.sleep(0.05)
        assert len(procs) == 2, f"up did not get to its services: {up.stderr.read() if up.poll() else ''}"
        up.send_signal(signal.SIGKILL)
        up.wait()
        pids = [(p["pid"], p["start_time"]) for p in procs]
        assert all(ns.alive(*p) for p in pids)  # orphans, still in the DPU namespace
        # a stale state file is not needed: remove it, down must find everything by name
        state_path.unlink()
        d = subprocess.run([sys.executable, "-m", "dosa", "testbed", "down"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert d.returncode == 0, d.stderr
        assert "removed 4 namespace(s)" in d.stdout
        assert not any(ns.alive(*p) for p in pids)
        assert _leftovers(prefix, tmp_path) == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        force_cleanup(prefix)


def test_second_up_is_refused_with_a_hint_to_run_down(tmp_path):
    with scratch_testbed(hosts=1, dpus=0, services=False) as tb:
        with pytest.raises(DosaError, match=r"already up .*`dosa testbed down --prefix"):
            Testbed(prefix=tb.prefix, state_dir=tb.state_dir).up(1, 0, services=False)
        assert tb.status()["up"]  # the refused attempt did not harm the running testbed


def test_failing_service_fails_up_with_its_log_and_leaves_nothing(tmp_path):
    def broken(ctx):
        return [ServiceSpec("ctl", [sys.executable, "-c", "import sys; sys.exit('no such dataplane')"],
                            ready=("tcp", ctx.control_port))]

    prefix = unique_prefix()
    tb = Testbed(prefix=prefix, state_dir=tmp_path, services=broken)
    try:
        with pytest.raises(DosaError, match=r"d0-ctl exited with status 1 .*no such dataplane"):
            tb.up(1, 1)
        assert _leftovers(prefix, tmp_path) == []
    finally:
        force_cleanup(prefix)
