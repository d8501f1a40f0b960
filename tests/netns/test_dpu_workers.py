"""One DPU, two worker processes (``dosa dpu run --workers 2``): the slots are sharded over them
(XDP mode: each reads its own completion ring; userspace mode: each merges its own partitions,
steered to it by the socket group's reuseport program). Every round exact, clean and under 5 %
loss with duplicates and reordering, and both shards do their part. Real namespaces, real XDP."""
from __future__ import annotations

import json
import subprocess
import uuid

import pytest
from allreduce_lab import Lab

pytestmark = [pytest.mark.root]


@pytest.fixture(scope="module", params=["xdp", "userspace"])
def lab(request):
    mode = request.param
    created = []
    tag = uuid.uuid4().hex[:6]

    def make(name):
        ns = f"dw{tag}{name}"[:15]
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        created.append(ns)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        return ns

    lab = None
    try:
        lab = Lab(make, hosts=4, dpus=1, subnet="10.231.7")
        if mode == "userspace":
            # as `dosa testbed up --mode userspace --dpu-workers N` does: the hosts' GSO datagrams
            # reach the DPU's sharded sockets as packets (the kernel steers by the first packet)
            segment_towards_dpu(lab, True)
        lab.start_control(0, mode)
        lab.stats = lab.tmp / "dpu0-stats.json"
        lab.workers = [lab.start_dpu_control(0, mode, extra=["--workers", "2", "--stats-file", str(lab.stats)])]
        lab.mode = mode
        yield lab
    finally:
        if lab is not None:
            lab.close()
        for ns in reversed(created):
            subprocess.run(f"ip netns pids {ns} | xargs -r kill -9", shell=True, check=False)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def segment_towards_dpu(lab, on: bool) -> None:
    from testbed import impair

    if on:
        impair.segment_at_node(lab.fab, "pd0")
    else:
        subprocess.run(["ip", "netns", "exec", lab.fab, "ethtool", "-K", "pd0", "tx-udp-segmentation", "on"],
                       check=True, capture_output=True)


def shard_stats(lab) -> list[dict]:
    out = []
    for i in range(2):
        with open(f"{lab.stats}.shard{i}") as f:
            out.append(json.load(f))
    return out


def wrong_shard(lab) -> list[int]:
    return [sum(j.get("wrong_shard", 0) for j in s["jobs"].values()) + s["stats"].get("wrong_shard", 0)
            for s in shard_stats(lab)]


def shard_completions(lab, job_id: int) -> list[int]:
    return [s["jobs"].get(str(job_id), {}).get("completions", 0) for s in shard_stats(lab)]


def exact(res, rounds, lab):
    for r in res:
        assert "error" not in r, f"host {r.get('worker')}: {r.get('error')}\n{lab.logs()}"
        assert r["mismatches"] == [] and r["rounds_ok"] == rounds, r


@pytest.mark.timeout(300)  # the first test also pays for the lab (one BCC compile in XDP mode)
def test_two_dpu_workers_are_exact(lab):
    res = lab.run_hosts(None, timeout=90, extra=["--rounds", "6", *lab.control_args(job_id=71, slots=8)])
    exact(res, 6, lab)
    import time

    time.sleep(1.0)  # the shards publish their counters every 0.5 s
    got = shard_completions(lab, 71)
    assert all(c > 0 for c in got) and sum(got) == 6 * 13, got  # 13 partitions of 16384 a round
    assert wrong_shard(lab) == [0, 0]  # XDP merges before any socket; userspace: segmented


@pytest.mark.timeout(300)
def test_two_dpu_workers_are_exact_under_loss_duplication_and_reordering(lab):
    lab.impair(5.0, 1.0)
    try:
        res = lab.run_hosts(None, timeout=150, extra=["--rounds", "8", "--shuffle",
                                                      *lab.control_args(job_id=72, slots=8)])
    finally:
        lab.impair(0, 0)
    exact(res, 8, lab)
    assert sum(r["stats"]["retransmissions"] for r in res) > 0


@pytest.mark.timeout(300)
def test_gso_datagrams_delivered_whole_lose_nothing(lab):
    """The hosts' GSO datagrams handed to the DPU whole (as veth and loopback do): XDP sees packets
    anyway; a userspace shard gets datagrams steered by their first packet, so it receives packets
    of the other shard's partitions. It drops and counts them (wrong_shard), never merges them into
    memory that does not hold their partition, and the hosts' resends make every round exact."""
    import time

    for ns in lab.host_ns:  # the hosts' own GSO on (the loss test above turned it off)
        subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", "eth0", "tx-udp-segmentation", "on"],
                       check=True, capture_output=True)
    if lab.mode == "userspace":
        segment_towards_dpu(lab, False)
    try:
        res = lab.run_hosts(None, timeout=150, extra=["--rounds", "4", *lab.control_args(job_id=73, slots=8)])
    finally:
        if lab.mode == "userspace":
            segment_towards_dpu(lab, True)
    exact(res, 4, lab)
    time.sleep(1.0)
    wrong = wrong_shard(lab)
    if lab.mode == "userspace":
        assert sum(wrong) > 0, wrong  # what the segmentation above prevents
    else:
        assert wrong == [0, 0]
