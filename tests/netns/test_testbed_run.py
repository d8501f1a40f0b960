"""``testbed run`` (torchrun environment, failing ranks, timeout) and ``testbed capture``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.runner import RankFailure
from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.timeout(90)]

ENV_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "DOSA_CONTROL_ADDR", "DOSA_CONTROL_PORT", "DOSA_JOB_ID", "DOSA_DPU_ADDRS",
            "DOSA_HOST_ADDR", "DOSA_PORT", "DOSA_IFACE", "GLOO_SOCKET_IFNAME"]
# prints the environment and the address this namespace's eth0 really has
SHOW_ENV = r"""
import json, os, subprocess
addr = json.loads(subprocess.run(["ip", "-j", "addr", "show", "eth0"], capture_output=True,
                                 text=True).stdout)[0]["addr_info"][0]["local"]
print(json.dumps({"env": {k: os.environ.get(k) for k in %r}, "eth0": addr}))
""" % ENV_KEYS


def _cli_env(tb) -> dict:
    return {**os.environ, "DOSA_TESTBED_PREFIX": tb.prefix, "DOSA_TESTBED_STATE_DIR": str(tb.state_dir)}


def test_run_gives_every_rank_the_torchrun_and_dosa_environment(tmp_path):
    with scratch_testbed(hosts=3, dpus=2, services=False) as tb:
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "run", "--log-dir",
                            str(tmp_path), "--", sys.executable, "-c", SHOW_ENV],
                           env=_cli_env(tb), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        nodes = {n["name"]: n["address"] for n in tb.status()["nodes"]}
        seen = {}
        for line in p.stdout.splitlines():
            if line.startswith("[rank "):
                tag, _, payload = line.partition("] ")
                seen[int(tag[6:])] = json.loads(payload)
        assert sorted(seen) == [0, 1, 2]
        job_ids = set()
        for rank, rec in seen.items():
            e = rec["env"]
            assert e["RANK"] == str(rank) and e["WORLD_SIZE"] == "3"
            assert e["LOCAL_RANK"] == "0" and e["LOCAL_WORLD_SIZE"] == "1"
            assert e["MASTER_ADDR"] == nodes["h0"] and int(e["MASTER_PORT"]) > 0
            assert e["DOSA_HOST_ADDR"] == rec["eth0"] == nodes[f"h{rank}"]
            assert e["DOSA_CONTROL_ADDR"] == nodes["d0"] and int(e["DOSA_CONTROL_PORT"]) > 0
            assert e["DOSA_DPU_ADDRS"] == f"{nodes['d0']},{nodes['d1']}"
            assert int(e["DOSA_PORT"]) > 0 and e["DOSA_IFACE"] == "eth0" == e["GLOO_SOCKET_IFNAME"]
            job_ids.add(e["DOSA_JOB_ID"])
            # the rank's output is also saved to its own file
            assert json.loads((tmp_path / f"rank{rank}.out").read_text()) == rec
        assert len(job_ids) == 1 and int(job_ids.pop()) >= 1
        # the next run is another job
        r = tb.run([sys.executable, "-c", "import os; print(os.environ['DOSA_JOB_ID'])"], echo=False,
                   log_dir=tmp_path / "second").check()
        assert Path(r.ranks[0].stdout_path).read_text().strip() != seen[0]["env"]["DOSA_JOB_ID"]


def test_a_failing_rank_fails_the_run_names_it_and_stops_the_others(tmp_path):
    script = "import os, sys, time\nif os.environ['RANK'] == '1':\n    print('boom', file=sys.stderr); sys.exit(3)\ntime.sleep(60)"
    with scratch_testbed(hosts=3, dpus=0, services=False) as tb:
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "run", "--log-dir", str(tmp_path),
                            "--", sys.executable, "-c", script],
                           env=_cli_env(tb), capture_output=True, text=True, timeout=60)
        assert p.returncode == 1
        assert "rank 1 failed (exit status 3)" in p.stderr
        assert "stopped rank(s) 0, 2" in p.stderr
        assert "[rank 1] boom" in p.stderr
        assert (tmp_path / "rank1.err").read_text() == "boom\n"
        # same through the Python API
        r = tb.run([sys.executable, "-c", script], echo=False, log_dir=tmp_path / "api")
        assert not r.ok and r.first_failed == [1] and r.failed_ranks == [0, 1, 2]
        assert [x.killed for x in r.ranks] == [True, False, True]
        with pytest.raises(RankFailure, match="rank 1 failed"):
            r.check()


def test_run_timeout_kills_every_rank(tmp_path):
    with scratch_testbed(hosts=2, dpus=0, services=False) as tb:
        r = tb.run(["sleep", "60"], timeout=1, echo=False, log_dir=tmp_path)
        assert r.timed_out and not r.ok
        assert all(x.killed and x.returncode < 0 for x in r.ranks)
        assert "timed out" in r.summary()


def test_capture_records_the_fabric_while_the_command_runs(tmp_path):
    from scapy.all import ICMP, rdpcap

    pcap = tmp_path / "run.pcap"
    with scratch_testbed(hosts=2, dpus=1, services=False) as tb:
        d0 = tb.status()["nodes"][2]["address"]
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "capture", "--out", str(pcap),
                            "--log-dir", str(tmp_path / "logs"), "--", "ping", "-c", "3", "-i", "0.05", d0],
                           env=_cli_env(tb), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        pkts = rdpcap(str(pcap))
        assert f"captured {len(pkts)} packets" in p.stdout
        icmp = [x for x in pkts if ICMP in x]
        # 2 hosts x 3 echo requests + 3 replies, each seen once on the bridge (no duplicates)
        assert len(icmp) == 12
        assert sum(1 for x in icmp if x[ICMP].type == 8) == 6
