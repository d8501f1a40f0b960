"""Shared fixtures. Tests are split by what they need: tests/unit (no privilege), tests/dataplane
(BPF_PROG_TEST_RUN, root), tests/netns (namespaces and veth, root), tests/e2e (whole system, root).
Tests marked ``root`` are skipped, with that reason, when not run as root; CI runs as root."""
from __future__ import annotations

import os
import signal
import subprocess
import uuid

import pytest


def pytest_configure(config):
    """A SIGTERM (CI's timeout, a killed job) stops the run like Ctrl-C: the test in progress is
    interrupted with KeyboardInterrupt, so its fixtures' teardown still deletes namespaces, unpins
    dataplane instances and stops the processes it started (SIGTERM's default would kill pytest
    and leave all of them behind). Only in pytest's own process: a child forked from it (pyroute2's
    namespace helpers are) gets SIGTERM's default back, or it would survive its parent's stop."""
    main_pid = os.getpid()

    def _interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        if os.getpid() != main_pid:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise KeyboardInterrupt("SIGTERM")

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _interrupt)
        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (BPF / network namespaces)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@pytest.fixture
def netns_factory():
    """Create uniquely named network namespaces (``dt-<hex>-<name>``); all are deleted at teardown,
    also when the test fails."""
    created: list[str] = []
    tag = uuid.uuid4().hex[:6]

    def make(name: str) -> str:
        ns = f"dt{tag}{name}"[:15]
        _ip("netns", "add", ns)
        created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    yield make
    for ns in reversed(created):
        # deleting a namespace destroys its veth ends (and their peers) and detaches XDP
        _ip("netns", "pids", ns, check=False)
        subprocess.run(f"ip netns pids {ns} | xargs -r kill -9", shell=True, check=False)
        _ip("netns", "del", ns, check=False)
