"""The DPU worker's timing policy, in one place: when it answers, NACKs, repairs, parks and
publishes. Each value's reason is next to it; docs/dpu_worker.md tells the whole story.
"""

#: A whole result is not sent to the same host again within this many seconds: right after the
#: fan-out the result is still on its way, and a host that asked before it arrived would otherwise
#: double the DPU's send load exactly when it is busiest.
ANSWER_GUARD = 0.1
#: A missing worker is not NACKed again for the same (partition, round) within this many seconds:
#: one NACK per asker's timer would make it resend its contribution once per other host.
NACK_GUARD = 0.002
#: An explicit ask for a whole result is not answered within this many seconds of the fan-out: the
#: result is still on its way (a host starved of CPU asks before it has read it).
ASK_GUARD = 0.02
#: The NACK scan: how often, how long a worker may miss from a (partition, round) before it is
#: told, and how often again. A worker is NACKed only on evidence of loss: it has delivered a later
#: partition of this DPU (a host sends its partitions in order, and one host's packets reach a DPU
#: in order), like TCP's fast retransmit. A worker that is merely late shows no such evidence and
#: is left to its own retransmission timer.
NACK_SCAN_S = 0.002
NACK_GRACE_S = 0.002
NACK_REPEAT_S = 0.01
#: A slot whose next occupant is complete but was not handled this long after the scan first saw
#: it (its completion record was lost, or this worker restarted past it) is handled by the scan.
REPAIR_GRACE_S = 0.05
#: Seconds between two writes of the stats file (dpu run --stats-file), for /metrics.
STATS_EVERY = 0.5
#: Completions of a job this worker does not serve yet are kept this long (the dataplane had the
#: job installed before this worker's discovery saw it: a job's first partition can complete within
#: milliseconds of the install), then handled once the job is served, else counted
#: ``completion_unknown``; at most PARKED_MAX per job are kept.
PARKED_S = 2.0
PARKED_MAX = 65536
#: How often discovery asks its source for jobs (at once, at most every DISCOVER_URGENT_S, when
#: traffic or a completion of an unknown job shows that one was just installed).
DISCOVER_EVERY_S = 0.5
DISCOVER_URGENT_S = 0.05
