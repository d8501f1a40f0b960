"""A fresh machine of this kind boots without bpffs mounted, and root cannot read /proc/1/ns/mnt.
The loader must mount bpffs itself there, and refuse only under `ip netns exec` (whose private /sys
hides the pins from every other process). These tests recreate the as-booted state in a private
mount namespace (`unshare --mount`), so they hold on a machine where bpffs happens to be mounted."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dataplane import loader

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

AS_BOOTED = "umount -R /sys/fs/bpf 2>/dev/null || true; grep -qs ' /sys/fs/bpf bpf ' /proc/mounts && exit 97; "


def _in_fresh_mount_ns(code: str) -> subprocess.CompletedProcess:
    script = AS_BOOTED + f"exec {sys.executable} -c \"$0\""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script,
                           textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO, timeout=100)


def test_loader_mounts_bpffs_itself_on_a_fresh_machine():
    r = _in_fresh_mount_ns("""
        from dataplane import loader
        assert not loader.bpffs_mounted()
        assert not loader.under_ip_netns_exec()
        loader.ensure_bpffs()
        assert loader.bpffs_mounted()
        loader.ensure_bpffs()  # idempotent: an existing mount is left alone
        print("mounted")
    """)
    assert r.returncode == 0 and "mounted" in r.stdout, r.stderr


def test_load_and_unload_the_dataplane_where_bpffs_was_not_mounted():
    r = _in_fresh_mount_ns("""
        import os
        from dataplane import loader
        loader.load("fresh-boot")
        assert os.path.exists("/sys/fs/bpf/dosa/fresh-boot/prog")
        assert loader.unload("fresh-boot")
        print("loaded")
    """)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr


def test_setup_mounts_bpffs_idempotently():
    """setup's bpffs step (scripts/mount_bpffs.sh), run twice in the as-booted state: mounted once,
    then left alone."""
    step = f"bash {REPO}/scripts/mount_bpffs.sh; "
    assert "scripts/mount_bpffs.sh" in (REPO / "scripts" / "setup.sh").read_text()
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", "-c",
                        AS_BOOTED + step + step + "grep -c ' /sys/fs/bpf bpf ' /proc/mounts"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "1", (r.stdout, r.stderr)
    assert r.stdout.count("mounting the BPF filesystem") == 1, r.stdout


def test_kernel_features_check_passes_here():
    r = subprocess.run(["bash", str(REPO / "scripts" / "kernel_features.sh")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
