"""Counter indexes of the XDP program: drop reasons and non-drop outcomes.

The enum itself is ``dosa.counters.Counter`` (the one definition, rendered into the C header
dosa/dosa_wire.h that the program includes, so C and Python cannot disagree); this module is the
dataplane's reading of it: which counters are drops and verdicts, and their stable names.
tests/dataplane checks that each packet kind moves the counter of the same name.
"""
from __future__ import annotations

from dosa.counters import NUM_COUNTERS, Counter, c_enum  # noqa: F401 (the dataplane's counter API)

DROP_REASONS = [c for c in Counter if c < Counter.MERGED]
VERDICTS = [c for c in Counter if c < Counter.MERGED_ENTRIES]


def name(c: Counter) -> str:
    """Stable lower-case name used in ``dosa ctl stats --json`` (``drop.<reason>`` for drops)."""
    return c.name.lower()
