"""Checks of API request bodies: each bad field becomes one sentence in a 400 (:class:`ApiError`).

Every number a request carries goes through :func:`req_int` (type and range), every address through
:func:`req_addr`; :func:`parse_job` turns a request into a :class:`dosa.job.JobConfig` (nobody joined yet)
whose shape the wire format accepts (``wire.PartitionMap`` refuses what the dataplane could not cut)."""
from __future__ import annotations

import socket

from dosa import wire
from dosa.errors import DosaError
from dosa.job import DEFAULT_DENSITY, DEFAULT_SCALE_EXP, DEFAULT_SLOTS, MAX_SLOTS, RESULT_MODES, JobConfig, ResultMode



class ApiError(DosaError):
    """An error with the HTTP status the server answers it with (400, 403, 404, 409, 502, 504,
    507); ``reason``: the metrics label of a refused call (403)."""

    def __init__(self, status: int, message: str, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason


def bad(msg: str) -> ApiError:
    return ApiError(400, msg)


def req_int(req: dict, name: str, lo: int, hi: int, default=None) -> int:
    v = req.get(name, default)
    if v is None:
        raise bad(f"field {name!r} is required")
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"field {name!r} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise bad(f"field {name!r} = {v} outside {lo}..{hi}")
    return v


def req_addr(v, what: str) -> str:
    if not isinstance(v, str):
        raise bad(f"{what} must be an IPv4 address string, got {v!r}")
    try:
        socket.inet_aton(v)
    except OSError:
        raise bad(f"{what} {v!r} is not an IPv4 address") from None
    if v.count(".") != 3:
        raise bad(f"{what} {v!r} is not a dotted IPv4 address")
    return v


def req_wait(req: dict) -> float:
    wait = req.get("wait", 0)
    if not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
        raise bad(f"wait must be 0..3600 seconds, got {wait!r}")
    return wait


def parse_job(req: dict, default_address: str, default_port: int, port_field: str = "job_port") -> JobConfig:
    """The job a create request (``port_field="port"``) or a first joiner (``"job_port"``: its
    ``port`` is the host's own) describes; DPUs default to ``default_address``:``default_port``."""
    job_id = req_int(req, "job_id", 1, 2**32 - 1)
    workers = req_int(req, "workers", 1, wire.MAX_WORKERS)
    numel = req_int(req, "numel", 1, 2**32 - 1)
    psize = req_int(req, "partition_size", 1, 2**32 - 1, wire.DEFAULT_PARTITION_SIZE)
    slots = req_int(req, "slots", 1, MAX_SLOTS, DEFAULT_SLOTS)
    mtu = req_int(req, "mtu", wire.MIN_MTU, wire.MAX_MTU, wire.DEFAULT_MTU)
    scale = req_int(req, "scale_exp", wire.SCALE_EXP_MIN, wire.SCALE_EXP_MAX, DEFAULT_SCALE_EXP)
    port = req_int(req, port_field, 1, 65535, default_port)  # the job's UDP port on the DPUs
    mode = req.get("mode", ResultMode.SUM.value)
    if mode not in RESULT_MODES:
        raise bad(f"mode must be 'sum' or 'gtopk', got {mode!r}")
    density = req.get("density", DEFAULT_DENSITY)
    if not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise bad(f"density must be a number in (0, 1], got {density!r}")
    dpus_raw = req.get("dpus") or [default_address]
    if not isinstance(dpus_raw, list):
        raise bad("dpus must be a list of addresses or {address, port} objects")
    dpus = []
    for d in dpus_raw:
        if isinstance(d, dict):
            dpus.append((req_addr(d.get("address"), "DPU address"), req_int(d, "port", 1, 65535, default_port)))
        else:
            dpus.append((req_addr(d, "DPU address"), default_port))
    try:
        wire.PartitionMap(numel, psize, len(dpus))
    except ValueError as e:
        raise bad(str(e)) from None
    return JobConfig(job_id=job_id, numel=numel, hosts=[None] * workers, dpus=dpus, partition_size=psize,
                     mode=mode, density=float(density), scale_exp=scale, port=port, slots=slots, mtu=mtu)


def check_same_shape(job: JobConfig, req: dict) -> None:
    """A later joiner must agree with the job's shape (409 otherwise)."""
    for name in ("workers", "numel", "partition_size", "slots", "mtu"):
        if name in req and req[name] != getattr(job, name):
            raise ApiError(409, f"job {job.job_id} has {name} {getattr(job, name)}, "
                                f"the request says {req[name]}")


def parse_hosts(hosts, job: JobConfig) -> dict:
    """``[{worker_id, address, port}]`` -> ``{worker_id: (address, port)}``."""
    if not isinstance(hosts, list):
        raise bad("hosts must be a list of {worker_id, address, port} objects")
    out = {}
    for h in hosts:
        if not isinstance(h, dict):
            raise bad("hosts must be a list of {worker_id, address, port} objects")
        out[req_int(h, "worker_id", 0, job.workers - 1)] = (req_addr(h.get("address"), "host address"),
                                                          req_int(h, "port", 1, 65535))
    return out
