"""The `dosa` command imports only what the command being run needs (dosa.app.cli.COMMANDS), lists a
command it cannot import in --help with why, and a missing library or package is one sentence.
tests/netns/test_no_bpf_no_root.py runs the commands on a machine without libbpf and without root."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dosa.app import cli
from dosa.errors import DosaError

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

HEAVY = ["control.cli", "testbed.cli", "benchmarks.cli", "dosa.app.offload_cli", "dataplane.libbpf",
         "pyroute2", "torch", "bcc"]


def test_a_command_imports_only_its_own_module(tmp_path):
    code = (f"import json, sys\nfrom dosa.app.cli import main\nrc = main(['capture', 'dissector'])\n"
            f"print(json.dumps([rc, [m for m in {HEAVY!r} if m in sys.modules]]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env=dict(os.environ, HOME=str(tmp_path)))
    rc, loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert rc == 0 and loaded == [], (loaded, r.stderr)


def test_each_command_is_added_by_the_module_the_table_names():
    def commands(parser):
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    assert commands(cli.build_parser()) == set(cli.COMMANDS)  # a new command needs its table entry
    for command in cli.COMMANDS:
        assert command in commands(cli.build_parser(command)), command


def test_help_lists_a_command_it_cannot_import_and_running_it_is_one_sentence(monkeypatch, capsys):
    real = importlib.import_module

    def no_pyroute2(name, *a):
        if name == "testbed.cli":
            raise ModuleNotFoundError("No module named 'pyroute2'", name="pyroute2")
        return real(name, *a)

    monkeypatch.setattr(cli.importlib, "import_module", no_pyroute2)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "testbed" in out and "deploy" in out and "unavailable: needs pyroute2" in out and "capture" in out
    assert cli.main(["deploy", "--inventory", "x.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dosa: deploy needs pyroute2") and len(err.strip().splitlines()) == 1, err


def test_libbpf_loads_at_first_use_and_its_absence_names_the_package(monkeypatch):
    from dataplane import libbpf

    monkeypatch.setattr(libbpf, "LIBRARY", "libdosa-absent-libbpf.so.1")
    monkeypatch.setattr(libbpf, "_lib", libbpf._NotLoaded())
    with pytest.raises(DosaError, match="libbpf1") as e:
        libbpf.num_possible_cpus()
    assert "\n" not in str(e.value)
