"""The one parser of a rank's ``DOSA_*`` environment (what ``dosa testbed run``, the deploy and
torchrun set), and of the on/off switches (``DOSA_MULTICAST``, ``DOSA_GSO``, ``DOSA_GRO``).

=====================  =========================================================================
variable               meaning
=====================  =========================================================================
RANK, WORLD_SIZE       this rank, the number of workers (torchrun's)
LOCAL_RANK,            this rank's place on its node and the node's ranks (torchrun's); a node's
LOCAL_WORLD_SIZE       ranks share its address, so local rank l binds DOSA_PORT + l (``own_port``)
GROUP_RANK             the node's index (torchrun's; default RANK // LOCAL_WORLD_SIZE)
DOSA_JOB_ID            the job to join
DOSA_HOST_ADDR         this host's address (the one it sends from and gets results on)
DOSA_IFACE             its interface (the Gloo baselines bind to it)
DOSA_PORT              the job's UDP port (hosts and DPUs)
DOSA_DPU_ADDRS         comma list of the DPUs' addresses (a first joiner creates the job with them)
DOSA_CONTROL_ADDR/PORT the control plane to join through
DOSA_SECRET_FILE       the deployment's secret file (dosa.auth): signs every call to the control plane
DOSA_CONTROL_CA        the CA certificate of a control plane that serves TLS (then https is used)
DOSA_JOB_CONFIG        a job file instead (JobConfig.save); no control plane needed
=====================  =========================================================================
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from dosa.errors import DosaError

_OFF = ("0", "no", "off", "false")


def switch_on(name: str, env=None) -> bool:
    """An on/off switch, on unless set to 0/no/off/false."""
    return (os.environ if env is None else env).get(name, "1").strip().lower() not in _OFF


def _int(env, name: str, default=None):
    v = env.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise DosaError(f"{name} must be an integer, got {v!r}") from None


@dataclass
class RankEnv:
    rank: int | None = 0  #: None in an environment made for torchrun, which sets RANK itself
    world_size: int | None = None
    job_id: int | None = None
    host_addr: str | None = None
    iface: str | None = None
    port: int | None = None
    dpu_addrs: list | None = None
    control: tuple[str, int] | None = None
    job_config: str | None = None
    secret_file: str | None = None
    control_ca: str | None = None
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int | None = None

    @property
    def own_port(self) -> int | None:
        """The UDP port this rank binds: DOSA_PORT + LOCAL_RANK. The ranks of one node share its
        address, and two sockets on one address and port would split the results between them."""
        return None if self.port is None else self.port + self.local_rank

    @property
    def node_rank(self) -> int:
        """This rank's node: GROUP_RANK, else RANK // LOCAL_WORLD_SIZE (torchrun numbers a node's
        ranks consecutively)."""
        if self.group_rank is not None:
            return self.group_rank
        return (self.rank or 0) // max(1, self.local_world_size)

    @classmethod
    def parse(cls, env=None) -> "RankEnv":
        env = os.environ if env is None else env
        addr, cport = env.get("DOSA_CONTROL_ADDR"), _int(env, "DOSA_CONTROL_PORT")
        dpus = env.get("DOSA_DPU_ADDRS")
        return cls(rank=_int(env, "RANK", 0), world_size=_int(env, "WORLD_SIZE"),
                   job_id=_int(env, "DOSA_JOB_ID"), host_addr=env.get("DOSA_HOST_ADDR") or None,
                   iface=env.get("DOSA_IFACE") or None,
                   port=_int(env, "DOSA_PORT"),
                   dpu_addrs=[a for a in dpus.split(",") if a] if dpus else None,
                   control=(addr, cport) if addr and cport else None,
                   job_config=env.get("DOSA_JOB_CONFIG") or None,
                   secret_file=env.get("DOSA_SECRET_FILE") or None,
                   control_ca=env.get("DOSA_CONTROL_CA") or None,
                   local_rank=_int(env, "LOCAL_RANK", 0), local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
                   group_rank=_int(env, "GROUP_RANK"))

    def to_env(self) -> dict[str, str]:
        """The variables that :meth:`parse` reads back as this (unset fields left out)."""
        out = {}
        for name, v in (("RANK", self.rank), ("WORLD_SIZE", self.world_size), ("DOSA_JOB_ID", self.job_id),
                        ("DOSA_HOST_ADDR", self.host_addr), ("DOSA_IFACE", self.iface), ("DOSA_PORT", self.port),
                        ("DOSA_JOB_CONFIG", self.job_config), ("DOSA_SECRET_FILE", self.secret_file),
                        ("DOSA_CONTROL_CA", self.control_ca)):
            if v is not None:
                out[name] = str(v)
        if self.local_rank or self.local_world_size != 1:
            out["LOCAL_RANK"], out["LOCAL_WORLD_SIZE"] = str(self.local_rank), str(self.local_world_size)
        if self.group_rank is not None:
            out["GROUP_RANK"] = str(self.group_rank)
        if self.dpu_addrs is not None:
            out["DOSA_DPU_ADDRS"] = ",".join(self.dpu_addrs)
        if self.control is not None:
            out["DOSA_CONTROL_ADDR"], out["DOSA_CONTROL_PORT"] = self.control[0], str(self.control[1])
        return out
