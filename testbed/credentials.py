"""The credentials a testbed or a deploy hands out: the deployment secret's two files (dosa.auth) and,
with TLS, a small CA and one certificate for each DPU's control plane.

Certificates are made with the ``openssl`` command (Debian's; ``make setup`` installs it): the
project does not depend on the ``cryptography`` package. Each certificate names its DPU's address
(subjectAltName IP), which is what hosts check: they address the control plane by IP. The CA's key
is deleted once the certificates are made: nothing issues another one (the next deploy makes a new
CA), and a key that no longer exists cannot leak.

Files, in one directory (mode 0700; every file 0600 but the CA certificate)::

    dpu.secret   every role's key: ctl serve, dosa ctl on a DPU
    host.secret  the host key only: the training processes (DOSA_SECRET_FILE)
    ca.crt       the CA certificate: every client of the control plane (DOSA_CONTROL_CA)
    <dpu>.crt, <dpu>.key   a DPU's certificate and key (ctl serve --tls-cert/--tls-key)
"""
from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from dosa.auth import make_files
from dosa.errors import DosaError

DPU_SECRET = "dpu.secret"
HOST_SECRET = "host.secret"
CA_CERT = "ca.crt"
DAYS = 825  # the longest validity clients commonly accept for a server certificate


def cert_files(dpu_name: str) -> tuple[str, str]:
    """(certificate, key) file names of a DPU's control plane."""
    return f"{dpu_name}.crt", f"{dpu_name}.key"


def _private_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def make_secret(d: Path) -> tuple[Path, Path]:
    """A new deployment secret in ``d``: (DPUs' file, hosts' file)."""
    d = _private_dir(Path(d))
    make_files(str(d / DPU_SECRET), str(d / HOST_SECRET))
    return d / DPU_SECRET, d / HOST_SECRET


def _openssl(args: list[str], cwd: Path) -> None:
    try:
        p = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise DosaError("openssl is not installed (make setup installs it): it makes the TLS "
                        "certificates") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise DosaError(f"openssl {args[0]} failed: {last}")


_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_tls(d: Path, dpus: dict[str, str], days: int = DAYS) -> Path:
    """A new CA and a certificate for each DPU (``{name: IPv4 address}``) in ``d``; returns the CA
    certificate's path. The CA's key is removed at the end."""
    d = _private_dir(Path(d))
    (d / "ca.cnf").write_text("[req]\ndistinguished_name = dn\nprompt = no\nx509_extensions = v3_ca\n"
                              "[dn]\nCN = dosa control plane CA\n"
                              "[v3_ca]\nbasicConstraints = critical, CA:TRUE\n"
                              "keyUsage = critical, keyCertSign, cRLSign\nsubjectKeyIdentifier = hash\n")
    try:
        _openssl(["req", "-x509", "-config", "ca.cnf", *_EC, "-keyout", "ca.key", "-out", CA_CERT,
                  "-days", str(days)], d)
        for name, addr in dpus.items():
            crt, key = cert_files(name)
            (d / "srv.cnf").write_text(f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = {addr}\n")
            (d / "ext.cnf").write_text("[v3_srv]\nbasicConstraints = critical, CA:FALSE\n"
                                       "keyUsage = critical, digitalSignature\nextendedKeyUsage = serverAuth\n"
                                       f"subjectAltName = IP:{addr}\nsubjectKeyIdentifier = hash\n"
                                       "authorityKeyIdentifier = keyid\n")
            _openssl(["req", "-new", "-config", "srv.cnf", *_EC, "-keyout", key, "-out", "srv.csr"], d)
            _openssl(["x509", "-req", "-in", "srv.csr", "-CA", CA_CERT, "-CAkey", "ca.key",
                      "-set_serial", "0x" + secrets.token_hex(16), "-days", str(days),
                      "-extfile", "ext.cnf", "-extensions", "v3_srv", "-out", crt], d)
            os.chmod(d / key, 0o600)
    finally:
        for f in ("ca.key", "ca.cnf", "srv.cnf", "ext.cnf", "srv.csr"):
            (d / f).unlink(missing_ok=True)
    return d / CA_CERT
