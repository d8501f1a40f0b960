"""A training host (or a DPU running the userspace worker) has no libbpf, no BCC, no bpffs, and often
no root: every `dosa` command that needs none of them must work there, and every one that does must
refuse in one sentence, never with a traceback.

Each command runs in a private mount namespace (`unshare -m`) that recreates one such machine; the
real machine is left as it is:

* ``no-libbpf``: root, but libbpf.so.1 is /dev/null (so BCC's libbcc, which links it, does not load
  either and ``import bcc`` fails), and /sys/fs/bpf is a tmpfs holding one fake pin (``fake22/prog``)
  so a command that believes a dataplane is loaded reaches the library and must name the package.
* ``no-root``: uid/gid 65534 with no groups or capabilities (``setpriv``); a directory on the way
  to the venv's interpreter or the checkout that others may not enter (pyenv under /root here) is
  made enterable inside the namespace only, by an overlay of itself whose root mode is changed.
"""
from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dosa import wire
from dosa.app.demo import free_port
from dosa.job import JobConfig

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

LIBBPF = "/usr/lib/x86_64-linux-gnu/libbpf.so.1*"
NOBODY = 65534

HIDE_BPF = f"""
for f in {LIBBPF}; do mount --bind /dev/null "$f"; done
umount -R /sys/fs/bpf 2>/dev/null || true
mount -t tmpfs -o mode=0755 tmpfs /sys/fs/bpf
mkdir -p /sys/fs/bpf/dosa/fake22 && touch /sys/fs/bpf/dosa/fake22/prog
"""


def _lend_to_nobody(paths: list[str], scratch: str) -> str:
    """Shell lines that let an unprivileged user reach every path inside the namespace: each
    directory on the way (the paths themselves too) that others may not enter gets an overlay of
    itself (its upper layer on a tmpfs at ``scratch``) whose root is then made o+rx. Only the
    namespace sees that mode; the files are the real ones. Top-down, so nested ones work too."""
    dirs: list[str] = []
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts) + 1):
            d = os.path.join(*parts[:i])
            if os.path.isdir(d) and not os.stat(d).st_mode & stat.S_IXOTH and d not in dirs:
                dirs.append(d)
    if not dirs:
        return ""
    lines = [f"mkdir -p {scratch}", f"mount -t tmpfs tmpfs {scratch}"]
    for n, d in enumerate(sorted(dirs, key=lambda x: len(Path(x).parts))):
        up, wk, q = f"{scratch}/u{n}", f"{scratch}/w{n}", shlex.quote(d)
        lines += [f"mkdir {up} {wk}",
                  f"mount -t overlay overlay -o lowerdir={q},upperdir={up},workdir={wk} {q}",
                  f"chmod o+rx {q}"]
    return "\n".join(lines) + "\n"


def _pcap(path: Path) -> None:
    """Two workers' SPARSE_DATA for one partition and the DPU's (correct) result."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw
    from scapy.utils import wrpcap

    from dosa.wire import DPU_SENDER_ID, Flags, Header, PacketType

    frames, idx = [], np.array([1, 5, 9])
    for w, vals in enumerate(([3, -2, 7], [1, 2, -7])):
        h = Header(type=PacketType.SPARSE_DATA, job_id=7, worker_id=w, partition=0, round=0, seq=0,
                   total=1, flags=Flags.LAST, scale_exp=8, base=0)
        frames.append(Ether() / IP(src=f"10.0.0.{w + 1}", dst="10.0.9.1")
                      / UDP(sport=40000, dport=wire.DEFAULT_PORT)
                      / Raw(wire.build_packet(h, np.stack([idx, np.array(vals)], 1))))
    h = Header(type=PacketType.SPARSE_RESULT, job_id=7, worker_id=DPU_SENDER_ID, partition=0, round=0,
               seq=0, total=1, flags=Flags.LAST, scale_exp=8, base=0)
    frames.append(Ether() / IP(src="10.0.9.1", dst="10.0.0.1") / UDP(sport=wire.DEFAULT_PORT, dport=40000)
                  / Raw(wire.build_packet(h, np.array([[1, 4]]))))
    wrpcap(str(path), frames)


class Confined:
    """Runs argv in a fresh private mount namespace set up as ``mode`` describes."""

    def __init__(self, mode: str, work: Path):
        self.mode, self.work = mode, work
        self.home = work / "home"
        self.home.mkdir()
        os.chmod(self.home, 0o777)
        if mode == "no-libbpf":
            assert glob.glob(LIBBPF), f"no {LIBBPF} on this machine to hide"
            self.prelude, self.prefix = HIDE_BPF, []
        else:
            need = [os.path.realpath(p) for p in (REPO, sys.prefix, sys.executable, work)]
            self.prelude = _lend_to_nobody(need, str(work / ".lend"))
            self.prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

    def argv(self, cmd: list[str]) -> list[str]:
        script = "set -e\n" + self.prelude + 'exec "$@"'
        env = ["env", f"HOME={self.home}"]
        return ["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script, "confined",
                *self.prefix, *env, *cmd]

    def run(self, cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout,
                              cwd=self.work, stdin=subprocess.DEVNULL)

    def start(self, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(self.argv(cmd), cwd=self.work, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)


def _dosa() -> list[str]:
    script = Path(sys.executable).parent / "dosa"  # the console script a user runs
    return [str(script)] if script.exists() else [sys.executable, "-m", "dosa"]


def _stop(p: subprocess.Popen) -> str:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)  # ctl serve removes its state file on SIGTERM
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.stderr.read() if p.stderr else ""


def _wait_port(port: int, server: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert server.poll() is None, f"ctl serve exited: {server.stderr.read()}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("ctl serve did not listen")


@pytest.fixture
def work():
    """A directory every user may read (pytest's own tmp_path is root's alone); removed after."""
    d = Path(tempfile.mkdtemp(prefix="dosa-confined-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _one_sentence(r: subprocess.CompletedProcess) -> str:
    """The refusal's sentence: exit status 2, one 'dosa: ...' line on stderr, no traceback."""
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("dosa: "), err
    return err


