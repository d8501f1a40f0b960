"""Group a capture's dosa packets per (job, round, partition), summarize them (``dosa capture show``)
and check that the DPU's result packets carry exactly the sums of the workers' data packets
(``dosa capture verify``). Everything is vectorized over the capture; Python loops only run over
groups with problems. See docs/capture.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dosa.capture_decode import (DATA_TYPES, RESULT_TYPES, SEQUENCED_TYPES, _DENSE, _SEQUENCED,
                                 _SPARSE, DosaCapture)
from dosa.job import ResultMode
from dosa.wire import Flags, PacketType

# --------------------------------------------------------------------------------------------------
# Grouping helpers
# --------------------------------------------------------------------------------------------------
def _runs(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort rows by ``keys`` (first key most significant; ties keep file order).

    Returns (order, run_id per sorted row, first sorted position of each run)."""
    n = len(keys[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort(keys[::-1])
    new = np.zeros(n, bool)
    new[0] = True
    for k in keys:
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    run = np.cumsum(new) - 1
    return order, run, np.flatnonzero(new)


def first_occurrence(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(is_first, first_row): whether each row is the first in file order with its key, and the
    row of that first occurrence."""
    order, run, starts = _runs(keys)
    first_row = np.empty(len(order), np.int64)
    first_row[order] = order[starts][run]
    return first_row == np.arange(len(order)), first_row


@dataclass
class Groups:
    """(job, round, partition) groups of the data and result packets of a capture."""

    keys: np.ndarray  # (g, 3) int64: job, round, partition
    gid: np.ndarray  # per packet row: group id, -1 for packets outside data/result types
    first: np.ndarray  # per packet row: True if first copy of (group, sender, seq)
    first_row: np.ndarray  # per packet row: row of its first copy


def group(cap: DosaCapture) -> Groups:
    h = cap.hdr
    t = h["type"].astype(np.int64)
    rows = np.flatnonzero(_SEQUENCED[t])
    job, rnd, part = (h[f][rows].astype(np.int64) for f in ("job_id", "round", "partition"))
    order, run, starts = _runs([job, rnd, part])
    gid = np.full(len(h), -1, np.int64)
    gid[rows[order]] = run
    keys = np.stack([job[order][starts], rnd[order][starts], part[order][starts]], axis=1) \
        if len(rows) else np.zeros((0, 3), np.int64)
    # the sender of a data packet is its worker; results share one seq space (worker_id 0xFFFF)
    is_first, first_row = first_occurrence([gid[rows], h["worker_id"][rows].astype(np.int64),
                                            h["seq"][rows].astype(np.int64)]) \
        if len(rows) else (np.zeros(0, bool), np.zeros(0, np.int64))
    first = np.zeros(len(h), bool)
    first[rows] = is_first
    frow = np.arange(len(h))
    frow[rows] = rows[first_row]
    return Groups(keys, gid, first, frow)


# --------------------------------------------------------------------------------------------------
# dosa capture show: per (job, round, partition), per sender: packets, seqs, entries
# --------------------------------------------------------------------------------------------------
@dataclass
class SenderStats:
    """Per (group, sender) aggregates; sender = worker_id (DPU_SENDER_ID for results)."""

    gid: np.ndarray
    sender: np.ndarray
    packets: np.ndarray  # every copy
    seqs: np.ndarray  # distinct seqs
    total: np.ndarray  # largest ``total`` seen
    total_min: np.ndarray  # smallest (differs from total: the sender changed it mid-contribution)
    entries: np.ndarray  # entries of distinct packets
    flags_or: np.ndarray  # OR of the flags of all copies
    dense: np.ndarray  # bool: some packet is a dense type
    scale_min: np.ndarray
    scale_max: np.ndarray


def sender_stats(cap: DosaCapture, g: Groups, rows: np.ndarray) -> SenderStats:
    h = cap.hdr
    key = g.gid[rows] * 65536 + h["worker_id"][rows].astype(np.int64)
    uk, inv = np.unique(key, return_inverse=True)
    n = len(uk)
    first = g.first[rows]

    def red(ufunc, vals, init):
        out = np.full(n, init, np.int64)
        ufunc.at(out, inv, vals.astype(np.int64))
        return out

    return SenderStats(
        gid=uk // 65536, sender=uk % 65536,
        packets=np.bincount(inv, minlength=n),
        seqs=np.bincount(inv, weights=first, minlength=n).astype(np.int64),
        total=red(np.maximum, h["total"][rows], 0),
        total_min=red(np.minimum, h["total"][rows], 1 << 30),
        entries=np.bincount(inv, weights=h["count"][rows] * first, minlength=n).astype(np.int64),
        flags_or=red(np.bitwise_or, h["flags"][rows], 0),
        dense=red(np.maximum, _DENSE[h["type"][rows].astype(np.int64)], 0).astype(bool),
        scale_min=red(np.minimum, h["scale_exp"][rows], 1 << 30),
        scale_max=red(np.maximum, h["scale_exp"][rows], -(1 << 30)),
    )


def _rows_of(cap: DosaCapture, types) -> np.ndarray:
    return np.flatnonzero(np.isin(cap.hdr["type"], [int(t) for t in types]))


def summarize(cap: DosaCapture, g: Groups | None = None) -> dict:
    """Everything ``dosa capture show`` prints, as a JSON-ready dict."""
    g = g or group(cap)
    ds = sender_stats(cap, g, _rows_of(cap, DATA_TYPES))
    rs = sender_stats(cap, g, _rows_of(cap, RESULT_TYPES))
    groups = [{"job": int(j), "round": int(r), "partition": int(p), "workers": [], "result": None}
              for j, r, p in g.keys]
    for i in range(len(ds.gid)):
        groups[ds.gid[i]]["workers"].append({
            "worker": int(ds.sender[i]), "packets": int(ds.packets[i]),
            "duplicates": int(ds.packets[i] - ds.seqs[i]), "seqs": int(ds.seqs[i]),
            "total": int(ds.total[i]), "entries": int(ds.entries[i]), "dense": bool(ds.dense[i]),
            "scale_exp": int(ds.scale_min[i])})
    for i in range(len(rs.gid)):
        groups[rs.gid[i]]["result"] = {
            "packets": int(rs.packets[i]), "duplicates": int(rs.packets[i] - rs.seqs[i]),
            "seqs": int(rs.seqs[i]), "total": int(rs.total[i]), "entries": int(rs.entries[i]),
            "gtopk": bool(rs.flags_or[i] & Flags.GTOPK), "dense": bool(rs.dense[i]),
            "scale_exp": int(rs.scale_min[i])}
    other = {k: v for k, v in cap.stats.get("by_type", {}).items()
             if PacketType[k] not in SEQUENCED_TYPES}
    return {**cap.stats, "groups": groups, "other_packets": other,
            "rounds": len({(gr["job"], gr["round"]) for gr in groups}), "partitions": len(groups)}


# --------------------------------------------------------------------------------------------------
# dosa capture verify
# --------------------------------------------------------------------------------------------------
MAX_DETAILS = 5
_SHIFT = 34  # key = gid << 34 | index: room for dense indices up to base + 359 > 2^32


@dataclass
class _Problems:
    """Mismatch details per group, collected from vectorized masks."""

    by_group: dict = field(default_factory=dict)  # gid -> {"count", "kinds", "details"}


def _add_counted(problems: _Problems, gid: np.ndarray, kind: str, rows: dict[str, np.ndarray]):
    """Record one ``kind`` problem per element of ``gid`` with per-element fields ``rows``.

    Counting is vectorized; the Python loop runs over groups and at most MAX_DETAILS details each."""
    if not len(gid):
        return
    order = np.argsort(gid, kind="stable")
    gs = gid[order]
    starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
    counts = np.diff(np.r_[starts, len(gs)])
    for s, c in zip(starts, counts):
        p = problems.by_group.setdefault(int(gs[s]), {"count": 0, "kinds": {}, "details": []})
        p["count"] += int(c)
        p["kinds"][kind] = p["kinds"].get(kind, 0) + int(c)
        for i in order[s: s + min(c, MAX_DETAILS)]:
            if len(p["details"]) < MAX_DETAILS:
                p["details"].append({"kind": kind, **{k: int(v[i]) for k, v in rows.items()}})


def _conflicting_copies(cap: DosaCapture, g: Groups, problems: _Problems) -> None:
    """A later copy of (group, sender, seq) whose bytes (other than flags) differ from the first:
    the receiver kept whichever arrived first, so the capture cannot say what was summed."""
    dup = np.flatnonzero((g.gid >= 0) & ~g.first)
    bad = []
    for r in dup:  # Python only over duplicates, which are rare
        a, b = bytearray(cap.payload(r)), bytearray(cap.payload(int(g.first_row[r])))
        a[6:8] = b[6:8] = b"\0\0"  # flags may differ (RETRANSMIT)
        if a != b:
            bad.append(r)
    bad = np.array(bad, np.int64)
    _add_counted(problems, g.gid[bad], "conflicting_copies",
                 {"worker": cap.hdr["worker_id"][bad], "seq": cap.hdr["seq"][bad],
                  "frame": cap.frame[bad], "first_frame": cap.frame[g.first_row[bad]]})


def verify(cap: DosaCapture, *, partial_edges: bool = False) -> dict:
    """Recompute every (job, round, partition) sum from the data packets and compare with the
    result packets; see docs/capture.md for the rules. Returns the JSON report.

    Fails closed: an incomplete (job, round, partition) fails the capture. ``partial_edges``
    tolerates those of a job's rounds before its first complete round and after its last one (a
    capture started or stopped mid-run), never one in between (a lost packet the run recovered
    from is in the capture too: one missing there is a hole in the evidence).

    Four steps, each its own function: which groups are complete (only those are checked), one
    scale per group, the sums, the report."""
    g = group(cap)
    ds = sender_stats(cap, g, _rows_of(cap, DATA_TYPES))
    rs = sender_stats(cap, g, _rows_of(cap, RESULT_TYPES))
    c = _completeness(g, ds, rs)
    problems = _Problems()
    _check_scales(g, ds, rs, c.checked, problems)
    _conflicting_copies(cap, g, problems)
    problems.by_group = {k: v for k, v in problems.by_group.items() if c.checked[k]}
    entries = _check_sums(cap, g, c, problems)
    return _report(cap, g, c, problems, entries, partial_edges)


@dataclass
class _Completeness:
    """Per group: every worker of the job delivered all its seqs and the result has all its seqs
    (``checked``), the result is gtopk, and why an incomplete group is."""

    checked: np.ndarray
    gtopk: np.ndarray
    reasons: dict[int, list[str]]


def _completeness(g: Groups, ds: SenderStats, rs: SenderStats) -> _Completeness:
    ng = len(g.keys)
    job_of = g.keys[:, 0] if ng else np.zeros(0, np.int64)
    jw = np.unique(np.stack([job_of[ds.gid], ds.sender], 1), axis=0) if len(ds.gid) \
        else np.zeros((0, 2), np.int64)
    jobs, nworkers = np.unique(jw[:, 0], return_counts=True)
    want_workers = np.zeros(ng, np.int64)
    if ng and len(jobs):
        pos = np.clip(np.searchsorted(jobs, job_of), 0, len(jobs) - 1)
        want_workers = np.where(jobs[pos] == job_of, nworkers[pos], 0)
    complete_sender = (ds.seqs == ds.total) & (ds.total == ds.total_min)
    have_workers = np.bincount(ds.gid, minlength=ng)
    done_workers = np.bincount(ds.gid, weights=complete_sender, minlength=ng).astype(np.int64)
    data_complete = (have_workers == want_workers) & (done_workers == have_workers) & (have_workers > 0)
    res_complete = np.zeros(ng, bool)
    res_complete[rs.gid] = (rs.seqs == rs.total) & (rs.total == rs.total_min)
    gtopk = np.zeros(ng, bool)
    gtopk[rs.gid] = (rs.flags_or & Flags.GTOPK) != 0
    checked = data_complete & res_complete

    reasons: dict[int, list[str]] = {}
    for i in np.flatnonzero(~checked):  # incomplete groups: name what is missing (Python per group)
        r = reasons.setdefault(int(i), [])
        if have_workers[i] == 0:
            r.append("no data packets")
        elif have_workers[i] < want_workers[i]:
            seen = set(ds.sender[ds.gid == i].tolist())
            allw = set(jw[jw[:, 0] == job_of[i], 1].tolist())
            r.append(f"no data from worker(s) {sorted(allw - seen)}")
    for i in np.flatnonzero(~complete_sender & ~checked[ds.gid]):
        reasons.setdefault(int(ds.gid[i]), []).append(
            f"worker {ds.sender[i]}: {ds.seqs[i]} of {ds.total[i]} data packets"
            + (" (total changed)" if ds.total[i] != ds.total_min[i] else ""))
    for i in np.flatnonzero(~res_complete):
        r = reasons.setdefault(int(i), [])
        k = np.flatnonzero(rs.gid == i)
        r.append(f"result: {rs.seqs[k[0]]} of {rs.total[k[0]]} packets" if len(k) else "no result packets")
    return _Completeness(checked, gtopk, reasons)


def _check_scales(g: Groups, ds: SenderStats, rs: SenderStats, checked: np.ndarray,
                  problems: _Problems) -> None:
    """Every data packet of a checked group and its result use one scale_exp."""
    ng = len(g.keys)
    dmin = np.full(ng, 1 << 30)
    dmax = np.full(ng, -(1 << 30))
    np.minimum.at(dmin, ds.gid, ds.scale_min)
    np.maximum.at(dmax, ds.gid, ds.scale_max)
    rmin = np.full(ng, 1 << 30)
    rmax = np.full(ng, -(1 << 30))
    rmin[rs.gid], rmax[rs.gid] = rs.scale_min, rs.scale_max
    bad_scale = np.flatnonzero(checked & ((dmin != dmax) | (rmin != rmax) | (rmin != dmin)))
    _add_counted(problems, bad_scale, "scale_exp",
                 {"data_min": dmin[bad_scale], "data_max": dmax[bad_scale], "result": rmin[bad_scale]})


def _gidof(k):
    return k >> _SHIFT


def _idxof(k):
    return k & ((1 << _SHIFT) - 1)


def _entries(cap: DosaCapture, g: Groups, checked: np.ndarray):
    """The checked groups' entries, keyed ``group << _SHIFT | index`` and sorted: the true sums
    ``(key, int64 sum)`` over the first copy of every data packet, and the result entries ``(key,
    value, sparse)`` as sent (duplicates kept: they are a problem to report)."""
    h = cap.hdr
    epk = cap.entry_pkt
    egid = g.gid[epk]
    use = g.first[epk] & (egid >= 0)
    use &= checked[np.where(egid >= 0, egid, 0)]
    is_data = np.isin(h["type"][epk], [int(t) for t in DATA_TYPES])
    dsel = use & is_data
    dkey = (egid[dsel] << _SHIFT) | cap.entry_index[dsel]
    dval = cap.entry_value[dsel]
    o = np.argsort(dkey, kind="stable")
    dkey, dval = dkey[o], dval[o]
    st = np.flatnonzero(np.r_[True, dkey[1:] != dkey[:-1]]) if len(dkey) else np.zeros(0, np.int64)
    tsum = np.add.reduceat(dval, st) if len(st) else np.zeros(0, np.int64)

    rsel = use & ~is_data
    rkey = (egid[rsel] << _SHIFT) | cap.entry_index[rsel]
    rval = cap.entry_value[rsel]
    rsparse = _SPARSE[h["type"][epk[rsel]].astype(np.int64)]
    o = np.argsort(rkey, kind="stable")
    return (dkey[st], tsum), (rkey[o], rval[o], rsparse[o])


def _check_sums(cap: DosaCapture, g: Groups, c: _Completeness, problems: _Problems) -> int:
    """The true sums (int64 over the first copy of every data packet of the checked groups)
    against the result entries: duplicates, wrong values, zero sums sent, true sums missing (sum
    mode) or not among the largest (gtopk, ties at the boundary allowed). Returns the number of
    result entries checked."""
    ng, gtopk = len(g.keys), c.gtopk
    (tkey, tsum), (rkey, rval, rsparse) = _entries(cap, g, c.checked)

    dupk = np.flatnonzero(rkey[1:] == rkey[:-1]) + 1 if len(rkey) else np.zeros(0, np.int64)
    _add_counted(problems, _gidof(rkey[dupk]), "duplicate_index",
                 {"index": _idxof(rkey[dupk]), "got": rval[dupk]})
    pos = np.clip(np.searchsorted(tkey, rkey), 0, max(len(tkey) - 1, 0))
    found = (tkey[pos] == rkey) if len(tkey) else np.zeros(len(rkey), bool)
    expected = np.where(found, tsum[pos] if len(tsum) else 0, 0)
    wrong = np.flatnonzero(rval != expected)
    _add_counted(problems, _gidof(rkey[wrong]), "wrong_value",
                 {"index": _idxof(rkey[wrong]), "expected": expected[wrong], "got": rval[wrong]})
    zero = np.flatnonzero(rsparse & (rval == 0) & (expected == 0))
    _add_counted(problems, _gidof(rkey[zero]), "zero_sum_entry", {"index": _idxof(rkey[zero])})

    # true non-zero sums the result does not carry
    returned = np.zeros(len(tkey), bool)
    returned[pos[found]] = True
    missing = (tsum != 0) & ~returned
    tg = _gidof(tkey)
    miss_sum = np.flatnonzero(missing & ~gtopk[tg]) if len(tkey) else np.zeros(0, np.int64)
    _add_counted(problems, tg[miss_sum], "missing_index",
                 {"index": _idxof(tkey[miss_sum]), "expected": tsum[miss_sum]})
    # gtopk: the returned set must be the largest |sum| (ties at the boundary allowed)
    rg = _gidof(rkey)
    min_ret = np.full(ng, np.iinfo(np.int64).max)
    np.minimum.at(min_ret, rg, np.abs(rval))
    miss_k = np.flatnonzero(missing & gtopk[tg]) if len(tkey) else np.zeros(0, np.int64)
    not_top = miss_k[np.abs(tsum[miss_k]) > min_ret[tg[miss_k]]]
    _add_counted(problems, tg[not_top], "not_top_k",
                 {"index": _idxof(tkey[not_top]), "sum": tsum[not_top],
                  "smallest_returned": min_ret[tg[not_top]]})
    return int(len(rkey))


def _edge_groups(g: Groups, checked: np.ndarray) -> np.ndarray:
    """Per group: outside its job's first..last complete round (every group of the round
    checked), i.e. at the capture's edges."""
    ng = len(g.keys)
    jr = g.keys[:, :2] if ng else np.zeros((0, 2), np.int64)
    edge = np.ones(ng, bool)
    if ng:
        rounds_, inv = np.unique(jr, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        full = np.bincount(inv, weights=checked, minlength=len(rounds_)) == np.bincount(inv, minlength=len(rounds_))
        for j in np.unique(rounds_[:, 0]).tolist():
            rr = rounds_[(rounds_[:, 0] == j) & full, 1]
            if len(rr):
                mine = jr[:, 0] == j
                edge[mine] = (jr[mine, 1] < rr.min()) | (jr[mine, 1] > rr.max())
    return edge


def _report(cap: DosaCapture, g: Groups, c: _Completeness, problems: _Problems, entries: int,
            partial_edges: bool) -> dict:
    """The JSON report (docs/capture.md): its keys are the command's output."""
    checked, gtopk = c.checked, c.gtopk

    def where(i):
        j, r, p = (int(x) for x in g.keys[i])
        return {"job": j, "round": r, "partition": p}

    mismatches = [{**where(i), "mode": ResultMode.GTOPK.value if gtopk[i] else ResultMode.SUM.value,
                   "problems": v["count"], "kinds": v["kinds"], "details": v["details"]}
                  for i, v in sorted(problems.by_group.items())]
    edge = _edge_groups(g, checked)
    incomplete = [{**where(i), "missing": c.reasons.get(int(i), []), "edge": bool(edge[i])}
                  for i in np.flatnonzero(~checked)]
    inner = sum(1 for x in incomplete if not x["edge"])
    n_checked = int(checked.sum())
    verified = n_checked - len(mismatches)
    ok = not mismatches and verified > 0 and not inner and (partial_edges or not incomplete)
    return {"ok": bool(ok), "verified": verified, "mismatches": mismatches, "incomplete": incomplete,
            "incomplete_inner": inner,
            "rounds": len({tuple(g.keys[i, :2]) for i in np.flatnonzero(checked)}),
            "partitions": n_checked, "gtopk_partitions": int((checked & gtopk).sum()),
            "entries_checked": entries, "capture": cap.stats}
