"""OpenSSH servers inside a testbed's namespaces, so ``dosa deploy`` runs for real on one machine.

Each node (``h0``, ``d0``, ...) gets Debian's ``/usr/sbin/sshd`` listening on its own address only,
with a host key of its own and one client key that this lab generates; the client side is pinned
(``StrictHostKeyChecking=yes`` against a known_hosts file of those host keys, ``BatchMode``, only
that identity, no user or system ssh configuration). Everything -- keys, configs, logs, pid files --
lives in one private directory that ``stop`` removes::

    with scratch_testbed(hosts=2, dpus=1, services=False) as tb, SshLab(tb) as lab:
        inv = lab.write_inventory(tmp / "inventory.toml", remote_dir=tmp / "remote")
        tb.exec_in("h0", ["dosa", "deploy", "--inventory", str(inv)], check=True)

What one machine cannot give (separate file systems, separate kernels) is in docs/testbed.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dosa.errors import DosaError

from testbed import ns
from testbed.config import NODE_IFACE
from testbed.core import Testbed

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege-separation directory
SSH_PORT = 22


def keygen(path: Path, comment: str) -> Path:
    """A new ed25519 key pair without passphrase at ``path`` (+ ``.pub``)."""
    p = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise DosaError(f"ssh-keygen failed: {p.stderr.strip()}")
    return path


def _config(addr: str, port: int, host_key: Path, authorized: Path, pid_file: Path) -> str:
    # StrictModes no: the keys live in a temporary directory, not in a home directory sshd would
    # check; the directory is private (0700, root) instead
    return "\n".join([
        f"ListenAddress {addr}:{port}", f"HostKey {host_key}", f"AuthorizedKeysFile {authorized}",
        f"PidFile {pid_file}", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no", "X11Forwarding no", "AllowTcpForwarding no", "AllowAgentForwarding no",
        "PermitTunnel no", "PrintMotd no", "UseDNS no", "LogLevel VERBOSE", ""])


class SshLab:
    """sshd in every node of ``tb`` (an up testbed), and the client options that reach them."""

    def __init__(self, tb: Testbed, nodes: list[str] | None = None, port: int = SSH_PORT,
                 ready_timeout: float = 10.0):
        if not os.path.exists(SSHD):
            raise DosaError(f"{SSHD} is missing: install Debian's openssh-server (make setup does)")
        self.tb, self.port, self.ready_timeout = tb, port, ready_timeout
        lay = tb.layout()
        every = {n.name: n for n in lay.nodes}
        names = nodes or list(every)
        unknown = [n for n in names if n not in every]
        if unknown:
            raise DosaError(f"node(s) {', '.join(unknown)} are not in testbed {tb.prefix!r}")
        self.nodes = [every[n] for n in names]
        self.dir: Path | None = None
        self.servers: dict[str, subprocess.Popen] = {}
        self._made_privsep = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "SshLab":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"dosa-ssh-{self.tb.prefix}-"))  # 0700
        try:
            self.key = keygen(self.dir / "id_ed25519", f"dosa-testbed-{self.tb.prefix}")
            authorized = self.dir / "authorized_keys"
            shutil.copyfile(self.key.with_suffix(".pub"), authorized)
            if not PRIVSEP_DIR.exists():
                PRIVSEP_DIR.mkdir(mode=0o755)
                self._made_privsep = True
            known = []
            for n in self.nodes:
                hk = keygen(self.dir / f"host_{n.name}_ed25519", f"{n.name}@{self.tb.prefix}")
                kind, blob = hk.with_suffix(".pub").read_text().split()[:2]
                where = n.address if self.port == SSH_PORT else f"[{n.address}]:{self.port}"
                known.append(f"{where} {kind} {blob}")
                conf = self.dir / f"sshd_{n.name}.conf"
                conf.write_text(_config(n.address, self.port, hk, authorized,
                                        self.dir / f"sshd_{n.name}.pid"))
                log = self.dir / f"sshd_{n.name}.log"
                # -D: stay in the foreground (this object owns the process); -E: log to a file
                self.servers[n.name] = self.tb.popen_in(
                    n.name, [SSHD, "-D", "-f", str(conf), "-E", str(log)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    start_new_session=True)
            (self.dir / "known_hosts").write_text("\n".join(known) + "\n")
            self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        waiting = dict(self.servers)
        while waiting:
            for name, p in list(waiting.items()):
                if p.poll() is not None:
                    err = (p.stderr.read() or b"").decode(errors="replace").strip()
                    log = self.dir / f"sshd_{name}.log"
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                    raise DosaError(f"sshd on {name} exited with status {p.returncode}: "
                                    f"{err or ' '.join(tail) or 'no output'}")
                if ns.listening(p.pid, self.port, "tcp"):
                    del waiting[name]
            if waiting and time.monotonic() > deadline:
                raise DosaError(f"sshd on {', '.join(waiting)} not listening on port {self.port} "
                                f"after {self.ready_timeout:g}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop every sshd (and the sessions it still serves), remove keys, configs and logs."""
        for p in self.servers.values():
            # sshd -D's session processes are in its session; kill the whole process group
            for sig in (15, 9):
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        p.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        continue
            if p.stderr:
                p.stderr.close()
        self.servers.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._made_privsep:
            try:
                PRIVSEP_DIR.rmdir()
            except OSError:  # another sshd made files there meanwhile: leave it
                pass
            self._made_privsep = False

    # ------------------------------------------------------------------ client side
    def ssh_options(self) -> list[str]:
        """ssh options that reach the lab's servers with its key and nothing else."""
        return ["-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={self.dir / 'known_hosts'}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=10", "-p", str(self.port)]

    def destination(self, node: str) -> str:
        return f"root@{next(n.address for n in self.nodes if n.name == node)}"

    def ssh_argv(self, node: str, command: str) -> list[str]:
        """argv that runs ``command`` on ``node`` over ssh (run it from inside a node)."""
        return ["ssh", *self.ssh_options(), self.destination(node), command]

    def write_inventory(self, path: Path, remote_dir: Path, source: Path | None = None,
                        setup: str | None = None, mode: str = "xdp", tls: bool = False) -> Path:
        """A ``dosa deploy`` inventory of this testbed's nodes, reached through the lab's sshd.

        The run, log, pin and credential directories go under the testbed's own (removed by
        ``down``), so a deploy into the testbed never touches /run/dosa, /var/log/dosa, /etc/dosa
        or another instance."""
        from testbed.config import REPO_ROOT

        st = self.tb.load_state()
        q = lambda s: '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'  # noqa: E731
        lines = ["[deploy]", f"source = {q(source or REPO_ROOT)}", f"remote_dir = {q(remote_dir)}",
                 'method = "rsync"', "ssh_options = [" + ", ".join(q(o) for o in self.ssh_options()) + "]",
                 f"data_port = {st['data_port']}", f"control_port = {st['control_port']}",
                 f"mode = {q(mode)}", f"run_dir = {q(self.tb.run_dir / 'deploy-run')}",
                 f"log_dir = {q(self.tb.run_dir / 'deploy-log')}", f"pin_root = {q(self.tb.pin_dir)}",
                 f"secret_dir = {q(self.tb.run_dir / 'deploy-secrets')}", f"tls = {str(tls).lower()}"]
        if setup is not None:
            lines.append(f"setup = {q(setup)}")
        for role, key in (("host", "hosts"), ("dpu", "dpus")):
            for n in self.nodes:
                if n.role == role:
                    lines += ["", f"[[{key}]]", f"name = {q(n.name)}", f"ssh = {q(self.destination(n.name))}",
                              f"iface = {q(NODE_IFACE)}", f"addr = {q(n.address)}"]
        path = Path(path)
        path.write_text("\n".join(lines) + "\n")
        return path
