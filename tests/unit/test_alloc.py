"""Admission in aggregation slots (control.alloc): a job's regions are sized by its slots, never by
numel; a job that can never fit is refused as permanent with the slot count that would fit, one
that fits once others end names them."""
from __future__ import annotations

import pytest

from control.alloc import AdmissionError, SlotDemand, admit, first_fit, touched_list_cap
from dataplane.layout import BUF_DTYPE, LIST_CAP

CAP = {"pool": 32, "pstate": 256, "wstate": 4096}
EMPTY = {"pool": [], "pstate": [], "wstate": []}


def test_a_demand_is_slots_times_two_buffers_whatever_the_partition_size():
    for stride in (1000, 65536):
        d = SlotDemand(job_id=1, slots=16, stride=stride, workers=4, list_cap=touched_list_cap(stride))
        assert (d.pool, d.pstate, d.wstate) == (16 * 2, 16, 16 * 2 * 4)


def test_the_default_pool_holds_four_default_jobs():
    from dataplane.loader import DEFAULT_POOL_BUFFERS
    from dosa.job import DEFAULT_SLOTS

    assert DEFAULT_POOL_BUFFERS == 4 * SlotDemand(0, DEFAULT_SLOTS, 65536, 4).pool
    assert DEFAULT_POOL_BUFFERS * BUF_DTYPE.itemsize == 144 * 2**20


def test_touched_lists_hold_a_quarter_of_the_buffer_in_whole_words():
    assert [touched_list_cap(s) for s in (1, 15, 16, 100, 256, 4096, 10007, 65536)] == \
        [0, 0, 4, 24, 64, 1024, 2500, 16384]
    assert all(touched_list_cap(s) % 4 == 0 and touched_list_cap(s) <= s / 4 for s in range(1, 3000))
    assert touched_list_cap(65536) == LIST_CAP  # every buffer has room for a full partition's


def test_first_fit_places_jobs_side_by_side_and_reuses_gaps():
    a = admit(SlotDemand(1, 4, 65536, 2), EMPTY, CAP)
    used = {"pool": [(a["pool"], 8, 1)], "pstate": [(a["pstate"], 4, 1)], "wstate": [(a["wstate"], 16, 1)]}
    b = admit(SlotDemand(2, 2, 65536, 2), used, CAP)
    assert a == {"pool": 0, "pstate": 0, "wstate": 0}
    assert b == {"pool": 8, "pstate": 4, "wstate": 16}
    assert first_fit([(0, 10), (20, 10)], 10, 100, "x") == 10


def test_a_job_that_can_never_fit_is_refused_with_the_numbers():
    with pytest.raises(AdmissionError) as e:
        admit(SlotDemand(7, 20, 65536, 4), EMPTY, CAP)
    assert e.value.permanent
    msg = str(e.value)
    assert "job 7 needs 20 aggregation slots" in msg and "40 pool buffers (11.2 MiB: 2 buffers a slot)" in msg
    assert "can never fit" in msg and "at most 16 slots" in msg
    assert "partition_size" not in msg and "dosa ctl attach --pool-buffers N" in msg


def test_a_job_that_fits_later_names_the_jobs_in_its_way():
    used = {"pool": [(0, 28, 3)], "pstate": [(0, 14, 3)], "wstate": [(0, 48, 3)]}
    with pytest.raises(AdmissionError) as e:
        admit(SlotDemand(9, 4, 65536, 4), used, CAP)
    assert not e.value.permanent
    msg = str(e.value)
    assert "jobs [3] hold the rest" in msg and "fits once one of them ends" in msg
    assert "at most 2 slots" in msg
