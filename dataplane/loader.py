"""Compile the XDP program with BCC and pin it and its maps under /sys/fs/bpf/dosa/<instance>/.

Pinning is what makes the state outlive processes: the control process that loaded the program may
exit or restart, the DPU worker (another process) opens the same maps by path
(dataplane.maps.DataplaneMaps.open), and an XDP attachment made through netlink keeps the program
alive on its interface. ``unload`` removes the pins; once no interface uses the program either, the
kernel frees everything.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from dosa import wire
from dosa.errors import DosaError, NeedsRoot

from . import layout, libbpf

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "dosa_xdp.c"
#: where the wire header generated from dosa/wire.py lives (dosa/dosa_wire.h: the bottom layer's,
#: shared with the hosts' compiled header check)
WIRE_HEADER_DIR = Path(wire.__file__).resolve().parent
BPFFS = "/sys/fs/bpf"
PIN_ROOT = f"{BPFFS}/dosa"
PROG_PIN = "prog"
#: one completion ring per DPU worker shard (dosa_xdp.c ring_output)
RING_NAMES = tuple(f"completions{i}" for i in range(layout.MAX_SHARDS))
MAP_NAMES = ("jobs", "flows", "ports", "pool", "locks", "pstate", "wstate", "settings", "counters",
             "slow_path", *RING_NAMES)
FUNC_NAME = "xdp_dosa"
#: the slow path xdp_dosa tail-calls when a packet's adds leave the s32 range (its own program, so
#: the verifier checks it on its own budget): slot 0 of the ``slow_path`` prog array
SLOW_PATH_FUNC = "xdp_dosa_saturate"
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")
#: aggregation buffers of the pool by default (layout.BUF_DTYPE, 288 KiB each: 65536 s32 sums and a
#: 16384-offset touched list): 512 = 144 MiB, four jobs of dosa.job.DEFAULT_SLOTS slots (2 buffers a
#: slot) at the default partition size
DEFAULT_POOL_BUFFERS = 512


@dataclass(frozen=True)
class LoadConfig:
    """Sizes fixed when the program is compiled (BPF maps cannot grow). The one place they are
    written: dosa_state.h has no defaults, cflags() defines every one."""

    pool_buffers: int = DEFAULT_POOL_BUFFERS  # aggregation buffers (2 per slot of a job)
    pstate_slots: int = 65536  # (job, aggregation slot) states
    wstate_slots: int = 262144  # (job, slot, parity, worker) states
    max_jobs: int = 64
    max_flows: int = 4096
    max_ports: int = 16
    ringbuf_pages: int = 64  # per completion ring: 256 KiB, > 10k completion records

    def cflags(self) -> list[str]:
        for k, v in asdict(self).items():
            if not isinstance(v, int) or v < 1 or v >= 2**32:
                raise DosaError(f"dataplane setting {k}={v!r} must be a positive 32-bit integer")
        if self.ringbuf_pages & (self.ringbuf_pages - 1):
            raise DosaError(f"ringbuf_pages={self.ringbuf_pages} must be a power of two")
        return [f"-DDOSA_POOL_BUFS={self.pool_buffers}u", f"-DDOSA_PSTATE_SLOTS={self.pstate_slots}",
                f"-DDOSA_WSTATE_SLOTS={self.wstate_slots}", f"-DDOSA_MAX_JOBS={self.max_jobs}",
                f"-DDOSA_MAX_FLOWS={self.max_flows}", f"-DDOSA_MAX_PORTS={self.max_ports}",
                f"-DDOSA_RINGBUF_PAGES={self.ringbuf_pages}"]


def check_instance(instance: str) -> str:
    if instance and instance.startswith("/"):
        p = os.path.normpath(instance)
        if not p.startswith(BPFFS + "/") or not _INSTANCE_RE.match(os.path.basename(p)):
            raise DosaError(f"pin directory {instance!r} must be a directory under {BPFFS}/")
        return p
    if not _INSTANCE_RE.match(instance or ""):
        raise DosaError(f"instance name {instance!r} must be 1-48 letters, digits, '.', '_' or '-'")
    return instance


def pin_dir(instance: str) -> str:
    """Pin directory of an instance: ``/sys/fs/bpf/dosa/<name>``, or the instance itself when it is
    an absolute path under /sys/fs/bpf (the testbed gives each DPU its own pin directory)."""
    instance = check_instance(instance)
    return instance if instance.startswith("/") else f"{PIN_ROOT}/{instance}"


def is_loaded(instance: str) -> bool:
    return os.path.exists(f"{pin_dir(instance)}/{PROG_PIN}")


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise NeedsRoot(what)


def bpffs_mounted() -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1:3] == [BPFFS, "bpf"] for line in f if len(line.split()) > 2)


def _sysfs_source(mountinfo: str) -> str | None:
    """The mount source of the sysfs mounted on /sys in a /proc/<pid>/mountinfo text (None: none).

    A mountinfo line is ``id parent major:minor root mountpoint opts [optional...] - fstype source
    superopts``; the last sysfs mount on /sys is the one this process sees."""
    source = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 2 and fields[4] == "/sys" and tail[0] == "sysfs":
            source = tail[1]
        elif sep and len(fields) >= 5 and fields[4] == "/sys":
            source = None  # something else covers /sys now
    return source


def under_ip_netns_exec(mountinfo: str | None = None, netns_names: list[str] | None = None) -> bool:
    """True when this process runs under `ip netns exec NAME`, in the mount namespace it made.

    The evidence is what `ip netns exec` leaves behind: it unshares the mount namespace and mounts a
    new sysfs on /sys with the namespace's name as its source (the machine's own /sys says
    ``sysfs``), which hides /sys/fs/bpf. Pins made there would be invisible to every other process.
    Nothing is inferred from /proc/1/ns/mnt: on some machines even root cannot read it."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return False
    if netns_names is None:
        try:
            netns_names = os.listdir("/run/netns")
        except OSError:
            netns_names = []
    source = _sysfs_source(mountinfo)
    return source is not None and source in netns_names


