"""The DDP hook's dosa client: made once, when the gradient's size is known, and agreed on by every
rank before any of them relies on it.

Agreement matters: a rank that silently went dense while the others wait for its dosa packets would
hang or desynchronise the replicas. So creating the client is followed by one tiny process-group
allreduce of "did it fail here", and every rank learns the same answer. The counters the hook
reports are the client's own, counted from the moment it was agreed on.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from host_lib import hook_codec


def default_client_factory(numel: int, job_options: dict | None = None):
    """Join the job the environment names with host_lib's AggregationClient: an explicit
    DOSA_JOB_CONFIG file, or the control plane at DOSA_CONTROL_ADDR:DOSA_CONTROL_PORT (set by
    ``dosa testbed run``). ``job_options`` (e.g. ``partition_size``, ``mode``) shape the job when this
    rank is the one whose join creates it."""
    from dosa.errors import DosaError
    from host_lib.client import AggregationClient  # imported late: dosa may be absent

    # joined through the control plane, the client keeps a membership (heartbeats; it leaves the
    # job on close, so the job's DPU slots are free for the next run)
    client = AggregationClient.from_env(numel=numel, join=dict(job_options or {}))
    job_numel = getattr(getattr(client, "job", None), "numel", numel)
    if job_numel != numel:
        client.close()
        raise DosaError(f"the dosa job has numel {job_numel} but the model's gradient has {numel} "
                        f"entries")
    return client


class HookClient:
    """The client (given, or made by ``factory(numel)``) and whether every rank has one."""

    def __init__(self, client=None, factory: Callable[[int], Any] | None = None):
        self.client = client
        self._factory = factory
        self.ready = False  #: creation and the ranks' agreement done
        self._base: dict[str, int] = {}

    def agree(self, numel: int, group) -> str | None:
        """Create the client (once) and agree across ``group`` whether every rank has one: None
        when all have, else why not (this rank's error, or how many other ranks failed)."""
        error: BaseException | None = None
        if self.client is None:
            try:
                self.client = self._factory(numel)
            except Exception as e:  # noqa: BLE001 - any failure means "dosa unavailable"
                error = e
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=group)
        n_failed = int(failed.item())
        self.ready = True
        if n_failed == 0:
            self._base = hook_codec.client_counters(self.client)
            return None
        return (f"{type(error).__name__}: {error}" if error is not None
                else f"dosa is unavailable on {n_failed} other rank(s)")

    @property
    def streams(self) -> bool:
        """Whether the client can stream a step bucket by bucket (``open_stream``)."""
        return self.ready and hasattr(self.client, "open_stream")

    def counters(self) -> dict[str, int]:
        """The client's traffic counters since it was agreed on (empty without a client)."""
        if self.client is None:
            return {}
        return {k: v - self._base.get(k, 0) for k, v in hook_codec.client_counters(self.client).items()}

    def close(self, log) -> None:
        """Close the client (idempotent); a failure is logged, not raised: closing must not mask
        the run's real outcome."""
        client, self.client = self.client, None
        if client is not None and hasattr(client, "close"):
            try:
                client.close()
            except Exception as e:  # noqa: BLE001
                log.warning("dosa hook: closing the client failed: %s", e)
