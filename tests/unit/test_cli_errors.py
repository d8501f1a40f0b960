"""Bad input on the command line is one sentence, never a traceback (dosa.app.cli._Parser,
dosa.net.parse_hostport)."""
from __future__ import annotations

import pytest

from dosa.app.cli import main
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


@pytest.mark.parametrize("extra,says", [
    ([], "ctl serve needs --secret-file"),
    (["--secret-file", "HOST"], "has no operator or peer key: ctl serve needs the DPUs' file"),
    (["--secret-file", "OPEN"], "may be read by others (mode 644)"),
    (["--secret-file", "DPU", "--tls-cert", "x.crt"], "--tls-cert and --tls-key go together"),
    (["--secret-file", "DPU", "--tls-cert", "x.crt", "--tls-key", "x.key"], "cannot load the TLS certificate"),
])
def test_ctl_serve_refuses_to_start_without_a_usable_secret_in_one_sentence(extra, says, tmp_path, monkeypatch,
                                                                           capsys):
    """Checked before anything is attached or bound: serving without credentials is a choice
    (--insecure), never an accident."""
    import os

    from dosa.auth import make_files

    make_files(str(tmp_path / "dpu"), str(tmp_path / "host"))
    (tmp_path / "open").write_bytes((tmp_path / "dpu").read_bytes())
    os.chmod(tmp_path / "open", 0o644)
    files = {"HOST": "host", "DPU": "dpu", "OPEN": "open"}
    extra = [str(tmp_path / files[x]) if x in files else x for x in extra]
    monkeypatch.delenv("DOSA_SECRET_FILE", raising=False)
    rc = main(["ctl", "serve", "--addr", "127.0.0.1", "--mode", "userspace", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_protocol_error_is_a_dosaerror_and_the_cli_says_it_in_one_sentence(monkeypatch, capsys):
    """dosa.wire's ProtocolError (a malformed packet) reaches the user as the sentence of the rule
    it breaks, exit status 2, no traceback; it is still a ValueError for the callers that catch
    bad input as one."""
    from dosa import wire
    from dosa.app import capture_cli
    from dosa.errors import DosaError

    assert issubclass(wire.ProtocolError, DosaError) and issubclass(wire.BadMagic, ValueError)
    bad = wire.Header(magic=0x12345678).pack()
    with pytest.raises(wire.BadMagic) as e:
        wire.parse_packet(bad)

    def read_capture(path, port=None):
        wire.parse_packet(bad)

    monkeypatch.setattr(capture_cli, "read_capture", read_capture)
    assert main(["capture", "show", "any.pcap"]) == 2
    err = capsys.readouterr().err
    assert err == f"dosa: {e.value}\n" and "bad magic 0x12345678" in err and "Traceback" not in err
