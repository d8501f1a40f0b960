"""Fan-out of one step to every DPU of a job: this DPU directly, the others through their servers'
``/v1/local/*`` endpoints, all or nothing.

The caller holds its server's fan-out lock, never the registry lock, while this runs: every server's
``/v1/local/*`` handlers take their registry lock, so two DPUs coordinating joins at once cannot
deadlock each other."""
from __future__ import annotations

from dosa.errors import DosaError
from dosa.job import JobConfig
from dosa.join import request

from .validation import ApiError


class Peers:
    """Calls to the other DPUs' control servers (same control port on every DPU), signed with the
    deployment's peer key (none without a secret), over TLS when ``ca`` is given."""

    def __init__(self, address: str, control_port: int, timeout: float, secret=None, ca: str | None = None):
        self.address = address
        self.control_port = control_port
        self.timeout = timeout
        self.secret = secret
        self.ca = ca

    def call(self, address: str, method: str, path: str, body: dict | None = None) -> dict:
        return request(f"{address}:{self.control_port}", method, path, body, timeout=self.timeout,
                       role="peer" if self.secret is not None else None, secret=self.secret, ca=self.ca)

    def on_all_dpus(self, job: JobConfig, local_fn, method: str, path: str, body: dict | None,
                    undo=None) -> None:
        """Run one step on every DPU of the job: this one by ``local_fn(i)``, the others by
        ``method path body`` on their servers. With ``undo(i, address)``, a refusal undoes the step
        on the DPUs that had done it (all or nothing); without, the step stops at the refusal
        (removals, which are idempotent: the caller may retry)."""
        done = []
        try:
            for i, (a, _) in enumerate(job.dpus):
                if a == self.address:
                    local_fn(i)
                else:
                    try:
                        self.call(a, method, path, dict(body or {}, dpu_index=i))
                    except DosaError as e:
                        st = getattr(e, "status", 502)
                        raise ApiError(st if st in (409, 503, 507) else 502, f"DPU {i} ({a}) refused: {e}") from None
                done.append((i, a))
        except ApiError:
            for i, a in reversed(done if undo is not None else []):
                try:
                    undo(i, a)
                except DosaError:
                    pass  # unreachable now: the job's removal or a restart of that DPU clears it
            raise


def registry_body(job: JobConfig) -> dict:
    """The job as every DPU's registry keeps it (the view hosts get, plus ``num_dpus``): a DPU
    worker asking its own control plane must learn density, mode, DPUs and hosts."""
    body = job.view()
    for k in ("complete", "num_partitions", "worker_id"):
        body.pop(k, None)
    body["num_dpus"] = len(job.dpus)
    return body
