"""The DPU-side commands a testbed (and ``dosa deploy``) starts on every DPU. This is the ONE place
that knows their command lines: when ``dosa ctl serve`` or ``dosa dpu run`` change their flags,
change them here. ``Testbed(services=...)`` accepts another function of the same signature.

Each service is started with its working directory at the repository and its output in
``<run dir>/<dpu>-<service>.log``; the testbed waits for its readiness probe by polling.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from dosa import wire
from dosa.net import DEFAULT_CONTROL_PORT

#: TCP port of the control plane's join API on every DPU (DOSA_CONTROL_PORT).
CONTROL_PORT = DEFAULT_CONTROL_PORT
DATA_PORT = wire.DEFAULT_PORT  # UDP port of the dosa protocol (DOSA_PORT)


@dataclass(frozen=True)
class ServiceSpec:
    """One long-running process on a DPU.

    ready: ("tcp", port) -> a socket LISTENs on that port in the DPU's namespace;
           ("udp", port) -> a UDP socket is bound to it; ("file", path) -> the file exists;
           None -> started is ready.
    """

    name: str
    argv: list[str]
    ready: tuple | None = None
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DpuContext:
    """What a DPU's services need to know. Paths are strings so deploy can use remote paths."""

    index: int  # DPU index j
    iface: str  # the DPU's network interface (eth0 in a namespace)
    address: str  # the DPU's IPv4 address
    host_addrs: tuple[str, ...]  # every host's address (for unicast fan-out of results)
    mode: str  # "xdp" | "userspace"
    pin_dir: str  # where BPF maps are pinned for this DPU
    run_dir: str  # pid files, sockets
    data_port: int = DATA_PORT
    control_port: int = CONTROL_PORT
    python: tuple[str, ...] = (sys.executable,)
    #: the DPUs' secret file (testbed/credentials.py); None: the control plane serves without one
    secret_file: str | None = None
    #: TLS: this DPU's certificate and key, and the CA that signed every DPU's (None: plain HTTP)
    tls_cert: str | None = None
    tls_key: str | None = None
    ca_file: str | None = None
    #: DPU worker processes (dosa dpu run --workers) and the CPUs they are pinned to (None: not)
    workers: int = 1
    cpus: tuple[int, ...] | None = None


def dpu_services(ctx: DpuContext) -> list[ServiceSpec]:
    """The control plane and the DPU worker of one DPU, in start order."""
    dosa = [*ctx.python, "-m", "dosa"]
    auth = ["--secret-file", ctx.secret_file] if ctx.secret_file else ["--insecure"]
    if ctx.tls_cert:
        auth += ["--tls-cert", ctx.tls_cert, "--tls-key", ctx.tls_key, "--tls-ca", ctx.ca_file]
    # the worker asks its control plane for its jobs: over https with the CA when it serves TLS
    env = {"DOSA_CONTROL_CA": ctx.ca_file} if ctx.ca_file else {}
    stats = f"{ctx.run_dir}/dpu{ctx.index}-worker-stats.json"  # the worker's counters, for ctl's /metrics
    # --instance is the absolute pin directory: the dataplane pins its program and maps there, so
    # each DPU (and each testbed prefix) has its own and `down` removes them with the prefix dir
    ctl = ServiceSpec(
        name="ctl",
        argv=[*dosa, "ctl", "serve", "--pin-dir", ctx.pin_dir, "--iface", ctx.iface,
              "--addr", ctx.address, "--listen", f"{ctx.address}:{ctx.control_port}",
              "--port", str(ctx.data_port), "--mode", ctx.mode, "--worker-stats", stats, *auth],
        ready=("tcp", ctx.control_port), env=env)
    ready = f"{ctx.run_dir}/dpu{ctx.index}-worker.ready"  # dpu run writes it once it is ready
    worker = ServiceSpec(
        name="dpu",
        argv=[*dosa, "dpu", "run", "--instance", ctx.pin_dir, "--iface", ctx.iface,
              "--addr", ctx.address, "--port", str(ctx.data_port), "--mode", ctx.mode,
              "--dpu-index", str(ctx.index), "--control", f"{ctx.address}:{ctx.control_port}",
              "--pid-file", ready, "--stats-file", stats,
              *(["--workers", str(ctx.workers)] if ctx.workers > 1 else []),
              *(["--cpus", ",".join(map(str, ctx.cpus))] if ctx.workers > 1 and ctx.cpus else [])],
        ready=("file", ready), env=env)
    return [ctl, worker]
