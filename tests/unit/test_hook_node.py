"""The node-aware hook (host_lib.hook_node): the interleaved slicing of buckets, and 2 nodes x 2 ranks
training with DDP against real userspace DPU workers on loopback (one slice job per local rank, the
nodes its workers): the replicas bit-identical, overlap equal to blocking, and every gradient
accounted for (what the ranks put in = what came back + what the nodes' residuals hold), across
DDP's bucket rebuild and with a one-entry bucket."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dosa.app.demo import free_port
from dosa.job import JobConfig
from host_lib.hook_node import NodeLayout, resolve_ranks_per_node
from userspace_dpus import userspace_dpu_workers

REPO = Path(__file__).resolve().parents[2]
NUMEL = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10 + 1  # tests/unit/hook_node_ranks.py's model
CONFIGS = [("overlap", 1, 0.01), ("blocking", 0, 0.01), ("tiny_buckets", 1, 0.000001)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("per", [1, 2, 3, 4])
def test_every_index_has_one_owner_and_a_slice_job_counts_its_own_whatever_the_buckets(per):
    numel = 1000
    rng = np.random.default_rng(per)
    for _ in range(5):  # random bucket splits of the same index space
        cuts = np.sort(rng.choice(np.arange(1, numel), size=rng.integers(0, 12), replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [numel]])).tolist()
        owned = np.zeros(numel, np.int64)
        for local in range(per):
            lay = NodeLayout(0, 2, local, per)
            off, count = 0, 0
            x = torch.arange(numel, dtype=torch.float64)
            for n in sizes:
                plan = lay.plan(off, n)
                rows = plan.rows(x[off:off + n], per)
                mine = rows.view(per, plan.c)[local][plan.a:plan.b]
                pos = plan.positions(local, per)
                assert torch.equal(mine, x[off + pos])  # the rows hold the positions named
                assert torch.all((off + pos) % per == local)
                owned[(off + pos).numpy()] += 1
                assert torch.equal(plan.unrows(rows, per), x[off:off + n])
                count += plan.b - plan.a
                off += n
            assert count == lay.slice_numel(numel)
        assert np.all(owned == 1)


@pytest.mark.timeout(10)
def test_ranks_per_node_from_torchrun_only_across_nodes_and_checked():
    assert resolve_ranks_per_node(None, 4, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert resolve_ranks_per_node(None, 4, {"LOCAL_WORLD_SIZE": "4"}) == 1  # one node: stay flat
    assert resolve_ranks_per_node(None, 4, {}) == 1
    assert resolve_ranks_per_node(1, 4, {"LOCAL_WORLD_SIZE": "2"}) == 1
    with pytest.raises(ValueError, match="does not divide the world size"):
        resolve_ranks_per_node(3, 4)
    with pytest.raises(ValueError, match="integer >= 1"):
        resolve_ranks_per_node(0, 4)
    assert NodeLayout(1, 2, 1, 2).slice_job_id(7) == 8
    assert NodeLayout(1, 2, 1, 2).slice_job_id(2**32 - 1) == 1


@pytest.mark.timeout(240)
def test_two_nodes_of_two_ranks_identical_replicas_and_nothing_lost(tmp_path):
    nodes, per = 2, 2
    specs, cfgs = [], []
    for j, (name, overlap, cap) in enumerate(CONFIGS):
        paths = []
        for local in range(per):
            lay = NodeLayout(0, nodes, local, per)
            hosts = [("127.0.0.1", free_port()) for _ in range(nodes)]
            job = JobConfig(job_id=30 + 2 * j + local, numel=lay.slice_numel(NUMEL), hosts=hosts,
                            dpus=[("127.0.0.1", free_port())], partition_size=1024, scale_exp=20)
            cfg = tmp_path / f"{name}-{local}.json"
            cfg.write_text(json.dumps(job.to_dict()))
            paths.append(str(cfg))
        cfgs += paths
        specs.append(f"{name}:{overlap}:{cap}:{','.join(paths)}")
    with userspace_dpu_workers(cfgs):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port(1)),
                   WORLD_SIZE=str(nodes * per), LOCAL_WORLD_SIZE=str(per), PYTHONPATH=str(REPO))
        ranks = [subprocess.Popen([sys.executable, str(REPO / "tests/unit/hook_node_ranks.py"),
                                   str(tmp_path / f"rank{r}.json"), *specs], cwd=REPO,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r % per), GROUP_RANK=str(r // per)),
                                  stderr=subprocess.PIPE, start_new_session=True)
                 for r in range(nodes * per)]
        try:
            for r in ranks:
                _, err = r.communicate(timeout=200)
                assert r.returncode == 0, err.decode()[-3000:]
        finally:  # a failed or timed-out rank leaves no process behind (its session is its own)
            for r in ranks:
                if r.poll() is None:
                    os.killpg(r.pid, signal.SIGKILL)
                    r.wait()
    rep = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nodes * per)]
    for name, overlap, _ in CONFIGS:
        runs = [r[name] for r in rep]
        assert [r["layout"] for r in runs] == [[n, nodes, i, per] for n in range(nodes) for i in range(per)]
        assert all(r["params"] == runs[0]["params"] for r in runs), f"{name}: the replicas differ"
        for r in runs:
            st = r["stats"]
            assert st["dosa_rounds"] == 8 and st["buckets_per_step"] > 1
            assert st["overlapped_rounds"] == (7 if overlap else 0)  # the first dosa step parks
            assert st["bytes_sent"] > 0 and st["residual_remaps"] >= 0
            # nothing lost: gradients in = results out + residuals, to float32 rounding
            assert max(r["account"].values()) < 1e-5, (name, r["account"])
        assert np.mean(runs[0]["losses"][-4:]) < np.mean(runs[0]["losses"][:4]), f"{name} did not learn"
    assert rep[0]["overlap"]["params"] == rep[0]["blocking"]["params"]
    assert 1 in rep[0]["tiny_buckets"]["bucket_sizes"], rep[0]["tiny_buckets"]["bucket_sizes"]


@pytest.mark.timeout(10)
def test_a_nodes_ranks_bind_their_own_ports_and_join_as_such():
    from dosa.env import RankEnv
    from dosa.join import join_view

    e = RankEnv.parse({"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "DOSA_PORT": "17791"})
    assert (e.own_port, e.node_rank) == (17792, 1)
    assert RankEnv.parse(e.to_env()) == e
    assert RankEnv.parse({"RANK": "3", "GROUP_RANK": "0"}).node_rank == 0
    seen = {}

    def fake_join_raw(control, job_id, address, port, worker_id, wait, **shape):
        seen.update(job_id=job_id, port=port, dpus=shape.get("dpus"))
        return {}

    import dosa.join as J
    real, J.join_raw = J.join_raw, fake_join_raw
    try:
        join_view(("10.0.0.1", 1), 0, 10, env={"DOSA_JOB_ID": "5", "DOSA_HOST_ADDR": "10.0.0.2",
                                               "DOSA_PORT": "17791", "LOCAL_RANK": "1",
                                               "DOSA_DPU_ADDRS": "10.0.0.9"})
    finally:
        J.join_raw = real
    # the rank's own port is DOSA_PORT + LOCAL_RANK; the DPU's stays DOSA_PORT
    assert seen == {"job_id": 5, "port": 17792, "dpus": [{"address": "10.0.0.9", "port": 17791}]}
