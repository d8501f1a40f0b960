"""One XDP program for the whole tests/dataplane session: BCC compiles in seconds, so it is loaded
once (as a uniquely named pinned instance) and every test makes its own jobs with their own regions.
The pins are removed at the end, also when tests fail."""
from __future__ import annotations

import os
import uuid

import pytest

from dataplane_harness import Harness


@pytest.fixture(scope="session")
def dp():
    if os.geteuid() != 0:
        pytest.skip("needs root (BPF)")
    from dataplane import loader
    from dataplane.maps import DataplaneMaps

    instance = f"test-{uuid.uuid4().hex[:8]}"
    cfg = loader.LoadConfig(pool_buffers=256, pstate_slots=4096, wstate_slots=1 << 16,
                            ringbuf_pages=16)
    bpf = loader.load(instance, cfg, keep_bpf=True)
    maps = prog_fd = None
    try:
        maps = DataplaneMaps.open(instance)
        prog_fd = loader.open_prog(instance)
        yield Harness(instance, maps, prog_fd, bpf)
    finally:
        if maps is not None:
            maps.close()
        if prog_fd is not None:
            os.close(prog_fd)
        bpf.cleanup()
        loader.unload(instance)


@pytest.fixture
def h(dp):
    """The session harness emptied (no jobs, flows or state), counters zeroed, ring drained."""
    dp.reset()
    dp.maps.poll_completions(0)
    dp.maps.reset_counters()
    return dp