BPFFS_HINT = ("/sys/fs/bpf is not mounted in this mount namespace (`ip netns exec` remounts /sys); "
              "enter the namespace with `nsenter --net=/run/netns/NAME` instead so the pins are shared")


def ensure_bpffs() -> None:
    """Mount bpffs at /sys/fs/bpf when it is not (a fresh machine of this kind does not mount it;
    `make setup` does, and this covers a user who skipped setup). Refuses under `ip netns exec`,
    whose private /sys would hide the pins from every other process."""
    if bpffs_mounted():
        return
    if under_ip_netns_exec():
        raise DosaError(BPFFS_HINT)
    if not os.path.isdir(BPFFS):
        raise DosaError(f"{BPFFS} does not exist: this kernel has no BPF filesystem (CONFIG_BPF_SYSCALL)")
    r = subprocess.run(["mount", "-t", "bpf", "bpf", BPFFS], capture_output=True, text=True)
    if r.returncode != 0:
        raise DosaError(f"cannot mount the BPF filesystem on {BPFFS}: {r.stderr.strip()}")


def program_text() -> str:
    """The C the kernel runs: dosa_xdp.c, which includes the headers generated from the Python
    definitions (dosa/dosa_wire.h from dosa/wire.py with dosa/counters.py's enum, dosa_layout.h from
    layout.py); DOSA_BPF tells the shared headers they are compiled into the program."""
    return "#define DOSA_BPF 1\n" + SOURCE.read_text()


def bcc_class():
    """BCC's ``BPF`` class, imported at first use: BCC is slow to import, needs root to be useful,
    and a machine that never loads the program (a training host, a userspace DPU) may lack it. Its
    absence is one sentence (libbcc links libbpf, so a missing libbpf shows here too)."""
    try:
        from bcc import BPF
    except (ImportError, OSError) as e:
        raise DosaError(f"loading the XDP dataplane needs BCC (Debian's python3-bpfcc, libbpfcc and "
                        f"libbpf1; make setup installs them), which cannot be imported: {e}") from None
    return BPF


def compile_program(config: LoadConfig = LoadConfig()):
    """Compile with BCC; returns (bpf, prog_fd). The caller keeps ``bpf`` alive while it uses fds."""
    require_root("loading the XDP dataplane")
    BPF = bcc_class()
    try:
        bpf = BPF(text=program_text().encode(), cflags=[f"-I{HERE}", f"-I{WIRE_HEADER_DIR}", *config.cflags()])
        fn = bpf.load_func(FUNC_NAME.encode(), BPF.XDP)
        slow = bpf.load_func(SLOW_PATH_FUNC.encode(), BPF.XDP)
        bpf[b"slow_path"][ctypes.c_int(0)] = ctypes.c_int(slow.fd)
    except Exception as e:  # BCC raises bare Exceptions on compile / verifier errors
        raise DosaError(f"the XDP program failed to compile or verify: {e}") from e
    return bpf, fn.fd


def load(instance: str = "default", config: LoadConfig = LoadConfig(), keep_bpf: bool = False):
    """Compile and pin the program and its maps as ``instance``; an error if it is already loaded.

    With ``keep_bpf`` the BCC object is returned (tests read its table types; call ``cleanup()``)."""
    require_root("loading the XDP dataplane")
    d = pin_dir(instance)
    if is_loaded(instance):
        raise DosaError(f"dataplane instance {instance!r} is already loaded (pins in {d})")
    ensure_bpffs()
    bpf, prog_fd = compile_program(config)
    os.makedirs(d, exist_ok=True)
    try:
        for name in MAP_NAMES:
            libbpf.obj_pin(bpf[name.encode()].map_fd, f"{d}/{name}")
        libbpf.obj_pin(prog_fd, f"{d}/{PROG_PIN}")  # last: its presence means "fully loaded"
    except Exception:
        bpf.cleanup()
        unload(instance)
        raise
    if keep_bpf:
        return bpf
    bpf.cleanup()
    return None


def unload(instance: str) -> bool:
    """Remove the instance's pins. Returns whether there was anything to remove."""
    d = pin_dir(instance)
    if not os.path.isdir(d):
        return False
    for entry in os.listdir(d):
        os.unlink(f"{d}/{entry}")
    os.rmdir(d)
    if d.startswith(PIN_ROOT + "/"):
        try:
            os.rmdir(PIN_ROOT)  # only when no other instance is left
        except OSError:
            pass
    return True


def open_prog(instance: str) -> int:
    """fd of the pinned program of ``instance`` (for attach or BPF_PROG_TEST_RUN)."""
    if not is_loaded(instance):
        raise DosaError(f"dataplane instance {instance!r} is not loaded (run `dosa ctl attach` first)")
    return libbpf.obj_get(f"{pin_dir(instance)}/{PROG_PIN}")
