"""``dosa testbed restart NODE [--service dpu|ctl]``: restart one DPU service of a running testbed.

Why a command: a DPU worker is stateless by design (the pinned maps hold the sums, the control plane
the jobs; docs/dpu_worker.md), so restarting one is a normal operation, e.g. after changing its
code. Done by hand (kill, start again) the testbed's records still name the old process and
``status`` calls the new one DEAD; this kills the recorded process (SIGTERM, then SIGKILL), starts
the same command line in the same namespace and CPUs, waits for its readiness probe, and records
the new pid, so ``status`` shows it alive with its restart count.
"""
from __future__ import annotations

import os

from dosa.errors import DosaError

from testbed import ns, state, supervise
from testbed.services import ServiceSpec

SERVICES = ("dpu", "ctl")


def restart_service(tb, node: str, service: str = "dpu", ready_timeout: float = 60.0) -> dict:
    """Restart ``service`` of DPU ``node`` (``d0``...) of testbed ``tb``; returns its new record."""
    if service not in SERVICES:
        raise DosaError(f"service must be one of {', '.join(SERVICES)}, got {service!r}")
    ns.require_root("dosa testbed restart")
    st = tb._require_state()
    lay = tb.layout(st)
    try:
        n = lay.node(node)
    except (KeyError, DosaError, ValueError):
        n = None
    if n is None or n.role != "dpu":
        names = ", ".join(x.name for x in lay.dpu_nodes) or "none"
        raise DosaError(f"{node!r} is not a DPU of testbed {tb.prefix!r} (its DPUs: {names})")
    name = f"{n.name}-{service}"
    recs = [r for r in st.get("processes", []) if r.get("name") == name]
    if not recs:
        raise DosaError(f"testbed {tb.prefix!r} started no {service!r} service on {n.name} "
                        "(was it brought up with --no-services?)")
    old = recs[-1]
    ns.kill_all([(old["pid"], old.get("start_time"))])
    ready = tuple(old["ready"]) if old.get("ready") else None
    if ready and ready[0] == "file":
        try:
            os.unlink(ready[1])  # a killed worker may leave it: the probe must see the new one's
        except FileNotFoundError:
            pass
    st["processes"] = [r for r in st["processes"] if r is not old]
    p, rec = supervise.spawn(n, ServiceSpec(name=service, argv=list(old["argv"]), ready=ready,
                                            env=dict(old.get("env") or {})), st, tb.run_dir)
    rec["restarts"] = int(old.get("restarts", 0)) + 1
    state.save(tb.state_path, st)
    supervise.wait_ready([(p, rec)], ready_timeout)
    return rec
