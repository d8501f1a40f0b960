"""Thin wrappers over ``ip``/``tc`` and /proc: run a command in a namespace, list namespaces and the
processes inside them, kill processes safely. The topology steps pyroute2 serves run over netlink
(testbed/netlink.py); the rest shell out to iproute2 here. Either way ``DOSA_TESTBED_TRACE=1``
prints each step as the iproute2 command that replays it by hand."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dosa.errors import DosaError, NeedsRoot

TRACE = os.environ.get("DOSA_TESTBED_TRACE") == "1"


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise NeedsRoot(what)


def sh(argv: list[str], check: bool = True, what: str | None = None) -> subprocess.CompletedProcess:
    """Run a command, capture its output; on failure raise a DosaError quoting its stderr."""
    if TRACE:
        print("+ " + " ".join(argv), file=sys.stderr)
    try:
        p = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise DosaError(f"{argv[0]} is not installed (run `make setup`)") from None
    if check and p.returncode != 0:
        err = (p.stderr or p.stdout).strip().splitlines()
        raise DosaError(f"{what or ' '.join(argv)} failed: {err[-1] if err else f'exit {p.returncode}'}")
    return p


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return sh(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(*args: str, ns: str) -> subprocess.CompletedProcess:
    return sh(["tc", "-n", ns, *args])


def napi_threads() -> dict[int, str]:
    """{pid: comm} of the kernel's threaded-NAPI workers (``napi/<dev>-<id>``)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if comm.startswith("napi/"):
                out[int(d)] = comm
    return out


NETNS_DIR = "/run/netns"


def list_netns() -> list[str]:
    """The named network namespaces (what ``ip netns list`` shows), without a process."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def netns_pids(name: str) -> list[int]:
    """Processes in namespace ``name`` (what ``ip netns pids NAME`` shows), read from /proc: the
    inode of /proc/PID/ns/net against the namespace's file, without a process."""
    try:
        want = os.stat(os.path.join(NETNS_DIR, name))
    except OSError:
        return []
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = os.stat(f"/proc/{d}/ns/net")
            except OSError:
                continue
            if (st.st_ino, st.st_dev) == (want.st_ino, want.st_dev):
                out.append(int(d))
    return out


def netns_cmd(ns: str | None, argv: list[str], cpus: list[int] | None = None) -> list[str]:
    """The argv that runs ``argv`` inside network namespace ``ns`` (None: this process's own),
    optionally pinned to ``cpus`` (taskset wraps it; the affinity is inherited across exec).

    ``nsenter --net`` and not ``ip netns exec``: the latter also unshares the mount namespace and
    remounts /sys, which hides the bpffs at /sys/fs/bpf -- the control plane would pin the
    dataplane's maps where the DPU worker (another process) cannot see them. nsenter switches only
    the network namespace; every process shares the one bpffs."""
    pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    enter = ["nsenter", f"--net=/run/netns/{ns}", "--"] if ns is not None else []
    return [*pin, *enter, *argv]


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat): with the pid it
    identifies a process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(")") + 2:].split()[19])


def alive(pid: int, start_time: int | None = None) -> bool:
    st = proc_start_time(pid)
    if st is None:
        return False
    if start_time is not None and st != start_time:
        return False  # the pid was reused by another process
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def kill_all(pids: list[tuple[int, int | None]], grace: float = 3.0) -> None:
    """SIGTERM each (pid, start_time), poll until they are gone or ``grace`` passes, then SIGKILL."""
    live = [(p, st) for p, st in pids if alive(p, st)]
    for p, _ in live:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [(p, st) for p, st in live if alive(p, st)]
    for p, _ in live:
        _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while live and time.monotonic() < deadline:
        time.sleep(0.02)
        live = [(p, st) for p, st in live if alive(p, st)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def listening(pid: int, port: int, proto: str = "tcp") -> bool:
    """True when a socket bound to ``port`` (TCP: in LISTEN state) exists in ``pid``'s network
    namespace. Reads /proc/PID/net/{tcp,udp}[6], which shows the sockets of the namespace the process
    lives in: a readiness probe that needs no setns and no connection attempt."""
    hexport = f":{port:04X}"
    for fam in ("", "6"):
        try:
            with open(f"/proc/{pid}/net/{proto}{fam}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[1].endswith(hexport) and (proto != "tcp" or parts[3] == "0A"):
                        return True
        except (OSError, StopIteration):
            continue
    return False
