"""The one job schema: what hosts, DPU workers and the control plane agree on for one job.

A job is its shape (numel, partition size, result mode, density, initial scale exponent, the DPUs'
addresses) and its members: ``hosts[w]`` is the (ip, port) worker ``w`` sends from and receives
results on, ``None`` while worker ``w`` has not joined (only the control plane's registry holds
incomplete jobs; hosts and DPU workers use complete ones). Partition p is owned by DPU
``p % len(dpus)``.

The same job travels as JSON in two forms, each read back by one classmethod:
:meth:`JobConfig.view` (what the control plane answers, :meth:`from_view`) and :meth:`to_dict` (a
job file, :meth:`from_dict` / :meth:`load`). A rank's ``DOSA_*`` environment names a job file or
the control plane to join through (:func:`dosa.join.join_view`, the one join from the environment).
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from dosa import wire
from dosa.errors import DosaError

class _Name(str, enum.Enum):
    """A name that is its own string: ``ResultMode.GTOPK == "gtopk"``, in JSON, argparse choices
    and f-strings alike; comparing with the member instead of the string is what keeps a typo from
    being a silent False."""

    __str__ = str.__str__
    __format__ = str.__format__


class ResultMode(_Name):
    """What comes back to the hosts: ``sum`` (exact sums, union of indices) or ``gtopk`` (per
    partition only the ``k = ceil(density * partition_length)`` largest |sum|; docs/dpu_worker.md).
    The index in RESULT_MODES is the mode's code in the dataplane's jobs map."""

    SUM = "sum"
    GTOPK = "gtopk"


class DpuMode(_Name):
    """Where a DPU merges: in the XDP program, or in the DPU worker's user space."""

    XDP = "xdp"
    USERSPACE = "userspace"


RESULT_MODES = tuple(m.value for m in ResultMode)
DPU_MODES = tuple(m.value for m in DpuMode)
#: the scale exponent of a job's first round (later rounds choose theirs from the previous result)
DEFAULT_SCALE_EXP = 16
DEFAULT_DENSITY = 0.01
#: aggregation slots a job holds on each DPU (docs/dataplane.md, *Slots*): its window of partitions
#: in flight per DPU, and what sets its DPU memory (slots x 2 buffers of 288 KiB: 36 MiB), whatever
#: numel. Four such jobs fit the default 144 MiB pool (dataplane.loader.DEFAULT_POOL_BUFFERS).
#: 16 slots halved the 4-host transport's speed on the
#: testbed (hosts sharing a core run up to a time slice apart, and the window must cover that
#: skew); 64 gets most of what one slot per partition gets (docs/dataplane.md, *Slots*).
DEFAULT_SLOTS = 64
MAX_SLOTS = 65535


