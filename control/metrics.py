"""``GET /metrics``: the DPU's counters in the Prometheus text format, for Prometheus and Grafana.

The control process (``dosa ctl serve``) serves it on its HTTP port, beside the join API. Each
scrape reads the counters fresh (nothing is cached) from three places:

- the XDP dataplane's counter array (xdp mode; ``Controller.counters()``): drops by reason,
  merged packets and entries, completions, the packets passed up;
- the DPU worker's stats file (``dosa dpu run --stats-file F``, rewritten twice a second;
  ``ctl serve --worker-stats F``): per job, completions, result packets and entries, answers to
  retransmission requests by outcome, and in userspace mode the merge verdicts (the worker does
  the merge there), plus the worker's own drops;
- the join API's registry: per job, its workers, members and DPUs;
- the API server's guard (control/api/guard.py): calls refused for their credential or for a
  member's session (401/403), by reason, and connections it closed (too many, or too slow).

Rendered by the official client library (``prometheus_client``): a custom collector, so the
values are the sources' own counters, not copies kept in sync. Names follow Prometheus'
conventions (``dosa_<component>_<what>_total`` for counters); the job label is ``job_id``
because ``job`` is the label Prometheus gives the scrape target. docs/control.md lists them.
"""
from __future__ import annotations

import json
import time

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from dataplane import reasons
from dosa.job import DpuMode

#: The worker's stats file is stale (its counters are not served) when older than this.
STALE_AFTER = 10.0
#: Outcomes of the worker's answer to a retransmission request (DpuWorker: JobRuntime.answer).
ANSWER_OUTCOMES = ("retx_answered", "status_sent", "answer_suppressed", "retx_too_old")


def _dataplane(controller) -> list:
    c = controller.counters()
    drops = CounterMetricFamily("dosa_dataplane_drops", "Packets the XDP dataplane dropped, by reason",
                                labels=["reason"])
    for r in reasons.DROP_REASONS:
        drops.add_metric([reasons.name(r)], c[reasons.name(r)])
    out = [drops]
    simple = {
        "merged": ("dosa_dataplane_merged_packets", "Data packets merged into aggregation buffers"),
        "merged_entries": ("dosa_dataplane_merged_entries", "Sparse entries and dense values added"),
        "completions": ("dosa_dataplane_completions", "Partition rounds completed (ring buffer events)"),
        "completion_lost": ("dosa_dataplane_completions_lost", "Completion events lost (ring full)"),
    }
    for key, (name, doc) in simple.items():
        m = CounterMetricFamily(name, doc)
        m.add_metric([], c[key])
        out.append(m)
    passed = CounterMetricFamily("dosa_dataplane_passed_packets",
                                 "Packets passed to the kernel stack (not merged, not dropped), by kind",
                                 labels=["kind"])
    for key in ("pass_not_dosa", "pass_control", "pass_dup_of_complete"):
        passed.add_metric([key.removeprefix("pass_")], c[key])
    out.append(passed)
    return out


def read_worker_stats(path: str | None) -> dict | None:
    """The worker's last published counters, or None (no file, unreadable, or stale)."""
    if not path:
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if time.time() - float(doc.get("time", 0)) > STALE_AFTER:
        return None
    return doc


def _worker(doc: dict) -> list:
    jobs = {int(j): c for j, c in doc.get("jobs", {}).items()}
    fams = {
        "completions": CounterMetricFamily("dosa_worker_completions",
                                           "Partition rounds whose result this DPU sent, per job",
                                           labels=["job_id"]),
        "result_packets": CounterMetricFamily("dosa_worker_result_packets",
                                              "Result packets built (each sent to every host), per job",
                                              labels=["job_id"]),
        "result_entries": CounterMetricFamily("dosa_worker_result_entries",
                                              "Sums sent in result packets, per job", labels=["job_id"]),
        "retx_request": CounterMetricFamily("dosa_worker_retransmission_requests",
                                            "RETX_REQUEST packets received, per job", labels=["job_id"]),
    }
    answers = CounterMetricFamily("dosa_worker_retransmission_answers",
                                  "Answers to retransmission requests and to duplicates of complete "
                                  "rounds, per job and outcome", labels=["job_id", "outcome"])
    merged = CounterMetricFamily("dosa_worker_merge_verdicts",
                                 "Userspace mode: data packets by merge verdict, per job",
                                 labels=["job_id", "verdict"])
    verdicts = {reasons.name(v) for v in reasons.VERDICTS}
    for j, c in sorted(jobs.items()):
        for key, fam in fams.items():
            fam.add_metric([str(j)], c.get(key, 0))
        for o in ANSWER_OUTCOMES:
            answers.add_metric([str(j), o], c.get(o, 0))
        for k, v in sorted(c.items()):
            if k in verdicts and doc.get("mode") == DpuMode.USERSPACE:
                merged.add_metric([str(j), k], v)
    drops = CounterMetricFamily("dosa_worker_dropped_packets",
                                "Packets the DPU worker's socket received and dropped, by reason",
                                labels=["reason"])
    st = doc.get("stats", {})
    for k in ("malformed", "unknown_job", "unknown_worker", "bad_source", "not_owner",
              "unsupported_type"):
        drops.add_metric([k], st.get(k, 0))
    events = CounterMetricFamily("dosa_worker_completion_events",
                                 "Completion events of jobs the DPU worker did not serve yet when "
                                 "they arrived: parked then handled, or lost (unknown)",
                                 labels=["outcome"])
    for k, name in (("completion_parked", "parked"), ("completion_unknown", "unknown")):
        events.add_metric([name], st.get(k, 0))
    up = GaugeMetricFamily("dosa_worker_up", "1 when the DPU worker published its counters recently")
    up.add_metric([], 1)
    return [*fams.values(), answers, merged, drops, events, up]


