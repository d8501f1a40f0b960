"""Bad input to ``dosa testbed`` is one clear sentence (exit 2, no traceback), checked before
anything is built; without root the commands say so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dosa.errors import DosaError
from testbed.shaping import Shaping, parse_rate
from testbed.testing import unique_prefix

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kw,message", [
    (dict(hosts=0, dpus=1), "--hosts must be an integer from 1 to 64, not 0"),
    (dict(hosts=65, dpus=1), "--hosts must be an integer from 1 to 64"),
    (dict(hosts=2, dpus=-1), "--dpus must be an integer from 0 to 50"),
    (dict(hosts=2, dpus=1, link_rate="fast"), "link rate 'fast' is not a rate like"),
    (dict(hosts=2, dpus=1, loss="150"), "--loss must be between 0 and 100 percent"),
    (dict(hosts=2, dpus=1, dup="x"), "--dup 'x' is not a percentage"),
    (dict(hosts=2, dpus=1, reorder="150"), "--reorder must be between 0 and 100 percent"),
    (dict(hosts=2, dpus=1, mode="ebpf"), "--mode must be one of xdp, userspace"),
])
@pytest.mark.root
def test_bad_numbers_are_refused_before_anything_is_built(kw, message, tmp_path):
    from testbed.core import Testbed
    prefix = unique_prefix()
    with pytest.raises(DosaError) as e:
        Testbed(prefix=prefix, state_dir=tmp_path).up(services=False, **kw)
    assert message in str(e.value)
    assert not [n for n in _netns() if n.startswith(prefix)]
    assert list(tmp_path.iterdir()) == []


def _netns() -> list[str]:
    return os.listdir("/run/netns") if os.path.isdir("/run/netns") else []


@pytest.mark.root
def test_bad_number_on_the_command_line_is_one_line_exit_2(tmp_path):
    prefix = unique_prefix()
    env = {**os.environ, "DOSA_TESTBED_PREFIX": prefix, "DOSA_TESTBED_STATE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "up", "--hosts", "2",
                        "--subnet", "10.1.2.0/28"], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert p.stderr.strip() == "dosa: testbed subnet 10.1.2.0/28 is too small; use a /24 or larger"
    assert not [n for n in _netns() if n.startswith(prefix)]


@pytest.mark.root
def test_without_root_up_says_it_needs_root(tmp_path):
    for action in (["up", "--hosts", "1"],):
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-m", "dosa", "testbed", *action],
                           env={**os.environ, "DOSA_TESTBED_PREFIX": unique_prefix(),
                                "DOSA_TESTBED_STATE_DIR": str(tmp_path)},
                           capture_output=True, text=True, timeout=30, cwd="/")
        assert p.returncode == 2, p.stderr
        assert "needs root" in p.stderr and "Traceback" not in p.stderr


def test_run_without_a_testbed_says_how_to_start_one(tmp_path):
    env = {**os.environ, "DOSA_TESTBED_PREFIX": unique_prefix(), "DOSA_TESTBED_STATE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "dosa", "testbed", "run", "--", "true"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "is up; start one with `dosa testbed up" in p.stderr


def test_rates_and_impairments_parse_to_tc_units():
    assert parse_rate("10gbit") == parse_rate("10G") == 10**10
    assert parse_rate("2.5mbit") == 2_500_000
    s = Shaping.parse(rate="1gbit", loss="1%", dup=0.5)
    assert s.qdisc_commands("eth0") == [["qdisc", "replace", "dev", "eth0", "root", "handle", "1:",
                                         "tbf", "rate", "1000000000bit", "burst", "125000",
                                         "latency", "20ms"]]
    assert s.impair_defines() == {"LOSS_THRESH": "42949673ULL", "DUP_THRESH": "21474836ULL"}
    with pytest.raises(DosaError, match="prefix"):
        from testbed.core import Testbed
        Testbed(prefix="Bad-Prefix")
