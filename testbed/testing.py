"""Helpers for tests and benchmarks that need a throw-away testbed.

``scratch_testbed`` gives a testbed with a unique prefix (so it never touches the user's ``dosa``
testbed and several can run at once) and a private state directory, and always tears it down --
also when the body fails -- falling back to deleting its namespaces by name if ``down`` itself fails::

    with scratch_testbed(hosts=2, dpus=1, services=False) as tb:
        tb.run([sys.executable, "-c", "..."], echo=False).check()
"""
from __future__ import annotations

import contextlib
import subprocess
import tempfile
import uuid
from pathlib import Path

from testbed import config, ns
from testbed.core import Testbed


def unique_prefix(tag: str = "t") -> str:
    return (tag + uuid.uuid4().hex)[:8]


def force_cleanup(prefix: str) -> None:
    """Last resort: kill everything in this prefix's namespaces and delete them."""
    rx = config.ns_regex(prefix)
    for name in ns.list_netns():
        if rx.match(name):
            for pid in ns.netns_pids(name):
                ns.kill_all([(pid, ns.proc_start_time(pid))], grace=0.2)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def scratch_testbed(hosts: int = 2, dpus: int = 1, prefix: str | None = None,
                    state_dir: str | Path | None = None, services_fn=None, **up_kw):
    prefix = prefix or unique_prefix()
    with tempfile.TemporaryDirectory(prefix=f"dosa-{prefix}-") as tmp:
        tb = Testbed(prefix=prefix, state_dir=state_dir or tmp, services=services_fn)
        try:
            tb.up(hosts, dpus, **up_kw)
            yield tb
        finally:
            try:
                tb.down()
            finally:
                force_cleanup(prefix)
