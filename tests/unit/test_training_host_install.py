"""The training-host install (README: "On a training host"): a fresh venv of the system's Python
(no system site-packages) with the torch the host brings, dosa built into a wheel from an sdist of
this checkout (the Cython extensions compiled by pyproject's build backend, not by `make setup`) and
installed from it, then the hook's multi-rank tests against userspace DPU workers run by that venv's
Python, from a copy of the test files in a directory that holds no dosa source: every import, in
the ranks and the DPU workers too, is the installed package's."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TORCH = "2.13.0"  # the local CPU build (scripts/constraints.txt): what this "cluster" brings
HOOK_TESTS = ["test_torch_hook_ranks.py", "hook_ranks.py", "userspace_dpus.py", "test_torch_hook.py"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: written into the copy: the tests fail unless the installed package is what they import
CHECK_INSTALLED = '''import sys

import dosa, dpu_fw, host_lib


def pytest_configure(config):
    for m in (dosa, dpu_fw, host_lib):
        assert m.__file__.startswith(sys.prefix + "/"), f"{m.__name__} imported from {m.__file__}"
'''


def _system_python() -> str:
    """Debian's python3.11 (as a cluster's own interpreter would be), else the one under this venv."""
    for p in ("/usr/bin/python3.11", getattr(sys, "_base_executable", sys.executable)):
        if os.path.exists(p):
            return p
    raise AssertionError("no base Python to make a venv from")


def _run(cmd, cwd, timeout, env=None) -> str:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}: {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _checkout_copy(dst: Path) -> None:
    """The checkout's files as git sees them (tracked, and untracked ones not ignored): no venv, no
    built .so or generated .c, so the sdist has to carry everything the build needs."""
    names = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO, 60)
    for name in filter(None, names.split("\0")):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def test_host_side_installs_from_an_sdist_into_a_plain_venv_and_the_hook_ranks_pass(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    src, dist, venv, run_dir = (tmp_path / d for d in ("src", "dist", "venv", "run"))
    _checkout_copy(src)
    _run([_system_python(), "-m", "venv", venv], tmp_path, 120, env)
    py = venv / "bin/python"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    _run([py, "-m", "pip", "install", "-q", f"torch=={TORCH}", "build"], tmp_path, 600, env)

    # sdist, then a wheel built from that sdist (python -m build does both, in that order)
    _run([py, "-m", "build", "--outdir", dist, src], tmp_path, 600, env)
    sdist, = dist.glob("dosa-*.tar.gz")
    wheel, = dist.glob("dosa-*.whl")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    pyx = {str(p.relative_to(src)) for p in src.rglob("*.pyx")}
    assert pyx and pyx <= names and "dosa/_net.pxd" in names and "dosa/dosa_wire.h" in names, sorted(names)
    _run([py, "-m", "pip", "install", "-q", wheel, "pytest", "pytest-timeout"], tmp_path, 600, env)

    # the host's torch is kept, the DPU side's packages are not installed, the extensions are there
    run_dir.mkdir()
    out = _run([py, "-c", "import torch, dosa, host_lib._engine, host_lib._select, dosa._net, dpu_fw._completion, dpu_fw._softmerge\n"
                "import importlib.util as u\n"
                "print(torch.__version__, dosa.__file__, u.find_spec('pyroute2') is None)"], run_dir, 120, env)
    version, where, no_pyroute2 = out.split()
    assert version.startswith(TORCH) and where.startswith(f"{venv}/lib/") and no_pyroute2 == "True", out
    assert "capture" in _run([venv / "bin/dosa", "--help"], run_dir, 60, env)

    # the hook's tests, from a copy that sits where no dosa source is
    tests = run_dir / "tests/unit"
    tests.mkdir(parents=True)
    for name in HOOK_TESTS:
        shutil.copy2(HERE / name, tests / name)
    (run_dir / "tests/conftest.py").write_text(CHECK_INSTALLED)
    out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"], run_dir, 600, env)
    last = out.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "error" not in last and "skipped" not in last, out
    print(f"installed-package hook tests: {last}")