@dataclass
class JobConfig:
    """One job (see the module doc). Checked on construction: a DosaError names the bad field."""

    job_id: int
    numel: int
    hosts: list = field(default_factory=list)
    dpus: list = field(default_factory=list)
    partition_size: int = wire.DEFAULT_PARTITION_SIZE
    mode: str = ResultMode.SUM.value
    density: float = DEFAULT_DENSITY
    scale_exp: int = DEFAULT_SCALE_EXP
    port: int = wire.DEFAULT_PORT  # the job's UDP port on the DPUs (the default of dpus' ports)
    slots: int = DEFAULT_SLOTS  # aggregation slots per DPU (at most the partitions it owns)
    mtu: int = wire.DEFAULT_MTU  # of the job's links: packet sizes follow it (wire.entries_per_packet)

    def __post_init__(self):
        self.hosts = [None if h is None else (str(h[0]), int(h[1])) for h in self.hosts]
        self.dpus = [(str(a), int(p)) for a, p in self.dpus]
        if not 1 <= self.job_id <= 2**32 - 1:
            raise DosaError(f"job_id {self.job_id} must lie in 1..2^32-1")
        if not 1 <= len(self.hosts) <= wire.MAX_WORKERS:
            raise DosaError(f"a job needs 1..{wire.MAX_WORKERS} hosts, got {len(self.hosts)}")
        if not self.dpus:
            raise DosaError("a job needs at least one DPU")
        if self.mode not in RESULT_MODES:
            raise DosaError(f"result mode must be one of {RESULT_MODES}, got {self.mode!r}")
        if not 0 < self.density <= 1:
            raise DosaError(f"density must lie in (0, 1], got {self.density}")
        if not wire.SCALE_EXP_MIN <= self.scale_exp <= wire.SCALE_EXP_MAX:
            raise DosaError(f"scale_exp {self.scale_exp} outside {wire.SCALE_EXP_MIN}..{wire.SCALE_EXP_MAX}")
        try:
            wire.check_mtu(self.mtu)
        except ValueError as e:
            raise DosaError(str(e)) from None
        if not isinstance(self.slots, int) or not 1 <= self.slots <= MAX_SLOTS:
            raise DosaError(f"slots must be an integer in 1..{MAX_SLOTS}, got {self.slots!r}")
        try:
            self.pmap  # noqa: B018 - validates numel/partition_size
        except ValueError as e:
            raise DosaError(str(e)) from None

    # ------------------------------------------------------------------------------ shape, members
    @property
    def workers(self) -> int:
        return len(self.hosts)

    @property
    def pmap(self) -> wire.PartitionMap:
        return wire.PartitionMap(self.numel, self.partition_size, len(self.dpus))

    @property
    def joined(self) -> dict[int, tuple[str, int]]:
        """{worker_id: (ip, port)} of the workers that have joined."""
        return {w: h for w, h in enumerate(self.hosts) if h is not None}

    @property
    def complete(self) -> bool:
        return all(h is not None for h in self.hosts)

    def gtopk_k(self, partition_length) -> np.ndarray | int:
        """k of a partition in gtopk mode: ceil(density * partition_length), at least 1."""
        return np.maximum(1, np.ceil(self.density * np.asarray(partition_length)).astype(np.int64))

    def slots_on(self, dpu: int) -> int:
        """Aggregation slots of this job on DPU ``dpu``: ``slots``, or fewer when that DPU owns
        fewer partitions. Owned partition j (the DPU's j-th) aggregates in slot j % slots_on(dpu),
        so a host may send it only once partition j - slots_on(dpu) of the round is complete."""
        return max(1, min(self.slots, len(self.pmap.owned_by(dpu))))

    def dpu_index(self, address: str) -> int | None:
        """Index of the DPU at ``address`` in this job, None when it is not one of the job's."""
        for i, (a, _) in enumerate(self.dpus):
            if a == address:
                return i
        return None

    # ------------------------------------------------------------------------- the control plane's view
    def view(self, worker_id: int | None = None) -> dict:
        """The JSON the join API answers with (``POST /v1/join``, ``GET /v1/jobs``...)."""
        d = {"job_id": self.job_id, "workers": self.workers, "numel": self.numel,
             "partition_size": self.partition_size, "num_partitions": self.pmap.num_partitions,
             "slots": self.slots, "mtu": self.mtu,
             "scale_exp": self.scale_exp, "mode": self.mode, "density": self.density, "port": self.port,
             "dpus": [{"index": i, "address": a, "port": p} for i, (a, p) in enumerate(self.dpus)],
             "hosts": [{"worker_id": w, "address": a, "port": p} for w, (a, p) in self.joined.items()],
             "complete": self.complete}
        if worker_id is not None:
            d["worker_id"] = worker_id
        return d

    @classmethod
    def from_view(cls, v: dict, partial: bool = False) -> "JobConfig":
        """From the control plane's job view; a DosaError when the job is not complete (unless
        ``partial``: then workers that have not joined are None)."""
        try:
            hosts: list = [None] * int(v["workers"])
            for h in v["hosts"]:
                w = h["worker_id"]
                if not isinstance(w, int) or not 0 <= w < len(hosts):
                    raise DosaError(f"job {v['job_id']}: worker id {w!r} outside 0..{len(hosts) - 1}")
                hosts[w] = (h["address"], h["port"])
            if not partial and None in hosts:
                raise DosaError(f"job {v['job_id']} is not complete: hosts "
                                f"{sorted(h['worker_id'] for h in v['hosts'])} of {v['workers']} joined")
            dpus = sorted(v["dpus"], key=lambda d: d["index"])
            return cls(job_id=v["job_id"], numel=v["numel"], hosts=hosts,
                       dpus=[(d["address"], d["port"]) for d in dpus],
                       partition_size=v["partition_size"], mode=v.get("mode", ResultMode.SUM.value),
                       density=v.get("density", DEFAULT_DENSITY),
                       scale_exp=v.get("scale_exp", DEFAULT_SCALE_EXP), port=v.get("port", wire.DEFAULT_PORT),
                       slots=v.get("slots", DEFAULT_SLOTS), mtu=v.get("mtu", wire.DEFAULT_MTU))
        except (KeyError, TypeError, ValueError) as e:
            raise DosaError(f"the control plane's job description lacks {e}") from None

    # ---------------------------------------------------------------------------------- a job file
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise DosaError(f"job config has unknown keys {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise DosaError(f"bad job config: {e}") from None

    @classmethod
    def load(cls, path: str) -> "JobConfig":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise DosaError(f"cannot read job config {path}: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
