"""Capture the fabric: tcpdump on the bridge inside the fabric namespace.

The bridge device sees every frame the bridge forwards because tcpdump puts it in promiscuous mode
(the bridge then delivers a copy of each forwarded frame locally), and it sees each frame once --
capturing on the ports instead would record every frame twice (in on one port, out on another).
tcpdump is started, we wait until it reports "listening", the command runs, then SIGINT makes it
flush (``-U`` writes packet by packet anyway) and print its counters, which we parse.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dosa.errors import DosaError

from testbed.config import BRIDGE
from testbed.ns import netns_cmd

READY_TIMEOUT_S = 10.0


class WireFrames:
    """While recording, every node segments its own UDP GSO sends (``tx-udp-segmentation off`` on
    its interface), so the bridge -- and the capture -- carries the packets a wire would, not the
    64 KB GSO aggregates a veth passes along unsegmented (a capture of those shows one "packet"
    holding several dosa packets, which neither Wireshark nor the scapy layer would read as sent).
    Interfaces that already segment are left alone; the others are switched back on exit."""

    def __init__(self, nodes: list[tuple[str, str]]):
        self.nodes = nodes  # (namespace, interface)
        self.changed: list[tuple[str, str]] = []

    @staticmethod
    def _ethtool(namespace: str, *args: str) -> subprocess.CompletedProcess:
        # `ip netns exec` gives ethtool the namespace's own /sys (see testbed.impair)
        return subprocess.run(["ip", "netns", "exec", namespace, "ethtool", *args],
                              capture_output=True, text=True)

    def __enter__(self):
        for namespace, dev in self.nodes:
            k = self._ethtool(namespace, "-k", dev)
            if re.search(r"^tx-udp-segmentation: on", k.stdout, re.M):
                p = self._ethtool(namespace, "-K", dev, "tx-udp-segmentation", "off")
                if p.returncode != 0:
                    self.__exit__()
                    raise DosaError(f"cannot turn off UDP segmentation offload on {dev} in "
                                    f"{namespace}: {p.stderr.strip()}")
                self.changed.append((namespace, dev))
        return self

    def __exit__(self, *exc):
        for namespace, dev in self.changed:
            self._ethtool(namespace, "-K", dev, "tx-udp-segmentation", "on")
        self.changed = []


@dataclass
class CaptureStats:
    path: str
    packets: int  # records in the pcap file
    captured: int | None  # tcpdump's own counters (None when it did not print them)
    dropped_by_kernel: int | None


class Tcpdump:
    """A running tcpdump on the fabric bridge; use as a context manager or start()/stop()."""

    def __init__(self, fabric_ns: str, out: str | os.PathLike, bpf_filter: list[str] | None = None,
                 iface: str = BRIDGE):
        self.ns, self.out, self.iface = fabric_ns, Path(out).resolve(), iface
        self.filter = bpf_filter or []
        self.proc: subprocess.Popen | None = None
        self._err = b""
        self._stats: CaptureStats | None = None

    def start(self) -> "Tcpdump":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # -Z root: Debian's tcpdump otherwise drops to user tcpdump and cannot write root's files.
        # --immediate-mode: without it packets wait in a TPACKET_V3 block that is never handed
        # over when a short command ends right away (a capture of 0 packets); -U: write each one.
        # -B 32768 (KiB): with -s 0 each ring slot is sized for a 256 KiB packet, so the default
        # 2 MiB buffer holds ~8 packets and every burst overflowed it (measured: ~half of 4000
        # packets dropped by the kernel; 0 with -B 32768).
        argv = ["tcpdump", "-i", self.iface, "-n", "-U", "--immediate-mode", "-s", "0", "-B", "32768",
                "-Z", "root",
                "-w", str(self.out), *self.filter]
        try:
            self.proc = subprocess.Popen(netns_cmd(self.ns, argv), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         start_new_session=True)
        except OSError as e:
            raise DosaError(f"cannot start tcpdump: {e}") from None
        deadline = time.monotonic() + READY_TIMEOUT_S
        fd = self.proc.stderr.fileno()
        while b"listening on" not in self._err:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                msg = self._err.decode(errors="replace").strip().splitlines()
                raise DosaError(f"tcpdump on {self.iface} in {self.ns} did not start: "
                                f"{msg[-1] if msg else 'no output'}")
            r, _, _ = select.select([fd], [], [], min(left, 0.2))
            if r:
                chunk = os.read(fd, 4096)
                if not chunk and self.proc.poll() is not None:
                    continue
                self._err += chunk
        return self

    def stop(self) -> CaptureStats:
        """Stop tcpdump (SIGINT: it flushes and prints its counters); idempotent."""
        if self._stats is not None:
            return self._stats
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if p is not None and p.stderr is not None:
            self._err += p.stderr.read()
            p.stderr.close()
        text = self._err.decode(errors="replace")
        cap = re.search(r"(\d+) packets? captured", text)
        drop = re.search(r"(\d+) packets? dropped by kernel", text)
        self._stats = CaptureStats(str(self.out), count_pcap_records(self.out),
                                   int(cap.group(1)) if cap else None,
                                   int(drop.group(1)) if drop else None)
        return self._stats

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def count_pcap_records(path: Path) -> int:
    """Number of complete packet records in a capture file (0 if tcpdump has not written its
    header yet). Uses dosa.capture's reader, the project's one pcap parser."""
    from dosa.capture import read_frames

    try:
        if Path(path).stat().st_size < 24:
            return 0
    except OSError:
        return 0
    return len(read_frames(path).off)
