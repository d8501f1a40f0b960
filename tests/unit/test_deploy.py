"""``dosa deploy``: the exact commands planned for the example inventory, and clear errors for bad
inventories. Nothing here runs ssh: the plan is data, the dry run prints it."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dosa.errors import DosaError
from testbed import deploy

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "testbed" / "examples" / "inventory.toml"
SSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"
PY = "/opt/dosa/.venv/bin/python -m dosa"


def expected_plan() -> list[str]:
    ship = []
    for target in ("root@192.0.2.20", "root@192.0.2.10", "root@192.0.2.11"):
        ship += [
            f"{SSH} {target} 'mkdir -p /opt/dosa'",
            "rsync -az --delete --exclude=.git --exclude=.venv --exclude=build '--exclude=*.so' "
            f"--exclude=__pycache__ '--exclude=*.egg-info' -e '{SSH}' {REPO}/ {target}:/opt/dosa/",
            f"{SSH} {target} 'cd /opt/dosa && make setup'",
        ]
    creds = [f"{SSH} {target} 'umask 077 && mkdir -p /etc/dosa && tar -x -f - -C /etc/dosa --no-same-owner "
             "--no-same-permissions'" for target in ("root@192.0.2.20", "root@192.0.2.10", "root@192.0.2.11")]
    d = "root@192.0.2.20"
    stop = [f"{SSH} {d} 'if [ -f /run/dosa/{s}.pid ]; then p=$(cat /run/dosa/{s}.pid); kill $p 2>/dev/null; "
            "for i in $(seq 100); do kill -0 $p 2>/dev/null || break; sleep 0.1; done; kill -9 $p 2>/dev/null; "
            f"rm -f /run/dosa/{s}.pid; fi; true'" for s in ("dpu", "ctl")]
    ctl = (f"{PY} ctl serve --pin-dir /sys/fs/bpf/dosa/dpu0 --iface p0 --addr 10.10.0.200 "
           "--listen 10.10.0.200:17800 --port 17791 --mode xdp --worker-stats /run/dosa/dpu0-worker-stats.json "
           "--secret-file /etc/dosa/dpu.secret")
    worker = (f"{PY} dpu run --instance /sys/fs/bpf/dosa/dpu0 --iface p0 --addr 10.10.0.200 "
              "--port 17791 --mode xdp --dpu-index 0 --control 10.10.0.200:17800 "
              "--pid-file /run/dosa/dpu0-worker.ready --stats-file /run/dosa/dpu0-worker-stats.json")
    ready = "/run/dosa/dpu0-worker.ready"
    start = [
        (f"mkdir -p /run/dosa /var/log/dosa && cd /opt/dosa && {{ setsid nohup {ctl} > "
         "/var/log/dosa/ctl.log 2>&1 < /dev/null & echo $! > /run/dosa/ctl.pid; }"),
        ("for i in $(seq 300); do ss -Hltn 'sport = :17800' | grep -q . && exit 0; kill -0 "
         "$(cat /run/dosa/ctl.pid) 2>/dev/null || break; sleep 0.1; done; echo 'ctl not ready, see "
         "/var/log/dosa/ctl.log' >&2; tail -n 5 /var/log/dosa/ctl.log >&2; exit 1"),
        (f"mkdir -p /run/dosa /var/log/dosa && rm -f {ready} && cd /opt/dosa && {{ setsid nohup {worker} > "
         "/var/log/dosa/dpu.log 2>&1 < /dev/null & echo $! > /run/dosa/dpu.pid; }"),
        (f"for i in $(seq 300); do test -e {ready} && exit 0; kill -0 $(cat /run/dosa/dpu.pid) "
         "2>/dev/null || break; sleep 0.1; done; echo 'dpu not ready, see /var/log/dosa/dpu.log' >&2; "
         "tail -n 5 /var/log/dosa/dpu.log >&2; exit 1"),
    ]
    return ship + creds + stop + [f"{SSH} {d} {shlex.quote(c)}" for c in start]


def test_plan_for_the_example_inventory_is_exactly_these_commands():
    inv = deploy.load_inventory(EXAMPLE)
    assert [h.name for h in inv.hosts] == ["host0", "host1"] and [d.name for d in inv.dpus] == ["dpu0"]
    assert [s.shell() for s in deploy.plan(inv)] == expected_plan()


def test_dry_run_prints_every_command_and_runs_nothing():
    p = subprocess.run([sys.executable, "-m", "dosa", "deploy", "--inventory", str(EXAMPLE), "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    commands = [line for line in p.stdout.splitlines() if line and not line.startswith("#")]
    assert commands == expected_plan()
    assert "DOSA_CONTROL_ADDR=10.10.0.200 DOSA_CONTROL_PORT=17800" in p.stdout


def test_stop_only_plans_the_stop_commands():
    inv = deploy.load_inventory(EXAMPLE)
    assert [s.shell() for s in deploy.plan(inv, stop_only=True)] == expected_plan()[12:14]


def test_setup_and_directories_come_from_the_inventory(tmp_path):
    text = EXAMPLE.read_text().replace('mode = "xdp"', 'mode = "xdp"\nsetup = "make setup-fast"\n'
                                       'run_dir = "/srv/run/"\nlog_dir = "/srv/log"\npin_root = "/sys/fs/bpf/x"\n'
                                       'secret_dir = "/srv/keys"')
    inv_path = tmp_path / "inv.toml"
    inv_path.write_text(text)
    cmds = [s.shell() for s in deploy.plan(deploy.load_inventory(inv_path))]
    assert cmds[2].endswith("'cd /opt/dosa && make setup-fast'")
    assert "tar -x -f - -C /srv/keys" in cmds[9]
    assert "/srv/run/ctl.pid" in cmds[13] and "/srv/log/ctl.log" in cmds[14]
    assert "--pin-dir /sys/fs/bpf/x/dpu0" in cmds[14] and "--pid-file /srv/run/dpu0-worker.ready" in cmds[16]
    assert "--secret-file /srv/keys/dpu.secret" in cmds[14]


def test_git_method_clones_or_fetches_the_ref(tmp_path):
    text = EXAMPLE.read_text().replace('method = "rsync"', 'method = "git"\ngit_url = "https://example.org/dosa.git"\ngit_ref = "v1"')
    inv_path = tmp_path / "inv.toml"
    inv_path.write_text(text)
    steps = deploy.plan(deploy.load_inventory(inv_path))
    assert steps[1].argv[-1] == ("if [ -d /opt/dosa/.git ]; then git -C /opt/dosa fetch --quiet origin; "
                                 "else git clone --quiet https://example.org/dosa.git /opt/dosa; fi && "
                                 "git -C /opt/dosa checkout --quiet --force v1")


BAD = [
    ("[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n", r"needs at least one \[\[dpus\]\]"),
    ("[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.300'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"hosts\[0\]\.addr '10\.0\.0\.300' is not an IPv4"),
    ("[[hosts]]\nname='a'\nssh='r@x'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"hosts\[0\] is missing iface"),
    ("[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='a'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"dpus\[0\]\.name 'a' is used twice"),
    ("[[hosts]]\nname='a'\nssh='r@x; rm -rf /'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"hosts\[0\]\.ssh .* must be an ssh destination"),
    ("[deploy]\ncontrol_port=70000\n[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"deploy\.control_port must be a port"),
    ("[deploy]\nmethod='git'\n[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"needs deploy\.git_url"),
    ("[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.1'\n", r"10\.0\.0\.1 used by more than one"),
    ("[deploy]\nsetup='  '\n[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"deploy\.setup must be a shell command"),
    ("[deploy]\nrun_dir='run/dosa'\n[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"deploy\.run_dir 'run/dosa' must be an absolute"),
    ("[deploy]\npin_root='/sys/fs/bpf/a b'\n[[hosts]]\nname='a'\nssh='r@x'\niface='eth0'\naddr='10.0.0.1'\n"
     "[[dpus]]\nname='d'\nssh='r@y'\niface='p0'\naddr='10.0.0.2'\n", r"deploy\.pin_root .* without spaces"),
    ("[[hosts]\nname='a'\n", r"is not valid TOML"),
    ("[hostz]\n", r"unknown section\(s\) hostz"),
]


@pytest.mark.parametrize("text,error", BAD)
def test_bad_inventory_is_one_clear_error(tmp_path, text, error):
    path = tmp_path / "inv.toml"
    path.write_text(text)
    with pytest.raises(DosaError, match=error):
        deploy.load_inventory(path)


def test_bad_inventory_through_the_cli_is_one_line_without_traceback(tmp_path):
    path = tmp_path / "inv.toml"
    path.write_text(BAD[1][0])
    p = subprocess.run([sys.executable, "-m", "dosa", "deploy", "--inventory", str(path), "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 2
    assert p.stderr.startswith("dosa: inventory ") and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    missing = subprocess.run([sys.executable, "-m", "dosa", "deploy", "--inventory",
                              str(tmp_path / "nope.toml"), "--dry-run"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_dpu_service_command_lines_are_accepted_by_the_dosa_cli():
    """The flags testbed/services.py passes must exist in `dosa ctl serve` / `dosa dpu run`:
    parsed by the real CLI parser (nothing is started), so a renamed flag fails here, not in `up`."""
    from dosa.app.cli import build_parser
    from testbed.services import DpuContext, dpu_services

    parser = build_parser()
    ctx = DpuContext(index=1, iface="eth0", address="10.77.0.201", host_addrs=("10.77.0.10",),
                     mode="xdp", pin_dir="/sys/fs/bpf/dosa/d1", run_dir="/run/dosa/dosa")
    services = dpu_services(ctx)
    assert [s.name for s in services] == ["ctl", "dpu"]
    for svc in services:
        assert svc.argv[1:3] == ["-m", "dosa"]
        args = parser.parse_args(svc.argv[3:])
        assert callable(args.func)
        assert args.mode == "xdp" and args.addr == "10.77.0.201" and args.port == ctx.data_port
    assert parser.parse_args(services[0].argv[3:]).listen == ("10.77.0.201", 17800)
    assert parser.parse_args(services[0].argv[3:]).insecure  # no secret given: said out loud
    tls = DpuContext(index=1, iface="eth0", address="10.77.0.201", host_addrs=("10.77.0.10",), mode="xdp",
                     pin_dir="/sys/fs/bpf/dosa/d1", run_dir="/run/dosa/dosa", secret_file="/k/dpu.secret",
                     tls_cert="/k/d1.crt", tls_key="/k/d1.key", ca_file="/k/ca.crt")
    ctl, worker = dpu_services(tls)
    a = parser.parse_args(ctl.argv[3:])
    assert (a.secret_file, a.insecure, a.tls_cert, a.tls_key, a.tls_ca) == \
        ("/k/dpu.secret", False, "/k/d1.crt", "/k/d1.key", "/k/ca.crt")
    assert ctl.env == worker.env == {"DOSA_CONTROL_CA": "/k/ca.crt"}


def _tar_members(data: bytes) -> dict:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        return {m.name: (m.mode, t.extractfile(m).read()) for m in t.getmembers()}


def test_credentials_go_on_stdin_a_dpu_gets_every_role_a_host_only_its_own(tmp_path):
    """The secret is never in a command line (``ps`` would show it): each machine's install step
    reads a tar of its files on stdin, made when the step runs (a dry run makes none)."""
    from dosa.auth import Secret

    inv = deploy.load_inventory(EXAMPLE)
    creds = deploy.Credentials(inv)
    steps = [s for s in deploy.plan(inv, creds=creds) if s.stdin is not None]
    assert [s.target for s in steps] == ["dpu0", "host0", "host1"]
    assert creds._files is None  # nothing made yet
    assert all("secret" not in " ".join(s.argv[:-1]) for s in steps)
    dpu, host0, host1 = (_tar_members(s.stdin()) for s in steps)
    assert set(dpu) == {"dpu.secret"} and set(host0) == set(host1) == {"host.secret"}
    assert {m for m, _ in (*dpu.values(), *host0.values())} == {0o600}
    full, mine = Secret.loads(dpu["dpu.secret"][1]), Secret.loads(host0["host.secret"][1])
    assert set(full.keys) == {"host", "operator", "peer"} and mine.keys == {"host": full.keys["host"]}
    assert deploy.host_env(inv, 0)["DOSA_SECRET_FILE"] == "/etc/dosa/host.secret"
    # every deploy makes a new secret
    again = _tar_members(deploy.plan(inv)[9].stdin())
    assert Secret.loads(again["dpu.secret"][1]).keys != full.keys


def test_tls_makes_a_ca_and_a_certificate_for_each_dpu_and_the_services_use_them(tmp_path):
    import ssl

    text = EXAMPLE.read_text().replace('mode = "xdp"', 'mode = "xdp"\ntls = true')
    inv_path = tmp_path / "inv.toml"
    inv_path.write_text(text)
    inv = deploy.load_inventory(inv_path)
    creds = deploy.Credentials(inv)
    steps = deploy.plan(inv, creds=creds)
    dpu = _tar_members(next(s for s in steps if s.stdin and s.target == "dpu0").stdin())
    host = _tar_members(next(s for s in steps if s.stdin and s.target == "host0").stdin())
    assert set(dpu) == {"dpu.secret", "dpu0.crt", "dpu0.key", "ca.crt"} and set(host) == {"host.secret", "ca.crt"}
    for name, (mode, data) in dpu.items():
        (tmp_path / name).write_bytes(data)
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))  # the CA is a CA
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(tmp_path / "dpu0.crt", tmp_path / "dpu0.key")
    assert ctx.get_ca_certs()[0]["subject"] == ((("commonName", "dosa control plane CA"),),)
    start_ctl = next(s.shell() for s in steps if s.what == "start ctl")
    assert ("--tls-cert /etc/dosa/dpu0.crt --tls-key /etc/dosa/dpu0.key --tls-ca /etc/dosa/ca.crt" in start_ctl
            and "DOSA_CONTROL_CA=/etc/dosa/ca.crt setsid" in start_ctl)
    assert deploy.host_env(inv, 1)["DOSA_CONTROL_CA"] == "/etc/dosa/ca.crt"
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace('mode = "xdp"', 'mode = "xdp"\ntls = "yes"'))
    with pytest.raises(DosaError, match="deploy.tls must be true or false"):
        deploy.load_inventory(bad)
