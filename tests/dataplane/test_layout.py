"""The structs user space reads and writes through the maps match the ones BCC compiled, field by
field; the C counter enum is the one dosa/counters.py defines, in the generated dosa_wire.h the
program includes."""
from __future__ import annotations

import ctypes
import re

import pytest

from dataplane import layout, loader, reasons


def test_c_enum_is_generated_from_reasons():
    text = reasons.c_enum()
    got = {m[0]: int(m[1]) for m in re.findall(r"DOSA_C_(\w+) = (\d+),", text)}
    assert got == {c.name: int(c) for c in reasons.Counter}
    assert f"#define DOSA_NUM_COUNTERS {len(reasons.Counter)}" in text
    assert text.rstrip() in (loader.WIRE_HEADER_DIR / "dosa_wire.h").read_text()
    assert '#include "dosa_parse.h"' in loader.program_text()  # which includes dosa_wire.h


def test_verdicts_and_tallies_partition_the_enum():
    assert set(reasons.VERDICTS) | {reasons.Counter.MERGED_ENTRIES, reasons.Counter.COMPLETIONS,
                                    reasons.Counter.COMPLETION_LOST,
                                    reasons.Counter.SATURATED_SUMS} == set(reasons.Counter)
    assert [int(c) for c in reasons.Counter] == list(range(reasons.NUM_COUNTERS))


def _same(bcc_type, mine):
    assert ctypes.sizeof(bcc_type) == ctypes.sizeof(mine), mine.__name__
    for name, _ in mine._fields_:
        assert getattr(bcc_type, name).offset == getattr(mine, name).offset, f"{mine.__name__}.{name}"
        assert getattr(bcc_type, name).size == getattr(mine, name).size, f"{mine.__name__}.{name}"


@pytest.mark.root
@pytest.mark.parametrize("table,part,mine", [
    ("jobs", "Leaf", layout.Job), ("flows", "Key", layout.FlowKey), ("flows", "Leaf", layout.Flow),
    ("pstate", "Leaf", layout.PState), ("wstate", "Leaf", layout.WState),
    ("pool", "Leaf", layout.Buf), ("settings", "Leaf", layout.Settings),
])
def test_struct_matches_compiled(dp, table, part, mine):
    _same(getattr(dp.bpf[table.encode()], part), mine)


def test_numpy_views_match_ctypes():
    assert layout.PSTATE_DTYPE.itemsize == ctypes.sizeof(layout.PState)
    assert layout.WSTATE_DTYPE.itemsize == ctypes.sizeof(layout.WState)
    for name, _ in layout.PState._fields_:
        assert layout.PSTATE_DTYPE.fields[name][1] == getattr(layout.PState, name).offset
    for name, _ in layout.WState._fields_:
        assert layout.WSTATE_DTYPE.fields[name][1] == getattr(layout.WState, name).offset


def test_job_info_is_the_job_layout_table():
    """dataplane.maps.JobInfo (the jobs map entry as a Python type) has exactly the fields of the one
    layout table of struct dosa_job (layout.Job), in order, plus the key: a field added to one and not
    the other fails here, and to_struct / from_struct convert through that table."""
    from dataclasses import fields

    from dataplane.maps import JobInfo

    assert [f.name for f in fields(JobInfo)] == ["job_id"] + [n for n, _ in layout.Job._fields_]
    j = JobInfo(**{f.name: 4 * (i + 1) for i, f in enumerate(fields(JobInfo))})  # list_cap: 4k
    assert JobInfo.from_struct(j.job_id, j.to_struct()) == j
