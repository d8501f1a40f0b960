"""Starting a DPU's long-running services inside its namespace, and waiting until they are ready:
what ``testbed up`` and ``testbed restart`` share (testbed.services says WHAT runs on a DPU; this
module HOW it is started, recorded and waited for).

A service runs with its working directory at the repository, on the DPU CPUs, its output in
``<run dir>/<dpu>-<service>.log``, and is recorded in the testbed's state (pid and start time, so
``down`` and ``status`` recognize it); readiness is polled, never slept for.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from dosa.errors import DosaError

from testbed import config, ns
from testbed.config import REPO_ROOT, Node
from testbed.services import ServiceSpec


def spawn(node: Node, spec: ServiceSpec, st: dict, run_dir: Path):
    """Start ``spec`` inside DPU ``node``'s namespace on the DPU CPUs, its output in
    ``run_dir/<node>-<service>.log``, and record it in the state ``st``; returns (process, record)."""
    log = run_dir / f"{node.name}-{spec.name}.log"
    with open(log, "wb") as f:
        try:
            p = subprocess.Popen(ns.netns_cmd(node.namespace, spec.argv, st["dpu_cpus"]),
                                 cwd=REPO_ROOT, env={**own_env(), **spec.env},
                                 stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        except OSError as e:
            raise DosaError(f"cannot start {spec.name} on {node.name}: {e}") from None
    rec = {"name": f"{node.name}-{spec.name}", "node": node.name, "namespace": node.namespace,
           "pid": p.pid, "start_time": ns.proc_start_time(p.pid), "argv": spec.argv,
           "log": str(log), "ready": list(spec.ready) if spec.ready else None, "env": dict(spec.env)}
    st["processes"].append(rec)
    return p, rec


def wait_ready(started, timeout: float) -> None:
    """Wait until every (process, record) of ``started`` passes its readiness probe; a DosaError
    naming the service, with its log's last line, when one exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    waiting = list(started)
    while waiting:
        for p, rec in list(waiting):
            if p.poll() is not None:
                last = tail(rec["log"])
                raise DosaError(f"{rec['name']} exited with status {p.returncode} while starting"
                                f" ({' '.join(rec['argv'][:6])} ...): {last}; log {rec['log']}")
            if probe(p.pid, rec["ready"]):
                waiting.remove((p, rec))
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(r["name"] for _, r in waiting)
            raise DosaError(f"{names} not ready after {timeout:g}s (probe "
                            f"{waiting[0][1]['ready']}); see {waiting[0][1]['log']}")
        time.sleep(0.05)


def own_env() -> dict:
    """This process's environment without the credentials of another deployment it may carry:
    a testbed's services use the testbed's own."""
    return {k: v for k, v in os.environ.items() if k not in ("DOSA_SECRET_FILE", "DOSA_CONTROL_CA")}


def services_from_env():
    """``DOSA_TESTBED_SERVICES=module:function`` replaces testbed.services.dpu_services (the tests
    use it to supervise stand-in processes; a user can start a different DPU side)."""
    spec = os.environ.get(config.ENV_SERVICES)
    if not spec:
        return None
    mod, _, fn = spec.partition(":")
    try:
        import importlib
        return getattr(importlib.import_module(mod), fn or "dpu_services")
    except (ImportError, AttributeError) as e:
        raise DosaError(f"{config.ENV_SERVICES}={spec!r} does not name a function: {e}") from None


def probe(pid: int, ready) -> bool:
    """Whether process ``pid``'s readiness probe passes: ("tcp"|"udp", port) listening in its
    namespace, ("file", path) existing; no probe: ready."""
    if not ready:
        return True
    kind, arg = ready[0], ready[1]
    if kind in ("tcp", "udp"):
        return ns.listening(pid, int(arg), kind)
    if kind == "file":
        return os.path.exists(arg)
    raise DosaError(f"unknown readiness probe {ready!r}")


def tail(path: str, lines: int = 1) -> str:
    """The last ``lines`` lines of a log, on one line."""
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) if text else "no output"
