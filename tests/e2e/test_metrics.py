"""``GET /metrics`` of the DPU's control process, scraped during a real training run on the
testbed (XDP dataplane) and parsed with prometheus_client's own parser: drops by reason, merged
packets and entries, completions and per-job counters are there, agree with each other, only grow,
and a malformed packet sent to the DPU moves exactly its drop counter."""
from __future__ import annotations

import sys
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dataplane import reasons
from dosa import wire
from testbed.testing import scratch_testbed

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(400)]

SCRAPE = """
import sys, urllib.request
r = urllib.request.urlopen("http://%s:%d/metrics", timeout=5)
sys.stdout.write(r.headers.get("Content-Type") + "\\n" + r.read().decode())
"""
SEND = """
import socket
p = bytes.fromhex("%s")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("%s", %d))
s.sendto(p, ("%s", %d))
"""


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _scrape(tb, addr: str, port: int) -> dict[tuple, float]:
    p = tb.exec_in("h1", [sys.executable, "-c", SCRAPE % (addr, port)], timeout=30)
    assert p.returncode == 0, p.stderr
    ctype, _, body = p.stdout.partition("\n")
    assert ctype.startswith("text/plain; version="), ctype  # the text exposition format
    return _samples(body)


def test_metrics_scraped_during_a_real_run_are_the_dataplanes_and_the_workers_counters(tmp_path):
    with scratch_testbed(hosts=2, dpus=1) as tb:
        env = tb.job_env(0)
        addr, port = env["DOSA_CONTROL_ADDR"], int(env["DOSA_CONTROL_PORT"])
        before = _scrape(tb, addr, port)
        assert before[("dosa_worker_up", ())] == 1
        assert before[("dosa_jobs", ())] == 0
        for r in reasons.DROP_REASONS:
            assert before[("dosa_dataplane_drops_total", (("reason", reasons.name(r)),))] == 0

        result, scrapes = {}, []
        run = threading.Thread(target=lambda: result.update(r=tb.run(
            # 6 epochs: the dosa rounds last a few seconds, not one (a scrape takes ~0.3 s)
            [sys.executable, "-m", "examples.train_digits", "--comm", "dosa", "--epochs", "6", "--quiet"],
            timeout=240, echo=False)))
        run.start()
        while run.is_alive():
            scrapes.append(_scrape(tb, addr, port))
            time.sleep(0.1)
        run.join()
        result["r"].check()
        job = env["DOSA_JOB_ID"]
        jl = (("job_id", job),)
        during = [s for s in scrapes if s.get(("dosa_job_workers", jl)) == 2
                  and s.get(("dosa_worker_completions_total", jl), 0) > 0]
        assert during, f"no scrape during the run saw job {job} at work ({len(scrapes)} scrapes)"

        # a packet with a bad magic from h0's own flow address: the dataplane drops and counts it
        d0 = env["DOSA_DPU_ADDRS"].split(",")[0]
        bad = wire.Header(magic=0x12345678, flags=int(wire.Flags.LAST)).pack().hex()
        p = tb.exec_in("h0", [sys.executable, "-c", SEND % (
            bad, env["DOSA_HOST_ADDR"], int(env["DOSA_PORT"]), d0, int(env["DOSA_PORT"]))], timeout=30)
        assert p.returncode == 0, p.stderr
        time.sleep(0.6)  # one publication period of the worker's stats file
        after = _scrape(tb, addr, port)

    seq = [before, *scrapes, after]
    for a, b in zip(seq, seq[1:]):  # counters only grow
        for k, v in a.items():
            if k[0].endswith("_total") and k in b:
                assert b[k] >= v, k
    drop = lambda s, r: s[("dosa_dataplane_drops_total", (("reason", r),))]  # noqa: E731
    assert drop(after, "bad_magic") == drop(scrapes[-1], "bad_magic") + 1
    assert all(drop(after, reasons.name(r)) == 0 for r in reasons.DROP_REASONS
               if reasons.name(r) not in ("bad_magic", "duplicate", "round_too_old"))
    merged = after[("dosa_dataplane_merged_packets_total", ())]
    entries = after[("dosa_dataplane_merged_entries_total", ())]
    completions = after[("dosa_dataplane_completions_total", ())]
    worker_completions = after[("dosa_worker_completions_total", jl)]
    assert merged >= 2 * worker_completions > 0 and entries >= merged
    # every completion the XDP program emitted was answered by the worker with a result
    assert worker_completions == completions, (worker_completions, completions, {k: v for k, v in after.items() if "complet" in k[0] or "unknown" in k[0]})
    assert after[("dosa_worker_result_packets_total", jl)] >= worker_completions
    # no completion event was lost (one that came before the worker served the job was parked)
    assert after[("dosa_worker_completion_events_total", (("outcome", "unknown"),))] == 0
    assert ("dosa_worker_completion_events_total", (("outcome", "parked"),)) in after
    assert ("dosa_worker_retransmission_answers_total", (("job_id", job), ("outcome", "retx_answered"))) in after
