"""The network API hosts call to join a job (JSON over HTTP, stdlib only), and its Python client.

Every DPU runs one control server next to its dataplane. A host joins through any one of them
(the testbed uses DPU 0's); that server installs the host's flow in the dataplane of EVERY DPU of
the job: its own directly, the others through their servers' ``/v1/local/*`` endpoints. A job is
created by an admin request (``POST /v1/jobs``) or by its first joiner when the join request carries
the job's shape (numel, workers, dpus), like a torchrun rendezvous.

Every DPU of a job keeps the job's full view (density, mode, dpus, hosts...) in its registry, in XDP
and userspace mode alike: a DPU worker asking its own control plane learns the whole job, and a
host may join through any DPU that knows it.

Endpoints (request and response bodies are JSON objects)::

    POST /v1/join    {job_id, worker_id|rank?, address, port?, wait?, [numel, workers, dpus,
                      partition_size, scale_exp, mode, density]}  -> the job as the host needs it
    POST /v1/leave   {job_id, worker_id}
    POST /v1/jobs    {job_id, workers, numel, dpus, ...}          -> create a job on all its DPUs
    GET  /v1/jobs  |  GET /v1/jobs/<id>  |  DELETE /v1/jobs/<id>
    GET  /v1/stats                                                 -> this DPU's counters
    POST /v1/local/jobs, /v1/local/flows; DELETE /v1/local/jobs/<id>, /v1/local/flows/<id>/<w>
                                                                   (server to server: this DPU only)

Errors are ``{"error": "<one sentence>"}`` with 400 (malformed), 404 (unknown job), 409 (conflict:
rank taken, job full, shape differs), 504 (not every worker joined within ``wait``), 507 (the job
can never fit a DPU's dataplane), 503 (it fits once other jobs end: a joiner retries within its
``wait``, see dosa.join.join_raw).

The package by job: ``validation`` (request fields -> one-sentence 400s), ``job`` (the registry's
job and its JSON view), ``persistence`` (the registry on disk), ``peers`` (fan-out to the other DPUs,
all or nothing), ``rendezvous`` (ranks, waiting for every worker), ``service`` (ControlService: the
endpoints' logic), ``router`` (HTTP: the route table, ControlServer). The Python client is dosa/join.py (hosts
import it without the control plane).
"""
from .router import ControlServer
from .service import DEFAULT_CONTROL_PORT, ControlService
from .validation import ApiError

__all__ = ["ApiError", "ControlServer", "ControlService","DEFAULT_CONTROL_PORT"]
