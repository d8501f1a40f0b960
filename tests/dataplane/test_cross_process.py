"""DataplaneMaps from ANOTHER process (as the DPU worker uses it): it opens the pins by instance
name, receives the completion the XDP program emitted, reads the sums zero-copy and advances the
round; this process sees the advance. Also: completions emitted while no consumer runs wait in the
pinned ring buffer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import json, sys
from dataplane.maps import DataplaneMaps
with DataplaneMaps.open(sys.argv[1]) as dp:
    comps = dp.poll_completions(timeout_ms=2000)
    out = []
    for c in comps:
        sums = dp.buffer(c.job_id, c.partition, c.round)
        out.append({"job": c.job_id, "p": c.partition, "round": c.round, "scale": c.scale_exp,
                     "nz": [int(i) for i in sums.nonzero()[0]], "sums": [int(v) for v in sums[sums != 0]],
                     "advanced": dp.advance(c.job_id, c.partition, c.round)})
        del sums
    print(json.dumps(out))
"""


def test_a_worker_process_consumes_completions_and_advances(h):
    j = h.job(workers=2, numel=50, partition_size=50)
    for r in (0, 1):  # round 1 completing lets the worker advance (round 0 moves nothing)
        h.run_all(h.data(j, 0, 0, r, [3, 9], [5, -1], scale=4) + h.data(j, 1, 0, r, [9, 40], [2, 7], scale=4))
    # the completions were emitted before the worker process even started: they wait in the ring
    r = subprocess.run([sys.executable, "-c", WORKER, h.instance], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [(g["job"], g["p"], g["round"], g["scale"]) for g in got] == [(j.job_id, 0, 0, 4), (j.job_id, 0, 1, 4)]
    for g in got:
        assert g["nz"] == [3, 9, 40] and g["sums"] == [5, 1, 7]
    assert [g["advanced"] for g in got] == [False, True]
    st = h.maps.round_state(j.job_id, 0)
    assert st.base_round == 1 and st.workers_done == (0, 2)
    assert not np.any(h.maps.buffer(j.job_id, 0, 0))  # round 0's parity was cleared over there
