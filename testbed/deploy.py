"""``dosa deploy``: install dosa on real hosts and DPUs over ssh and start the DPU side.

The plan is a plain list of commands (``plan()``), built from an inventory (TOML, see
testbed/examples/inventory.toml): ``--dry-run`` prints it, a real run executes it step by step and
stops at the first failure. The DPU-side command lines come from testbed.services, the same function
the namespace testbed uses, so the two cannot drift.

Per machine (hosts and DPUs): create the remote directory, ship the checkout (rsync, or git clone /
fetch), ``make setup``, install its credentials. Per DPU: stop what a previous deploy started (pid
files), start each service detached (setsid nohup, log in /var/log/dosa, pid in /run/dosa), poll its
readiness probe.

Credentials (testbed/credentials.py): every deploy makes a new deployment secret (so a deploy
rotates it) and, with ``tls = true``, a new CA and a certificate for each DPU. They are made in
memory on this machine when the plan runs (a dry run makes none), reach each machine on ssh's
stdin (never in a command line, where ``ps`` would show them) and land in ``secret_dir`` with mode
0600: a DPU gets the DPUs' secret file (every role) and its certificate, a host the hosts' file
(the host key only), every machine the CA certificate.
"""
from __future__ import annotations

import io
import ipaddress
import re
import shlex
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib  # novermin (tomli below on 3.10)
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package (a dependency there)
    import tomli as tomllib

from dosa.env import RankEnv
from dosa.errors import DosaError
from dosa.job import DPU_MODES, DpuMode

from testbed import credentials
from testbed.services import CONTROL_PORT, DATA_PORT, DpuContext, dpu_services

EXAMPLE = Path(__file__).with_name("examples") / "inventory.toml"
REMOTE_RUN = "/run/dosa"
REMOTE_LOG = "/var/log/dosa"
REMOTE_PIN = "/sys/fs/bpf/dosa"
REMOTE_SECRETS = "/etc/dosa"
DEFAULT_SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
RSYNC_EXCLUDES = [".git", ".venv", "build", "*.so", "__pycache__", "*.egg-info"]
READY_POLLS = 300  # x 0.1 s
STOP_POLLS = 100  # x 0.1 s, then SIGKILL

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
_IFACE_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_SSH_RE = re.compile(r"^[^\s;&|`$'\"<>]+$")


@dataclass(frozen=True)
class Machine:
    role: str  # host | dpu
    name: str
    ssh: str
    iface: str
    addr: str


@dataclass(frozen=True)
class Inventory:
    path: str
    hosts: tuple[Machine, ...]
    dpus: tuple[Machine, ...]
    source: str
    remote_dir: str
    method: str
    git_url: str | None
    git_ref: str
    ssh_options: tuple[str, ...]
    data_port: int
    control_port: int
    mode: str
    setup: str = "make setup"  # run in remote_dir on every machine after shipping
    run_dir: str = REMOTE_RUN  # pid and readiness files on the DPUs
    log_dir: str = REMOTE_LOG  # service logs on the DPUs
    pin_root: str = REMOTE_PIN  # each DPU's dataplane is pinned in <pin_root>/<dpu name>
    secret_dir: str = REMOTE_SECRETS  # the credentials on every machine (mode 0600)
    tls: bool = False  # the control planes serve HTTPS with certificates of a CA the deploy makes


@dataclass(frozen=True)
class Step:
    target: str  # machine name
    what: str  # one-line description
    argv: list[str]
    stdin: object = None  # a function returning the bytes to feed the command (made when it runs)

    def shell(self) -> str:
        return shlex.join(self.argv)


