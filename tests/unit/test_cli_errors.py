"""Bad input on the command line is one sentence, never a traceback (dosa.cli._Parser,
dosa.net.parse_hostport)."""
from __future__ import annotations

import pytest

from dosa.cli import main
from dosa.net import parse_hostport

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv,option", [
    (["dpu", "run", "--control", "nohostport"], "--control"),
    (["ctl", "serve", "--addr", "10.0.0.1", "--listen", "nohostport"], "--listen"),
    (["ctl", "serve", "--addr", "10.0.0.1", "--listen", "10.0.0.1:99999"], "--listen"),
    (["ctl", "job", "ls", "--control", ":17800"], "--control"),
    (["testbed", "restart", "d0", "--service", "nope"], "--service"),
])
def test_a_bad_argument_is_one_sentence(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"argument {option}" in err and "--help" in err and "Traceback" not in err


def test_parse_hostport():
    assert parse_hostport("10.0.1.1:17800") == ("10.0.1.1", 17800)
    for bad in ("nohostport", "10.0.1.1:", ":17800", "10.0.1.1:0", "10.0.1.1:x"):
        with pytest.raises(ValueError, match="ADDR:PORT"):
            parse_hostport(bad)
