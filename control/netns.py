"""Run a function inside a named network namespace (``ip netns`` names, /run/netns/<name>).

setns(2) changes the namespace of the calling *thread* only, so the function runs on a fresh thread
that enters the namespace and then ends: the rest of the process never leaves its namespace.
Interface lookups (if_nametoindex) and netlink sockets (XDP attach) made on that thread act in the
target namespace. BPF objects are not namespaced, so a program loaded anywhere attaches there.
"""
from __future__ import annotations

import ctypes
import os
import threading

from dosa.errors import DosaError

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def netns_path(name: str) -> str:
    path = name if name.startswith("/") else f"/run/netns/{name}"
    if not os.path.exists(path):
        raise DosaError(f"network namespace {name!r} does not exist ({path} is missing)")
    return path


def run_in_netns(name: str | None, fn, *args):
    """``fn(*args)`` in namespace ``name`` (None: the current one); returns its result, re-raises."""
    if not name:
        return fn(*args)
    path = netns_path(name)
    box: dict = {}

    def target():
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise DosaError(f"cannot enter network namespace {name!r}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["result"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name=f"netns-{name}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")