def load_inventory(path: str | Path) -> Inventory:
    """Parse and validate an inventory; any problem is one DosaError naming the file and key."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise DosaError(f"inventory {path} does not exist (see {EXAMPLE})") from None
    except tomllib.TOMLDecodeError as e:
        raise DosaError(f"inventory {path} is not valid TOML: {e}") from None

    def bad(msg: str) -> DosaError:
        return DosaError(f"inventory {path}: {msg}")

    unknown = set(data) - {"deploy", "hosts", "dpus"}
    if unknown:
        raise bad(f"unknown section(s) {', '.join(sorted(unknown))} (expected deploy, hosts, dpus)")
    d = data.get("deploy", {})
    if not isinstance(d, dict):
        raise bad("[deploy] must be a table")
    known = {"source", "remote_dir", "method", "git_url", "git_ref", "ssh_options", "data_port",
             "control_port", "mode", "setup", "run_dir", "log_dir", "pin_root", "secret_dir", "tls"}
    if set(d) - known:
        raise bad(f"unknown key(s) in [deploy]: {', '.join(sorted(set(d) - known))}")
    machines = _machines(data, bad)
    o = _deploy_options(d, bad)
    # a relative source is relative to the inventory file's directory
    source = o.pop("source")
    src = (path.parent / source).resolve() if not Path(source).is_absolute() else Path(source)
    return Inventory(str(path), tuple(machines["hosts"]), tuple(machines["dpus"]), str(src), **o)


def _machines(data: dict, bad) -> dict[str, list[Machine]]:
    """The [[hosts]] and [[dpus]] tables: every machine named once, at its own IPv4 address."""
    machines: dict[str, list[Machine]] = {}
    names: set[str] = set()
    for role, key in (("host", "hosts"), ("dpu", "dpus")):
        items = data.get(key)
        if not isinstance(items, list) or not items:
            raise bad(f"needs at least one [[{key}]] entry")
        out = []
        for i, m in enumerate(items):
            where = f"{key}[{i}]"
            if not isinstance(m, dict):
                raise bad(f"{where} must be a table")
            missing = [k for k in ("name", "ssh", "iface", "addr") if k not in m]
            if missing:
                raise bad(f"{where} is missing {', '.join(missing)}")
            extra = set(m) - {"name", "ssh", "iface", "addr"}
            if extra:
                raise bad(f"{where} has unknown key(s) {', '.join(sorted(extra))}")
            if not isinstance(m["name"], str) or not _NAME_RE.match(m["name"]):
                raise bad(f"{where}.name {m['name']!r} must be 1-32 letters, digits, _ . -")
            if m["name"] in names:
                raise bad(f"{where}.name {m['name']!r} is used twice")
            names.add(m["name"])
            if not isinstance(m["ssh"], str) or not _SSH_RE.match(m["ssh"]):
                raise bad(f"{where}.ssh {m['ssh']!r} must be an ssh destination like root@host")
            if not isinstance(m["iface"], str) or not _IFACE_RE.match(m["iface"]):
                raise bad(f"{where}.iface {m['iface']!r} is not an interface name")
            try:
                addr = str(ipaddress.IPv4Address(m["addr"]))
            except (ValueError, TypeError):
                raise bad(f"{where}.addr {m['addr']!r} is not an IPv4 address") from None
            out.append(Machine(role, m["name"], m["ssh"], m["iface"], addr))
        machines[key] = out
    addrs = [m.addr for ms in machines.values() for m in ms]
    dup = {a for a in addrs if addrs.count(a) > 1}
    if dup:
        raise bad(f"address(es) {', '.join(sorted(dup))} used by more than one machine")
    return machines


def _deploy_options(d: dict, bad) -> dict:
    """The [deploy] table's options, checked, with their defaults: Inventory's keyword arguments
    (and ``source``, as written)."""
    method = d.get("method", "rsync")
    if method not in ("rsync", "git"):
        raise bad(f"deploy.method must be rsync or git, not {method!r}")
    git_url = d.get("git_url")
    if method == "git" and not (isinstance(git_url, str) and git_url):
        raise bad("deploy.method = \"git\" needs deploy.git_url")
    remote_dir = d.get("remote_dir", "/opt/dosa")
    if not isinstance(remote_dir, str) or not remote_dir.startswith("/") or remote_dir.rstrip("/") == "":
        raise bad(f"deploy.remote_dir {remote_dir!r} must be an absolute path other than /")
    ports = {}
    for k, default in (("data_port", DATA_PORT), ("control_port", CONTROL_PORT)):
        v = d.get(k, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
            raise bad(f"deploy.{k} must be a port number 1..65535, not {v!r}")
        ports[k] = v
    mode = d.get("mode", DpuMode.XDP.value)
    if mode not in DPU_MODES:
        raise bad(f"deploy.mode must be {' or '.join(DPU_MODES)}, not {mode!r}")
    opts = d.get("ssh_options", DEFAULT_SSH_OPTIONS)
    if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
        raise bad("deploy.ssh_options must be a list of strings")
    source = d.get("source", ".")
    if not isinstance(source, str):
        raise bad("deploy.source must be a path")
    setup = d.get("setup", "make setup")
    if not isinstance(setup, str) or not setup.strip():
        raise bad("deploy.setup must be a shell command (default \"make setup\")")
    dirs = {}
    for k, default in (("run_dir", REMOTE_RUN), ("log_dir", REMOTE_LOG), ("pin_root", REMOTE_PIN),
                       ("secret_dir", REMOTE_SECRETS)):
        v = d.get(k, default)
        if not isinstance(v, str) or not v.startswith("/") or not _SSH_RE.match(v) or v.rstrip("/") == "":
            raise bad(f"deploy.{k} {v!r} must be an absolute path other than / without spaces or quotes")
        dirs[k] = v.rstrip("/")
    tls = d.get("tls", False)
    if not isinstance(tls, bool):
        raise bad(f"deploy.tls must be true or false, not {tls!r}")
    return dict(source=source, remote_dir=remote_dir.rstrip("/"), method=method, git_url=git_url,
                git_ref=str(d.get("git_ref", "main")), ssh_options=tuple(opts), **ports, mode=mode,
                setup=setup.strip(), **dirs, tls=tls)


def _ssh(inv: Inventory, m: Machine, remote: str) -> list[str]:
    return ["ssh", *inv.ssh_options, m.ssh, remote]


def _ship(inv: Inventory, m: Machine) -> list[Step]:
    d = inv.remote_dir
    steps = [Step(m.name, f"create {d}", _ssh(inv, m, f"mkdir -p {shlex.quote(d)}"))]
    if inv.method == "rsync":
        excludes = [f"--exclude={x}" for x in RSYNC_EXCLUDES]
        steps.append(Step(m.name, f"copy {inv.source} to {d}", [
            "rsync", "-az", "--delete", *excludes, "-e", shlex.join(["ssh", *inv.ssh_options]),
            inv.source.rstrip("/") + "/", f"{m.ssh}:{d}/"]))
    else:
        q, url, ref = shlex.quote(d), shlex.quote(inv.git_url), shlex.quote(inv.git_ref)
        steps.append(Step(m.name, f"git checkout {inv.git_ref} in {d}", _ssh(inv, m, (
            f"if [ -d {q}/.git ]; then git -C {q} fetch --quiet origin; "
            f"else git clone --quiet {url} {q}; fi && git -C {q} checkout --quiet --force {ref}"))))
    steps.append(Step(m.name, inv.setup, _ssh(inv, m, f"cd {shlex.quote(d)} && {inv.setup}")))
    return steps


class Credentials:
    """The files one deploy hands out (the module doc), made on first use: in a private temporary
    directory, read into memory and the directory removed at once."""

    def __init__(self, inv: Inventory):
        self.inv = inv
        self._files: dict[str, bytes] | None = None

    def _make(self) -> dict[str, bytes]:
        if self._files is None:
            with tempfile.TemporaryDirectory(prefix="dosa-deploy-") as tmp:
                credentials.make_secret(Path(tmp))
                if self.inv.tls:
                    credentials.make_tls(Path(tmp), {m.name: m.addr for m in self.inv.dpus})
                self._files = {p.name: p.read_bytes() for p in Path(tmp).iterdir()}
        return self._files

    @staticmethod
    def names(inv: Inventory, m: Machine) -> list[str]:
        """The files machine ``m`` gets."""
        if m.role == "dpu":
            names = [credentials.DPU_SECRET, *(credentials.cert_files(m.name) if inv.tls else ())]
        else:
            names = [credentials.HOST_SECRET]
        return names + ([credentials.CA_CERT] if inv.tls else [])

    def tar(self, m: Machine) -> bytes:
        """Machine ``m``'s files as a tar archive (what its install step reads on stdin)."""
        files, buf = self._make(), io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name in self.names(self.inv, m):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(files[name]), 0o600
                t.addfile(info, io.BytesIO(files[name]))
        return buf.getvalue()


