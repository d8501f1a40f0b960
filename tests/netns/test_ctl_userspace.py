"""The join API in userspace mode (no XDP): every DPU of a job keeps the whole job in its registry,
so a DPU worker asking its OWN control plane learns density, mode, DPUs and hosts (the testbed's
services do exactly that). First in process (two servers on 127.0.0.1 and 127.0.0.2, no
privilege), then a real 2-DPU userspace testbed running a gtopk allreduce (root)."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import sys

import pytest

ADDRS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def servers():
    """Userspace control planes of DPUs 0 and 1 on loopback (127.0.0.3 has none: an unreachable DPU)."""
    from control.api import ControlServer, ControlService

    port = _free_port()
    out = []
    try:
        for a in ADDRS[:2]:
            svc = ControlService(None, address=a, control_port=port, peer_timeout=2.0)
            out.append(ControlServer(svc, a, port).start())
        yield out
    finally:
        for s in out:
            s.stop()


def _views(servers, job_id):
    from dosa.join import request

    out = []
    for s in servers:
        jobs = {j["job_id"]: j for j in request(s.address, "GET", "/v1/jobs")["jobs"]}
        out.append(jobs.get(job_id))
    return out


@pytest.mark.timeout(30)
def test_every_dpu_control_plane_reports_the_full_job(servers):
    from dosa.join import join, request
    from dosa.job import JobConfig

    d0, d1 = servers
    shape = dict(numel=5000, workers=2, dpus=list(ADDRS[:2]), partition_size=1000, scale_exp=12,
                 mode="gtopk", density=0.003)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(join, d0.address, w, job_id=7, address=f"10.9.0.{w + 1}", port=17791 + w,
                          wait=10, **shape) for w in (1, 0)]
        cfgs = [f.result(20) for f in futs]
    v0, v1 = _views(servers, 7)
    assert v1 is not None, "DPU 1's control plane never learned the job"
    assert v1 == v0  # the same full view: density, mode, dpus, hosts, complete
    assert v1["complete"] and v1["mode"] == "gtopk" and v1["density"] == 0.003
    assert [d["address"] for d in v1["dpus"]] == list(ADDRS[:2])
    assert [(h["address"], h["port"]) for h in v1["hosts"]] == [("10.9.0.1", 17791), ("10.9.0.2", 17792)]
    # what `dosa dpu run --control <own control plane>` on DPU 1 builds from it is what hosts got
    assert JobConfig.from_view(v1) == cfgs[0] == cfgs[1]

    # leaving and removing reach DPU 1's registry too
    request(d0.address, "POST", "/v1/leave", {"job_id": 7, "worker_id": 1})
    v0, v1 = _views(servers, 7)
    assert [h["worker_id"] for h in v1["hosts"]] == [0] and not v1["complete"] and v1 == v0
    request(d0.address, "DELETE", "/v1/jobs/7")
    assert _views(servers, 7) == [None, None]


@pytest.mark.timeout(30)
def test_a_host_may_join_through_any_dpu_and_the_rendezvous_sees_it(servers):
    """Once DPU 1 knows the job, a join through DPU 1 reaches DPU 0's registry and wakes the host
    waiting there (two coordinators at once must not deadlock on each other's registry)."""
    from dosa.join import join

    d0, d1 = servers
    shape = dict(numel=3000, workers=3, dpus=list(ADDRS[:2]), partition_size=1000)
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        f0 = ex.submit(join, d0.address, 0, job_id=8, address="10.9.1.1", wait=10, **shape)
        for _ in range(100):  # until the first joiner has created the job on both DPUs
            if _views(servers, 8)[1] is not None:
                break
            concurrent.futures.wait([f0], timeout=0.05)
        f1 = ex.submit(join, d1.address, 1, job_id=8, address="10.9.1.2", wait=10)
        f2 = ex.submit(join, d0.address, 2, job_id=8, address="10.9.1.3", wait=10)
        cfgs = [f.result(20) for f in (f0, f1, f2)]
    assert all(c.hosts == [("10.9.1.1", 17791), ("10.9.1.2", 17791), ("10.9.1.3", 17791)] for c in cfgs)
    v0, v1 = _views(servers, 8)
    assert v0 == v1 and v0["complete"]


@pytest.mark.timeout(30)
def test_install_is_all_or_nothing_in_userspace_mode(servers):
    from dosa.join import request

    d0, d1 = servers
    # DPU 2 (127.0.0.3) has no control plane: nothing may stay behind on DPUs 0 and 1
    body = {"job_id": 9, "address": "10.9.2.1", "numel": 3000, "workers": 1, "dpus": list(ADDRS)}
    with pytest.raises(Exception) as e:
        request(d0.address, "POST", "/v1/join", body)
    assert getattr(e.value, "status", None) == 502 and "DPU 2 (127.0.0.3)" in str(e.value)
    assert _views(servers, 9) == [None, None]
    # DPU 1 already holds a job 9 (created through it): creating another job 9 through DPU 0 fails
    request(d1.address, "POST", "/v1/jobs", {"job_id": 9, "workers": 1, "numel": 100, "dpus": [ADDRS[1]]})
    with pytest.raises(Exception) as e:
        request(d0.address, "POST", "/v1/join", dict(body, dpus=list(ADDRS[:2])))
    assert getattr(e.value, "status", None) == 409 and "already exists" in str(e.value)
    v0, v1 = _views(servers, 9)
    assert v0 is None and v1["numel"] == 100 and v1["hosts"] == []


@pytest.mark.root
@pytest.mark.timeout(150)
def test_two_dpu_userspace_gtopk_allreduce_on_a_testbed(tmp_path):
    """`dosa ctl serve` + `dosa dpu run --control <its own control plane>` on 2 DPUs in userspace
    mode, 2 hosts joining through DPU 0: every round of a gtopk allreduce is exact, and with the
    job's density (0.004, not the workers' default 0.01: k per partition is checked), on DPU 1 too."""
    from dosa.join import request
    from control.netns import run_in_netns
    from testbed.testing import scratch_testbed

    out = tmp_path / "out"
    out.mkdir()
    with scratch_testbed(hosts=2, dpus=2, mode="userspace") as tb:
        argv = [sys.executable, "-m", "benchmarks.allreduce.dosa_paths", "--host", "--numel", "200000", "--density",
                "0.004", "--rounds", "3", "--warmup", "0", "--mode", "gtopk", "--out", str(out),
                "--timeout", "30"]
        run = tb.run(argv, timeout=90, echo=False, log_dir=tmp_path / "logs")
        logs = "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in sorted((tmp_path / "logs").glob("*")))
        assert not run.timed_out, logs
        nodes = {n["name"]: n["address"] for n in tb.status()["nodes"]}
        port = tb.job_env(0)["DOSA_CONTROL_PORT"]
        views = [run_in_netns(tb.namespace(d), request, f"{nodes[d]}:{port}", "GET", "/v1/jobs")
                 for d in ("d0", "d1")]
    ranks = [json.loads((out / f"rank{w}.json").read_text()) for w in range(2)]
    for r in ranks:
        assert "error" not in r, (r, logs)
        assert r["rounds_checked"] == 3 and r["rounds_wrong"] == 0 and r["verified"], r
    # DPU 1 learned the job's density from its registry: its partitions' k checked exact above. The
    # hosts left when they were done: the job is released on both DPUs (docs/control.md)
    assert views[0]["jobs"] == [] and views[1]["jobs"] == [], views
