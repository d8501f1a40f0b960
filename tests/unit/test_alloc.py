"""Admission in aggregation slots (control.alloc): a job's regions are sized by its slots, never by
numel; a job that can never fit is refused as permanent with the slot count that would fit, one
that fits once others end names them."""
from __future__ import annotations

import pytest

from control.alloc import AdmissionError, SlotDemand, admit, first_fit, pool_entries, touched_list_cap

CAP = {"pool": 1 << 20, "pstate": 256, "wstate": 4096}
EMPTY = {"pool": [], "pstate": [], "wstate": []}


def test_a_demand_is_slots_times_two_buffers():
    d = SlotDemand(job_id=1, slots=16, stride=65536, workers=4)
    assert (d.pool, d.pstate, d.wstate) == (16 * 2 * 65536, 16, 16 * 2 * 4)
    d = SlotDemand(job_id=1, slots=16, stride=65536, workers=4, list_cap=touched_list_cap(65536))
    assert d.list_cap == 16384 and d.pitch == 65536 + 4096 and d.pool == 16 * 2 * d.pitch
    assert pool_entries(16, 65536) == d.pool


def test_the_default_pool_holds_two_default_jobs_with_their_touched_lists():
    from dataplane.loader import DEFAULT_POOL_SLOTS
    from dosa.job import DEFAULT_SLOTS
    from dosa.wire import DEFAULT_PARTITION_SIZE

    assert DEFAULT_POOL_SLOTS == 2 * pool_entries(DEFAULT_SLOTS, DEFAULT_PARTITION_SIZE)


def test_touched_lists_hold_a_quarter_of_the_buffer_in_whole_pool_entries():
    assert [touched_list_cap(s) for s in (1, 15, 16, 100, 256, 4096, 10007, 65536)] == \
        [0, 0, 4, 24, 64, 1024, 2500, 16384]
    assert all(touched_list_cap(s) % 4 == 0 and touched_list_cap(s) <= s / 4 for s in range(1, 3000))


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
    with pytest.raises(AdmissionError) as e:  # the touched lists count: 16 x 2 x (65536 + 4096)
        admit(SlotDemand(7, 16, 65536, 4, 16384), EMPTY, CAP)
    msg = str(e.value)
    assert "2228224 pool entries (17.0 MiB: 2 buffers a slot, each 65536 s64 sums + a " \
        "16384-offset touched list in 4096 entries)" in msg
    assert "at most 7 slots" in msg  # 2^20 // (2 x 69632)


def test_a_job_that_fits_later_names_the_jobs_in_its_way():
    used = {"pool": [(0, 6 * 2 * 65536, 3)], "pstate": [(0, 6, 3)], "wstate": [(0, 48, 3)]}
    with pytest.raises(AdmissionError) as e:
        admit(SlotDemand(9, 4, 65536, 4), used, CAP)
    assert not e.value.permanent
    msg = str(e.value)
    assert "jobs [3] hold the rest" in msg and "fits once one of them ends" in msg
    assert "at most 2 slots" in msg


def test_a_window_that_fits_only_without_its_touched_lists_runs_without_them():
    from control.alloc import admit_job

    want = SlotDemand(4, 4, 65536, 2, touched_list_cap(65536))
    got, off = admit_job(want, EMPTY, CAP)  # 4 x 2 x 69632 fits 2^20
    assert got == want and off["pool"] == 0
    tight = dict(CAP, pool=8 * 65536)  # sized as slots x 2 x stride
    got, off = admit_job(want, EMPTY, tight)
    assert got.list_cap == 0 and got.pool == 8 * 65536 and off["pool"] == 0
    with pytest.raises(AdmissionError) as e:  # fits neither way: the error names the full demand
        admit_job(SlotDemand(5, 8, 65536, 2, 16384), EMPTY, tight)
    assert e.value.permanent and "1114112 pool entries" in str(e.value)
    # fits once job 3 ends, without lists (with them it never would): not permanent
    used = {"pool": [(0, 6 * 65536, 3)], "pstate": [(0, 1, 3)], "wstate": [(0, 1, 3)]}
    with pytest.raises(AdmissionError, match="jobs \\[3\\] hold the rest") as e:
        admit_job(want, used, tight)
    assert not e.value.permanent