def _credential_step(inv: Inventory, m: Machine, creds: Credentials) -> Step:
    d = shlex.quote(inv.secret_dir)
    return Step(m.name, f"install {', '.join(Credentials.names(inv, m))} in {inv.secret_dir} (on stdin)",
                _ssh(inv, m, f"umask 077 && mkdir -p {d} && tar -x -f - -C {d} --no-same-owner "
                             "--no-same-permissions"),
                stdin=lambda: creds.tar(m))


def dpu_context(inv: Inventory, j: int) -> DpuContext:
    m = inv.dpus[j]
    crt, key = credentials.cert_files(m.name)
    tls = {"tls_cert": f"{inv.secret_dir}/{crt}", "tls_key": f"{inv.secret_dir}/{key}",
           "ca_file": f"{inv.secret_dir}/{credentials.CA_CERT}"} if inv.tls else {}
    return DpuContext(index=j, iface=m.iface, address=m.addr,
                      host_addrs=tuple(h.addr for h in inv.hosts), mode=inv.mode,
                      pin_dir=f"{inv.pin_root}/{m.name}", run_dir=inv.run_dir,
                      data_port=inv.data_port, control_port=inv.control_port,
                      python=(f"{inv.remote_dir}/.venv/bin/python",),
                      secret_file=f"{inv.secret_dir}/{credentials.DPU_SECRET}", **tls)


