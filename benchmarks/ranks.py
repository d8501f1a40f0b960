"""What the ranks of a testbed run wrote: one JSON result a rank, ``rank{w}.json`` in the run's
output folder (dosa_paths, bigjob and recovery ranks all write it so)."""
from __future__ import annotations

import json
from pathlib import Path

from dosa.errors import DosaError


def read_rank_results(out: Path | str, hosts: int, what: str | None = None,
                      logs: Path | str | None = None) -> list[dict]:
    """The results of ranks ``0 .. hosts-1`` (``out/rank{w}.json``), in rank order.

    With ``what`` (how an error names the run, e.g. ``"xdp path"``): a rank that wrote no result
    raises ``DosaError("{what}: host {w} wrote no result (logs in {logs})")`` and a result that
    carries an ``"error"`` raises ``DosaError("{what} failed: {error}")`` (the first rank's).
    Without it, ranks that wrote nothing are left out and errors stay in the results: the caller
    judges them (benchmarks.recovery, where a killed rank and the others' errors are what it
    measures)."""
    out = Path(out)
    ranks = []
    for w in range(hosts):
        f = out / f"rank{w}.json"
        if f.exists():
            ranks.append(json.loads(f.read_text()))
        elif what is not None:
            raise DosaError(f"{what}: host {w} wrote no result (logs in {logs})")
    errors = [r["error"] for r in ranks if "error" in r]
    if what is not None and errors:
        raise DosaError(f"{what} failed: {errors[0]}")
    return ranks
