"""Write (or, with ``--check``, compare) the C headers generated from their Python definitions:
``dosa/dosa_wire.h`` from ``dosa/wire.py`` (constants, header struct, the header check, the packet
accessors) and ``dosa/dosa_wire.pxd``, its declarations for the compiled modules.

Run ``python -m dosa.gen_headers`` after changing wire.py; tests/unit/test_wire_c_header.py
fails while the checked-in file differs from what this writes. The header carries the counter
enum of dosa/counters.py too.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dosa import wire

HERE = Path(__file__).resolve().parent
GENERATED = {HERE / "dosa_wire.h": wire.c_header, HERE / "dosa_wire.pxd": wire.c_pxd}


def main(argv: list[str] | None = None) -> int:
    return write_or_check(GENERATED, "python -m dosa.gen_headers", argv)


def write_or_check(generated: dict, command: str, argv: list[str] | None = None) -> int:
    """Write each ``{path: render}`` file, or with ``--check`` in ``argv`` report the stale ones
    (exit status 1)."""
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for path, render in generated.items():
        text = render()
        if path.exists() and path.read_text() == text:
            continue
        if check:
            stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run {command})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
