"""Admission in aggregation slots (control.alloc): a job's regions are sized by its slots, never by
numel; a job that can never fit is refused as permanent with the slot count that would fit, one
that fits once others end names them."""
from __future__ import annotations

import pytest

from control.alloc import AdmissionError, SlotDemand, admit, first_fit

CAP = {"pool": 1 << 20, "pstate": 256, "wstate": 4096}
EMPTY = {"pool": [], "pstate": [], "wstate": []}


def test_a_demand_is_slots_times_two_buffers():
    d = SlotDemand(job_id=1, slots=16, stride=65536, workers=4)
    assert (d.pool, d.pstate, d.wstate) == (16 * 2 * 65536, 16, 16 * 2 * 4)


def test_first_fit_places_jobs_side_by_side_and_reuses_gaps():
    a = admit(SlotDemand(1, 4, 65536, 2), EMPTY, CAP)
    used = {"pool": [(a["pool"], 4 * 2 * 65536, 1)], "pstate": [(a["pstate"], 4, 1)],
            "wstate": [(a["wstate"], 16, 1)]}
    b = admit(SlotDemand(2, 2, 65536, 2), used, CAP)
    assert a == {"pool": 0, "pstate": 0, "wstate": 0}
    assert b == {"pool": 4 * 2 * 65536, "pstate": 4, "wstate": 16}
    assert first_fit([(0, 10), (20, 10)], 10, 100, "x") == 10


def test_a_job_that_can_never_fit_is_refused_with_the_numbers():
    with pytest.raises(AdmissionError) as e:
        admit(SlotDemand(7, 16, 65536, 4), EMPTY, CAP)
    assert e.value.permanent
    msg = str(e.value)
    assert "job 7 needs 16 aggregation slots" in msg and "2097152 pool entries" in msg
    assert "16.0 MiB" in msg and "can never fit" in msg and "at most 8 slots" in msg


def test_a_job_that_fits_later_names_the_jobs_in_its_way():
    used = {"pool": [(0, 6 * 2 * 65536, 3)], "pstate": [(0, 6, 3)], "wstate": [(0, 48, 3)]}
    with pytest.raises(AdmissionError) as e:
        admit(SlotDemand(9, 4, 65536, 4), used, CAP)
    assert not e.value.permanent
    msg = str(e.value)
    assert "jobs [3] hold the rest" in msg and "fits once one of them ends" in msg
    assert "at most 2 slots" in msg
