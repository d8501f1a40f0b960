"""``dosa deploy --inventory F`` for real: sshd in every testbed namespace, an inventory of those
addresses with a key made for this test (and ``tls = true``), the deploy run from h0 (the
operator's machine is one of the hosts), training started over ssh on each host with torchrun
through the deployed DPU side -- its control plane serving HTTPS with the deploy's CA and taking
only calls signed with the deploy's secret --, ``--stop``, and nothing left behind (no sshd,
namespace, key, pin or service process).

One machine shares one file system, so the "remote" checkout is a directory here and its setup
reuses this checkout's virtual environment (docs/testbed.md says what that leaves untested)."""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import deploy, ns
from testbed.sshd import SshLab
from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
# `make setup` minus what would install the same packages into the same place a second time: the
# deployed copy gets this checkout's venv and builds its own Cython extensions
SETUP = f"ln -sfn {shlex.quote(str(REPO / '.venv'))} .venv && .venv/bin/python setup.py -q build_ext --inplace"


def _dosa(tb, node: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return tb.exec_in(node, [sys.executable, "-m", "dosa", *args], timeout=timeout)


def _sshd_pids(lab_dir: str) -> list[int]:
    p = subprocess.run(["pgrep", "-f", f"sshd .*{lab_dir}"], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


def test_deploy_over_ssh_trains_through_the_deployed_dpu_and_leaves_nothing(tmp_path):
    remote = tmp_path / "remote"
    with scratch_testbed(hosts=2, dpus=1, services=False) as tb:
        with SshLab(tb) as lab:
            lab_dir = str(lab.dir)
            inv_path = lab.write_inventory(tmp_path / "inventory.toml", remote_dir=remote, setup=SETUP, source=REPO,
                                           tls=True)
            inv = deploy.load_inventory(inv_path)

            p = _dosa(tb, "h0", "deploy", "--inventory", str(inv_path))
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
            assert "deployed to 2 host(s) and 1 DPU(s)" in p.stdout
            # the services run in d0's namespace, from the deployed copy, with XDP on d0's eth0
            run_dir = Path(inv.run_dir)
            pids = {s: int((run_dir / f"{s}.pid").read_text()) for s in ("ctl", "dpu")}
            d0_pids = set(ns.netns_pids(tb.namespace("d0")))
            for s, pid in pids.items():
                assert pid in d0_pids, f"{s} (pid {pid}) is not in d0's namespace"
                assert os.readlink(f"/proc/{pid}/cwd") == str(remote)
            assert (remote / "host_lib").is_dir() and list((remote / "dosa").glob("_net*.so"))
            assert any(i["xdp"] for i in tb.status()["nodes"][2]["interfaces"])
            # the credentials: private files, the hosts' with the host key only
            keys = Path(inv.secret_dir)
            assert sorted(p.name for p in keys.iterdir()) == ["ca.crt", "d0.crt", "d0.key", "dpu.secret", "host.secret"]
            assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.iterdir())
            assert set(json.loads((keys / "host.secret").read_text())["keys"]) == {"host"}
            # the deployed control plane: HTTPS with the deploy's CA, nothing changes unsigned
            url = f"https://{inv.dpus[0].addr}:{inv.control_port}"
            curl = ["curl", "-s", "-m", "10", "-w", "\n%{http_code}", "--cacert", str(keys / "ca.crt")]
            p = tb.exec_in("h1", [*curl, f"{url}/v1/health"], timeout=30)
            assert p.stdout.endswith("\n200"), p.stdout + p.stderr
            p = tb.exec_in("h1", [*curl, "-X", "DELETE", f"{url}/v1/jobs/1"], timeout=30)
            assert p.stdout.endswith("\n401") and "no_credential" in p.stdout, p.stdout
            assert tb.exec_in("h1", ["curl", "-s", "-m", "10", f"http://{inv.dpus[0].addr}:{inv.control_port}/v1/health"],
                              timeout=30).returncode != 0  # no plain HTTP

            # train: torchrun on each host over ssh, with the variables the deploy names
            procs = []
            for rank in range(2):
                env = {**deploy.host_env(inv, rank), "GLOO_SOCKET_IFNAME": "eth0",
                       "OMP_NUM_THREADS": "1"}
                cmd = (f"cd {shlex.quote(str(remote))} && env "
                       + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
                       + f" .venv/bin/torchrun --nnodes 2 --nproc-per-node 1 --node-rank {rank}"
                       f" --master-addr {inv.hosts[0].addr} --master-port 29511"
                       " -m examples.train_digits --comm dosa --epochs 1 --quiet"
                       f" --json {shlex.quote(str(tmp_path / 'train-{rank}.json'))}")
                procs.append(tb.popen_in("h0", lab.ssh_argv(inv.hosts[rank].name, cmd),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            outs = [pr.communicate(timeout=240) for pr in procs]
            for rank, (pr, (out, err)) in enumerate(zip(procs, outs)):
                assert pr.returncode == 0, f"rank {rank}: {out[-1500:]} {err[-3000:]}"
            for rank in range(2):
                run = json.loads((tmp_path / f"train-{rank}.json").read_text())["runs"][0]
                assert run["comm"] == "dosa" and run["replicas_consistent"]
                assert run["steps"] >= 10 and len(run["loss"]) == run["steps"]
                assert run["bytes_sent_per_step"] > 0
            # the DPU side really aggregated: its counters saw the job's packets
            st = _dosa(tb, "d0", "ctl", "stats", "--pin-dir", f"{inv.pin_root}/d0", "--json", timeout=60)
            assert st.returncode == 0, st.stderr
            stats = json.loads(st.stdout)
            # every training step was one round of one partition, merged in d0's XDP program
            assert stats["outcomes"]["completions"] >= run["steps"], stats["outcomes"]
            assert stats["outcomes"]["merged"] >= 2 * run["steps"] and stats["drops_total"] == 0, stats

            p = _dosa(tb, "h0", "deploy", "--inventory", str(inv_path), "--stop", timeout=60)
            assert p.returncode == 0, p.stdout + p.stderr
            for s, pid in pids.items():
                assert not ns.alive(pid), f"{s} still runs after deploy --stop"
        assert not _sshd_pids(lab_dir), "an sshd of the lab is still running"
        assert not Path(lab_dir).exists(), "the lab's keys were not removed"
    assert not tb.existing_namespaces()
    assert not tb.pin_dir.exists()
