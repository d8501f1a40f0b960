"""Two namespaces joined by one veth pair (``eth0`` on both sides): the smallest lab a netns test
needs. Removed at exit, also on failure, with any process still running inside."""
from __future__ import annotations

import contextlib
import subprocess
import uuid


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def veth_pair(prefix: str, host_ip: str, dpu_ip: str, plen: int = 24):
    """Yield (host namespace, DPU namespace), named ``<prefix>h<tag>`` / ``<prefix>d<tag>``."""
    tag = uuid.uuid4().hex[:6]
    h, d = f"{prefix}h{tag}", f"{prefix}d{tag}"
    made = []
    try:
        for ns in (h, d):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", h, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", d)
        for ns, addr in ((h, host_ip), (d, dpu_ip)):
            ip("-n", ns, "addr", "add", f"{addr}/{plen}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        yield h, d
    finally:
        for ns in made:
            subprocess.run(f"ip netns pids {ns} | xargs -r kill -9", shell=True, capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