def _stop_steps(inv: Inventory, j: int) -> list[Step]:
    m = inv.dpus[j]
    steps = []
    for svc in reversed(dpu_services(dpu_context(inv, j))):
        pid = f"{inv.run_dir}/{svc.name}.pid"
        # wait until it has exited (SIGKILL after STOP_POLLS): the next start must not find the
        # old process still holding the port, the XDP attachment or the pinned maps
        steps.append(Step(m.name, f"stop {svc.name}", _ssh(inv, m, (
            f"if [ -f {pid} ]; then p=$(cat {pid}); kill $p 2>/dev/null; "
            f"for i in $(seq {STOP_POLLS}); do kill -0 $p 2>/dev/null || break; sleep 0.1; done; "
            f"kill -9 $p 2>/dev/null; rm -f {pid}; fi; true"))))
    return steps


def _start_steps(inv: Inventory, j: int) -> list[Step]:
    m = inv.dpus[j]
    steps = []
    for svc in dpu_services(dpu_context(inv, j)):
        pid, log = f"{inv.run_dir}/{svc.name}.pid", f"{inv.log_dir}/{svc.name}.log"
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in svc.env.items())
        # a readiness file left by a previous run must not count as ready
        clear = f"rm -f {shlex.quote(str(svc.ready[1]))} && " if svc.ready and svc.ready[0] == "file" else ""
        # the braces matter: without them `&` puts the whole `mkdir && cd && ...` list in a
        # background subshell that keeps the ssh session's output open (the step never ends) and
        # $! names that subshell, not the service (found by the real deploy test)
        steps.append(Step(m.name, f"start {svc.name}", _ssh(inv, m, (
            f"mkdir -p {inv.run_dir} {inv.log_dir} && {clear}cd {shlex.quote(inv.remote_dir)} && "
            f"{{ {env + ' ' if env else ''}setsid nohup {shlex.join(svc.argv)} > {log} 2>&1 < /dev/null "
            f"& echo $! > {pid}; }}"))))
        probe = _probe_shell(svc.ready)
        if probe:
            steps.append(Step(m.name, f"wait for {svc.name}", _ssh(inv, m, (
                f"for i in $(seq {READY_POLLS}); do {probe} && exit 0; "
                f"kill -0 $(cat {pid}) 2>/dev/null || break; sleep 0.1; done; "
                f"echo '{svc.name} not ready, see {log}' >&2; tail -n 5 {log} >&2; exit 1"))))
    return steps


def _probe_shell(ready) -> str | None:
    if not ready:
        return None
    kind, arg = ready
    if kind == "tcp":
        return f"ss -Hltn 'sport = :{int(arg)}' | grep -q ."
    if kind == "udp":
        return f"ss -Hlun 'sport = :{int(arg)}' | grep -q ."
    if kind == "file":
        return f"test -e {shlex.quote(str(arg))}"
    raise DosaError(f"unknown readiness probe {ready!r}")


def plan(inv: Inventory, stop_only: bool = False, creds: Credentials | None = None) -> list[Step]:
    """Every command a deploy runs, in order (``creds``: the credentials its install steps hand out;
    default a new set, made only if those steps run)."""
    steps: list[Step] = []
    if not stop_only:
        seen = set()
        for m in (*inv.dpus, *inv.hosts):
            if m.ssh not in seen:  # one install per machine even if it has several roles
                seen.add(m.ssh)
                steps += _ship(inv, m)
        creds = creds or Credentials(inv)
        steps += [_credential_step(inv, m, creds) for m in (*inv.dpus, *inv.hosts)]
    for j in range(len(inv.dpus)):
        steps += _stop_steps(inv, j)
    if not stop_only:
        for j in range(len(inv.dpus)):
            steps += _start_steps(inv, j)
    return steps


def host_env(inv: Inventory, rank: int) -> dict[str, str]:
    """The DOSA_* variables a training process on host ``rank`` needs (see docs/testbed.md)."""
    h = inv.hosts[rank]
    return RankEnv(rank=None, host_addr=h.addr, iface=h.iface, port=inv.data_port,
                   dpu_addrs=[d.addr for d in inv.dpus], control=(inv.dpus[0].addr, inv.control_port),
                   secret_file=f"{inv.secret_dir}/{credentials.HOST_SECRET}",
                   control_ca=f"{inv.secret_dir}/{credentials.CA_CERT}" if inv.tls else None).to_env()


def execute(steps: list[Step], echo=print) -> None:
    for i, s in enumerate(steps, 1):
        echo(f"[{i}/{len(steps)}] {s.target}: {s.what}")
        try:
            p = subprocess.run(s.argv, input=s.stdin() if s.stdin else None)
        except FileNotFoundError:
            raise DosaError(f"{s.argv[0]} is not installed on this machine") from None
        if p.returncode != 0:
            raise DosaError(f"deploy step {i} ({s.what} on {s.target}) failed with exit status "
                            f"{p.returncode}: {s.shell()}")