def _registry_jobs(service) -> list:
    jobs = service.list_jobs().get("jobs", [])
    workers = GaugeMetricFamily("dosa_job_workers", "Workers the job was created for", labels=["job_id"])
    members = GaugeMetricFamily("dosa_job_members", "Workers that have joined", labels=["job_id"])
    dpus = GaugeMetricFamily("dosa_job_dpus", "DPUs the job's partitions are spread over", labels=["job_id"])
    for j in jobs:
        jid = str(j.get("job_id"))
        workers.add_metric([jid], j.get("workers", 0))
        hosts = j.get("hosts") or []
        members.add_metric([jid], sum(1 for h in hosts if h))
        dpus.add_metric([jid], len(j.get("dpus") or []))
    count = GaugeMetricFamily("dosa_jobs", "Jobs this control plane knows")
    count.add_metric([], len(jobs))
    return [count, workers, members, dpus]


#: every reason a call is refused (dosa.auth.AuthError reasons, authority.REASON), all always shown
REFUSED_REASONS = ("no_credential", "bad_credential", "wrong_audience", "bad_signature", "stale",
                   "replayed", "busy", "role_not_allowed", "not_the_holder")
DROPPED_REASONS = ("too_many_connections", "no_thread", "request_timeout")


def _guard(guard) -> list:
    refused, dropped = guard.counts()
    r = CounterMetricFamily("dosa_control_refused_requests",
                            "Calls to the control API refused (401/403): no, wrong or replayed "
                            "credential, a role that may not make the call, another member's session",
                            labels=["reason"])
    for k in sorted(set(REFUSED_REASONS) | set(refused)):
        r.add_metric([k], refused.get(k, 0))
    d = CounterMetricFamily("dosa_control_dropped_connections",
                            "Connections the control API closed: too many open, or a request that did "
                            "not arrive within its deadline", labels=["reason"])
    for k in sorted(set(DROPPED_REASONS) | set(dropped)):
        d.add_metric([k], dropped.get(k, 0))
    on = GaugeMetricFamily("dosa_control_credentials_required",
                           "1 when the control API checks credentials (a deployment secret is set)")
    on.add_metric([], 1 if guard.enforcing else 0)
    return [r, d, on]


class DosaCollector:
    """prometheus_client collector over a ControlService (its controller is None in userspace
    mode), the worker's stats file and the API server's guard (None: not served over HTTP)."""

    def __init__(self, service, worker_stats: str | None = None, guard=None):
        self.service = service
        self.worker_stats = worker_stats
        self.guard = guard

    def collect(self):
        ctl = getattr(self.service, "controller", None)
        if ctl is not None:
            yield from _dataplane(ctl)
        doc = read_worker_stats(self.worker_stats)
        if doc is not None:
            yield from _worker(doc)
        else:
            up = GaugeMetricFamily("dosa_worker_up", "1 when the DPU worker published its counters recently")
            up.add_metric([], 0)
            yield up
        yield from _registry_jobs(self.service)
        if self.guard is not None:
            yield from _guard(self.guard)


def render(service, worker_stats: str | None = None, guard=None) -> tuple[bytes, str]:
    """(body, content type) of one scrape."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DosaCollector(service, worker_stats, guard))
    return generate_latest(reg), CONTENT_TYPE_LATEST

