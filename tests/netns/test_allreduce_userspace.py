"""Allreduce through DPU workers in userspace mode, in real namespaces: 4 hosts, 1 and 2 DPUs, sum
and gtopk, lossy/duplicating links, a host that dies, a DPU worker killed and restarted.

Each host checks its own results against an independent numpy computation (allreduce_host.py);
these tests assert that every round of every host matched.
"""
from __future__ import annotations

import time

import pytest

from allreduce_lab import Lab

pytestmark = [pytest.mark.root]


@pytest.fixture
def lab_factory(netns_factory):
    labs = []

    def make(**kw):
        lab = Lab(netns_factory, **kw)
        labs.append(lab)
        return lab

    yield make
    for lab in labs:
        lab.close()


def assert_all_exact(results, rounds, lab):
    for r in results:
        assert "error" not in r, f"host {r.get('worker')}: {r.get('error')}\nall: {results}\n{lab.logs()}"
        assert r["mismatches"] == [], r
        assert r["rounds_ok"] == rounds, r


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dpus,mode", [(1, "sum"), (2, "sum"), (2, "gtopk")])
def test_userspace_allreduce_is_exact(lab_factory, dpus, mode):
    lab = lab_factory(hosts=4, dpus=dpus)
    jf = lab.write_job(lab.job(mode=mode, density=0.005))
    for d in range(dpus):
        lab.start_dpu(d, jf, "userspace")
    res = lab.run_hosts(jf, timeout=60, extra=["--rounds", "8", "--float-check"] if mode == "sum"
                        else ["--rounds", "8"])
    assert_all_exact(res, 8, lab)
    if mode == "sum":
        for r in res:
            assert r["float_err"] <= r["float_bound"], r


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss,dup", [(1.0, 1.0), (5.0, 1.0)])
def test_userspace_allreduce_exact_under_loss_and_duplication(lab_factory, loss, dup):
    lab = lab_factory(hosts=4, dpus=2, loss_pct=loss, dup_pct=dup)
    jf = lab.write_job(lab.job())
    for d in range(2):
        lab.start_dpu(d, jf, "userspace")
    res = lab.run_hosts(jf, timeout=90, extra=["--rounds", "10", "--shuffle"])
    assert_all_exact(res, 10, lab)
    assert sum(r["stats"]["retransmissions"] for r in res) > 0  # loss really happened and was repaired


@pytest.mark.timeout(60)
def test_dead_host_makes_the_others_fail_naming_it(lab_factory):
    lab = lab_factory(hosts=4, dpus=2)
    jf = lab.write_job(lab.job())
    for d in range(2):
        lab.start_dpu(d, jf, "userspace")
    timeout = 3.0
    res = lab.run_hosts(jf, timeout=40, extra=["--rounds", "5", "--timeout", str(timeout)],
                        per_host=lambda w: ["--exit-before-round", "2"] if w == 3 else [])
    for r in res[:3]:
        assert r["rounds_ok"] == 2, r
        assert r["missing"] == [3], r
        assert "worker(s) [3]" in r["error"]
        # the bound: timeout of no progress plus a little slack
        assert r["elapsed"] < timeout + 8, r


@pytest.mark.timeout(90)
def test_dpu_worker_killed_and_restarted_continues_exact(lab_factory):
    lab = lab_factory(hosts=4, dpus=1)
    jf = lab.write_job(lab.job())
    extra = ["--state-dir", str(lab.tmp / "state")]
    p = lab.start_dpu(0, jf, "userspace", extra)
    hosts = lab.start_hosts(jf, extra=["--rounds", "30", "--round-gap", "0.05", "--timeout", "20"])
    time.sleep(1.0)
    lab.kill(p)
    time.sleep(0.3)
    lab.start_dpu(0, jf, "userspace", extra)
    res = lab.wait_hosts(hosts, timeout=60)
    assert_all_exact(res, 30, lab)


@pytest.mark.timeout(60)
def test_userspace_hosts_join_through_the_control_plane(lab_factory):
    lab = lab_factory(hosts=4, dpus=2)
    for d in range(2):
        lab.start_control(d, "userspace")
    for d in range(2):
        # in userspace mode only the control plane the hosts join through (DPU 0's) knows the job
        lab.start_dpu_control(d, "userspace", control_dpu=0)
    res = lab.run_hosts(None, timeout=40, extra=["--rounds", "4", *lab.control_args(mode="gtopk")])
    assert_all_exact(res, 4, lab)
