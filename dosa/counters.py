"""The counters of a DPU's merge, one enum for every C and Python view: the XDP program's per-CPU
counters are indexed by it, the header rules of dosa.wire return it (dosa_check_header), the
userspace merge and the hosts' result intake give their verdicts in it. dosa.wire renders it into
the generated C header dosa/dosa_wire.h (``enum dosa_counter``), so C and Python cannot disagree;
dataplane/reasons.py adds the dataplane's reading of it (drop reasons, verdicts, names).

Every packet the program sees moves exactly ONE *verdict* counter (a drop reason, ``merged`` or a
``pass_*``): the sum of the verdict counters is the number of packets seen, which the fuzz test
checks. ``merged_entries``, ``completions``, ``completion_lost`` and ``saturated_sums`` are extra
tallies.
"""
from __future__ import annotations

import enum


class Counter(enum.IntEnum):
    # ---- drops (XDP_DROP), one per broken rule -----------------------------------------------------
    SHORT_PACKET = 0  # truncated Ethernet/IPv4/UDP/dosa header or UDP length past the frame
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_TYPE = 3  # unknown type, or a DPU->host result type arriving at the DPU
    COUNT_MISMATCH = 4  # UDP payload length != 32 + count * entry size, or count over the maximum
    BAD_FIELD = 5  # flags, reserved, seq/total, LAST, scale range, base, worker_id, partition range
    UNKNOWN_JOB = 6
    UNKNOWN_WORKER = 7  # (job, worker) not installed, or worker_id >= the job's workers
    BAD_SOURCE = 8  # IPv4 source address / UDP source port not the ones installed for the worker
    NOT_OWNER = 9  # partition owned by another DPU (p % num_dpus != dpu_index)
    INDEX_OUT_OF_PARTITION = 10
    ROUND_TOO_OLD = 11
    ROUND_TOO_NEW = 12
    DUPLICATE = 13  # (partition, parity, worker, seq) already merged, round not complete yet
    SCALE_MISMATCH = 14
    TOTAL_MISMATCH = 15
    IP_FRAGMENT = 16  # a fragmented IPv4 datagram to the dosa port (reassembly would bypass XDP)
    INTERNAL = 17  # a state lookup failed (pool bounds): a control-plane bug, never a sender's
    WRONG_SHARD = 18  # userspace DPU of N shards: a packet of another shard's partition reached this
    #                   one (the reuseport group steers a GSO datagram whole, by its first packet)
    # ---- verdicts that are not drops ------------------------------------------------------------------
    MERGED = 19  # a SPARSE_DATA or DENSE_DATA packet added into its buffer (XDP_DROP after merging)
    PASS_NOT_DOSA = 20  # not IPv4/UDP to a dosa port: XDP_PASS untouched
    PASS_CONTROL = 21  # RETX_REQUEST / HEARTBEAT of a valid flow: XDP_PASS to the DPU worker
    PASS_DUP_OF_COMPLETE = 22  # duplicate data of a complete round: XDP_PASS so the worker resends
    # ---- tallies (not verdicts) ---------------------------------------------------------------------
    MERGED_ENTRIES = 23  # sparse entries and dense values added
    COMPLETIONS = 24
    COMPLETION_LOST = 25  # ring buffer full: the DPU worker must rescan (never expected)
    SATURATED_SUMS = 26  # adds that hit +-(2^31 - 1): a host broke the clip bound (never expected)


NUM_COUNTERS = len(Counter)


def c_enum() -> str:
    """The C text of ``enum dosa_counter`` (``DOSA_C_<NAME> = <value>``) plus ``DOSA_NUM_COUNTERS``."""
    lines = ["enum dosa_counter {"]
    lines += [f"\tDOSA_C_{c.name} = {int(c)}," for c in Counter]
    lines.append("};")
    lines.append(f"#define DOSA_NUM_COUNTERS {NUM_COUNTERS}")
    return "\n".join(lines) + "\n"
