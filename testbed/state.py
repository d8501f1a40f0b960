"""The state file (/run/dosa/testbed.json): the topology a testbed was built with and the processes
it started. Written atomically (temp file + rename) so a crash never leaves half a file; ``down`` does
not trust it (it also works from namespace names alone), ``status`` compares it with what is live."""
from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA = 1


def load(path: Path) -> dict | None:
    """The state, or None when the file is missing or unreadable (a stale or torn file is not an
    error: ``down`` must still work)."""
    try:
        with open(path) as f:
            st = json.load(f)
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) and st.get("schema") == SCHEMA else None


def save(path: Path, st: dict) -> None:
    st = {**st, "schema": SCHEMA}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(st, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
