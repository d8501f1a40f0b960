"""Nodes of several ranks on the XDP testbed (root): ``dosa testbed run --ranks-per-node 2`` gives
2 host namespaces 2 ranks each (torchrun's numbering, the node's address and link shared), and the
digits CNN trained by DDP with the node-aware dosa hook (reduce-scatter in the node, one dosa worker
per node in each local rank's slice job, all-gather in the node) against dense Gloo: replicas
bit-identical, the same accuracy, and the node's link carrying one node's dosa traffic where flat
ranks (one dosa worker per rank, ``--ranks-per-node 1``) carry two ranks'."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import torch  # noqa: F401  (a required dependency: missing = an error, not a skip)
import sklearn  # noqa: F401

from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root]

SHOW_ENV = r"""
import json, os
print(json.dumps({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
      "GROUP_RANK", "DOSA_HOST_ADDR", "DOSA_JOB_ID", "DOSA_PORT", "OMP_NUM_THREADS")}))
"""


def _ranks(stdout: str) -> dict[int, dict]:
    seen = {}
    for line in stdout.splitlines():
        if line.startswith("[rank "):
            tag, _, payload = line.partition("] ")
            seen[int(tag[6:])] = json.loads(payload)
    return seen


@pytest.mark.timeout(90)
def test_ranks_per_node_share_the_node_and_number_like_torchrun(tmp_path):
    with scratch_testbed(hosts=2, dpus=1, services=False) as tb:
        env = {**os.environ, "DOSA_TESTBED_PREFIX": tb.prefix, "DOSA_TESTBED_STATE_DIR": str(tb.state_dir)}
        p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "run", "--ranks-per-node", "2",
                            "--log-dir", str(tmp_path), "--", sys.executable, "-c", SHOW_ENV],
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        nodes = {n["name"]: n["address"] for n in tb.status()["nodes"]}
        seen = _ranks(p.stdout)
        assert sorted(seen) == [0, 1, 2, 3]
        for rank, e in seen.items():
            assert (e["RANK"], e["WORLD_SIZE"]) == (str(rank), "4")
            assert (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == (str(rank % 2), "2", str(rank // 2))
            assert e["DOSA_HOST_ADDR"] == nodes[f"h{rank // 2}"]
        assert len({e["DOSA_JOB_ID"] for e in seen.values()}) == 1
        assert len({e["DOSA_PORT"] for e in seen.values()}) == 1  # local rank l binds it + l
        # the run reserved two job ids (one slice job a local rank): the next run starts after them
        r = tb.run([sys.executable, "-c", "import os; print(os.environ['DOSA_JOB_ID'])"], echo=False,
                   log_dir=tmp_path / "next").check()
        assert int(open(r.ranks[0].stdout_path).read()) == int(seen[0]["DOSA_JOB_ID"]) + 2
        bad = subprocess.run([sys.executable, "-m", "dosa", "testbed", "run", "--ranks-per-node", "0",
                              "--", "true"], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "ranks per node must be an integer in 1..64" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_of_two_ranks_train_the_cnn_like_dense_with_one_node_of_traffic(tmp_path):
    epochs = "20"
    runs = {}
    with scratch_testbed(hosts=2, dpus=1) as tb:
        for label, extra in (("node", ["--comm", "dosa,dense"]), ("flat", ["--comm", "dosa", "--ranks-per-node", "1"])):
            out = tmp_path / f"{label}-{{rank}}.json"
            tb.run([sys.executable, "-m", "examples.train_digits", "--model", "cnn", "--epochs", epochs,
                    "--quiet", "--json", str(out), *extra], timeout=400, echo=False, ranks_per_node=2,
                   log_dir=tmp_path / f"logs-{label}").check()
            runs[label] = [json.loads((tmp_path / f"{label}-{r}.json").read_text())["runs"] for r in range(4)]
    node = [r[0] for r in runs["node"]]
    dense = [r[1] for r in runs["node"]]
    flat = [r[0] for r in runs["flat"]]
    for r in node + dense + flat:
        assert r["replicas_consistent"] and r["model"] == "cnn"
    assert [r["ranks_per_node"] for r in node] == [2, 2, 2, 2]
    assert [r["ranks_per_node"] for r in flat] == [1, 1, 1, 1]
    assert all(h["hook"]["fallbacks"] == 0 and h["hook"]["dosa_rounds"] == h["steps"] for h in node + flat)
    # every rank the same model (the check above is each run's own all-gather of a digest)
    assert len({r["test_accuracy"] for r in node}) == 1 and len({r["test_accuracy"] for r in dense}) == 1
    acc_node, acc_dense = node[0]["test_accuracy"], dense[0]["test_accuracy"]
    assert acc_node >= acc_dense - 0.01, (acc_node, acc_dense)  # within 1 point (3.6 test images)
    # the node's link: node-aware carries one node's share, flat two ranks' (and their results twice)
    link_node = sum(r["link_bytes_per_step"] for r in node[::2]) / 2
    link_flat = sum(r["link_bytes_per_step"] for r in flat[::2]) / 2
    assert link_flat > 1.8 * link_node, (link_flat, link_node)
    (tmp_path / "summary.json").write_text(json.dumps({"acc_node": acc_node, "acc_dense": acc_dense,
                                                       "link_node": link_node, "link_flat": link_flat}))


@pytest.mark.timeout(300)
def test_torchrun_starts_one_agent_a_node_with_its_ranks_and_the_hook_goes_node_aware(tmp_path):
    with scratch_testbed(hosts=2, dpus=1) as tb:
        r = tb.run(["examples/ddp_dosa.py", "--steps", "6"], timeout=240, echo=False, torchrun=True,
                   ranks_per_node=2, log_dir=tmp_path)
        assert r.ok, r.summary()
        assert len(r.ranks) == 2  # one torchrun agent a node
        nodes = {n["name"]: n["address"] for n in tb.status()["nodes"]}
        seen = {}
        for agent in r.ranks:
            for line in open(agent.stdout_path):
                if line.startswith("{"):
                    rec = json.loads(line)
                    seen[rec["rank"]] = rec
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(rec["world_size"] == 4 and rec["replicas_identical"] for rec in seen.values())
    # torchrun numbers a node's workers consecutively; both workers of a node share its address
    assert {seen[0]["dosa_host_addr"], seen[1]["dosa_host_addr"]} == {nodes["h0"]}
    assert {seen[2]["dosa_host_addr"], seen[3]["dosa_host_addr"]} == {nodes["h1"]}
    assert all(rec["stats"]["dosa_rounds"] == 6 and rec["stats"]["bytes_sent"] > 0 for rec in seen.values())
