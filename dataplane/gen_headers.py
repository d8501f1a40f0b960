"""Write (or, with ``--check``, compare) the C header generated from dataplane/layout.py:
``dataplane/dosa_layout.h``, the buffer geometry and constants the XDP program and the DPU worker's
compiled code share. Run ``python -m dataplane.gen_headers`` after changing layout.py;
tests/unit/test_generated_headers.py fails while the checked-in file differs from what this writes.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dosa.gen_headers import write_or_check

from . import layout

GENERATED = {Path(__file__).resolve().parent / "dosa_layout.h": layout.c_header}

if __name__ == "__main__":
    sys.exit(write_or_check(GENERATED, "python -m dataplane.gen_headers"))