@pytest.mark.parametrize("mode", ["no-libbpf", "no-root"])
def test_host_side_commands_answer_and_bpf_commands_refuse_in_one_sentence(mode, work):
    pcap, job_path = work / "t.pcap", work / "job.json"
    _pcap(pcap)
    dpu_port, api_port = free_port(), free_port()
    job = JobConfig(job_id=5, numel=1000, hosts=[("127.0.0.1", free_port()), ("127.0.0.1", free_port())],
                    dpus=[("127.0.0.1", dpu_port)], partition_size=256)
    job_path.write_text(json.dumps(job.to_dict()))
    for f in (pcap, job_path):
        os.chmod(f, 0o644)
    box, dosa, py = Confined(mode, work), _dosa(), [sys.executable]
    printed = []  # what each command printed, shown with pytest -s

    def shown(cmd: list[str]) -> str:
        return " ".join(["dosa", *cmd[len(dosa):]] if cmd[:len(dosa)] == dosa else ["python", *cmd[1:]])

    def answers(cmd: list[str], expect: str, timeout: float = 120) -> None:
        r = box.run(cmd, timeout)
        printed.append(f"[{mode}] $ {shown(cmd)}\n  rc {r.returncode}, last line: "
                       f"{(r.stdout.strip().splitlines() or [''])[-1][:150]}")
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.returncode, r.stdout, r.stderr)
        assert expect in r.stdout, (cmd, r.stdout)

    def refuses(cmd: list[str], *words: str) -> None:
        r = box.run(cmd)
        err = _one_sentence(r)
        printed.append(f"[{mode}] $ {shown(cmd)}\n  rc {r.returncode}: {err}")
        assert all(w in err for w in words), (words, err)

    answers([*dosa, "--help"], "capture")
    answers([*dosa, "capture", "show", str(pcap)], "3 dosa packets")
    answers([*dosa, "capture", "verify", str(pcap)], "OK")
    answers([*dosa, "capture", "dissector"], ".lua")
    answers([*dosa, "deploy", "--inventory", str(REPO / "testbed/examples/inventory.toml"), "--dry-run"],
            "torchrun")
    answers([*dosa, "bench", "host", "--numel", "100000", "--repeat", "1", "--exact-repeat", "1"],
            "fast")
    answers([*py, "-c", "import host_lib.torch_hook, dosa.transport; print('hook imported')"],
            "hook imported")
    answers([*dosa, "dpu", "run", "--mode", "userspace", "--job-config", str(job_path), "--addr",
             "127.0.0.1", "--port", str(dpu_port), "--duration", "1"], "")
    server = box.start([*dosa, "ctl", "serve", "--mode", "userspace", "--insecure", "--addr", "127.0.0.1",
                        "--listen", f"127.0.0.1:{api_port}", "--instance", f"dt22-{os.getpid()}"])
    try:
        _wait_port(api_port, server)
        answers([*dosa, "ctl", "job", "ls", "--control", f"127.0.0.1:{api_port}"], "no jobs")
        refuses([*dosa, "ctl", "job", "rm", "--job", "99", "--control", f"127.0.0.1:{api_port}"])
    finally:
        err = _stop(server)
    assert "Traceback" not in err, err

    if mode == "no-libbpf":
        refuses([*dosa, "ctl", "stats", "--instance", "fake22"], "libbpf1")
        refuses([*dosa, "dpu", "run", "--mode", "xdp", "--instance", "fake22", "--job-config", str(job_path),
                 "--duration", "1"], "libbpf1")
        refuses([*dosa, "ctl", "attach", "--iface", "lo", "--instance", "dt22none"], "BCC", "libbpf1")
        refuses([*dosa, "ctl", "job", "ls"], "not loaded")
    else:
        for cmd in (["ctl", "stats"], ["ctl", "attach", "--iface", "lo", "--instance", "dt22none"],
                    ["dpu", "run", "--mode", "xdp", "--job-config", str(job_path), "--duration", "1"],
                    ["testbed", "up", "--hosts", "2", "--dpus", "1", "--prefix", "dt22none"],
                    ["bench", "dataplane"]):
            refuses([*dosa, *cmd], "needs root")
    print("\n".join(printed))
