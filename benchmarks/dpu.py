"""``dosa bench dpu``: the DPU side alone, on one pinned core, no hosts in the loop (root).

Each figure is measured on the code the DPU runs, with a round's real traffic: ``--workers``
hosts' top-k of a ``--numel`` gradient at ``--density`` (benchmarks.allreduce.gradients, hosts
correlated by ``--correlation``), quantized and packetized by the hosts' packetizer at ``--mtu``.

(a) **XDP merge**: every data packet of a round (Ethernet/IPv4/UDP frames) run once through the
    loaded dataplane program with BPF_PROG_TEST_RUN, in partition order, a default job (64 slots)
    installed: the kernel's own time for the program, per packet and per entry. The floor of a
    test run (a packet the program passes at its first check) is reported beside it.
(b) **completion path**: each completion the program writes to its ring is handled by the DPU
    worker's compiled engine (dpu_fw/_completion.pyx) as soon as its partition is merged: result
    packets built from the buffer and sent into a UDP socket (one send per packet, as to a
    multicast group). Nanoseconds per result entry and per partition.
(c) **settle**: the same engine's clearing of each slot's previous occupant (its sums at its
    touched list, its dedup state and counters), per partition.
(d) **userspace merge**: the same packets through the userspace worker's compiled merge
    (dpu_fw/_softmerge.pyx) into its own state, per entry (its completions' time subtracted).

``--repeat`` alternated repetitions (a round of (a)-(c), then a round of (d)); medians and the
spread (min, max) are reported, and every result packet received is checked against the exact sums.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import sys
import time
import uuid

import numpy as np

from dosa import wire
from dosa.errors import DosaError

JOB_ID = 7100
SINK = ("127.0.0.1", 0)
#: the hosts' addresses in the frames and flows: loopback, so results never leave the machine
HOSTS = [(f"127.0.0.{w + 2}", 42000 + w) for w in range(64)]
FIGURES = ("xdp_merge_ns_per_entry", "completion_ns_per_result_entry", "settle_ns_per_partition",
           "userspace_merge_ns_per_entry")
COUNT_AT = wire.HEADER_DTYPE.fields["count"][1]  # the header's entry count
#: issue 21's targets for the figures above (docs/performance.md)
TARGETS = {"xdp_merge_ns_per_entry": 6.0, "completion_ns_per_result_entry": 8.0}


def make_round(numel: int, density: float, workers: int, correlation: float, seed: int = 0):
    """Every host's (indices u32, quantized values i32) and the round's scale: exact top-k of a
    correlated synthetic gradient, quantized with the clip bound of ``workers``."""
    from benchmarks.allreduce.gradients import k_for, make_gradients, topk_indices
    from host_lib.quantize import choose_scale_exp, quantize

    g = make_gradients(workers, numel, correlation, seed)
    k = k_for(numel, density)
    idx = [topk_indices(x, k) for x in g]
    vals = [x[i] for x, i in zip(g, idx)]
    s = choose_scale_exp(max(float(np.abs(v).max()) for v in vals), workers)
    out = []
    for i, v in zip(idx, vals):
        q = quantize(v, s, workers)[0]
        keep = q != 0
        out.append((i[keep].astype(np.uint32), q[keep].astype(np.int32)))
    return out, s


def packets(entries, scale: int, pmap, rnd: int, mtu: int):
    """The round's data packets grouped by partition: [(worker, payload bytes)] per partition."""
    from dosa.packetizer import packetize

    per_part = [[] for _ in range(pmap.num_partitions)]
    for w, (idx, q) in enumerate(entries):
        b = packetize(idx, q, pmap, job_id=JOB_ID, worker_id=w, round=rnd, scale_exp=scale, mtu=mtu)
        parts = b.headers()["partition"].astype(np.int64)
        for i in range(len(b)):
            per_part[parts[i]].append((w, bytes(b.data[i, :b.lengths[i]])))
    return per_part


def frame(w: int, payload: bytes) -> bytes:
    """An Ethernet/IPv4/UDP frame from host ``w`` to the DPU's data port."""
    src, sport = HOSTS[w]
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton("127.0.0.1"))
    udp = struct.pack(">HHHH", sport, wire.DEFAULT_PORT, 8 + len(payload), 0)
    return b"\x02\x00\x00\x00\x00\x02\x02\x00\x00\x00\x00\x01\x08\x00" + ip + udp + payload


def exact(entries, numel: int) -> tuple[np.ndarray, np.ndarray]:
    allidx = np.concatenate([i.astype(np.int64) for i, _ in entries])
    u, inv = np.unique(allidx, return_inverse=True)
    tot = np.zeros(len(u), np.int64)
    np.add.at(tot, inv, np.concatenate([q.astype(np.int64) for _, q in entries]))
    return u, tot


class _Sink:
    """The socket result packets are sent into (the DPU's 'multicast group'): read between
    partitions (so its buffer never fills) and kept, to check every result against the exact sums."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 26)
        self.sock.bind(SINK)
        self.sock.setblocking(False)
        self.addr = self.sock.getsockname()
        self.got: list[bytes] = []

    def drain(self) -> None:
        try:
            while True:
                self.got.append(self.sock.recv(65536))
        except BlockingIOError:
            pass

    def wrong(self, ref, rnd: int) -> int:
        """Result entries of round ``rnd`` received since the last call that differ from the exact
        sums, plus exact sums that did not come (0: every result exact and whole)."""
        from dosa.packetizer import parse_batch, results_to_sparse
        from dosa.wire import PacketBatch

        self.drain()
        got, self.got = self.got, []
        batch = PacketBatch.from_packets(got)
        parsed = parse_batch(batch)
        mine = parsed.headers["round"] == rnd
        idx, sums, _ = results_to_sparse(parse_batch(batch.select(mine)))  # duplicates collapse
        want_idx, want = ref
        if len(idx) != len(want_idx):
            return abs(len(idx) - len(want_idx)) + 1
        return int((idx.astype(np.int64) != want_idx).sum() + (sums.astype(np.int64) != want).sum())


def _engine(sink):
    from dosa.transport import UdpEndpoint
    from dpu_fw._completion import CompletionEngine

    ep = UdpEndpoint(("127.0.0.1", 0))
    return ep, CompletionEngine(ep.fd, ep.counters, ep.gso)


def _split(cpu_ns: int, parts: dict) -> dict:
    """``cpu_ns`` (this thread's CPU time, which time other processes take from the core does not
    count) split over the engine's parts in the proportions of their wall-clock counters (read on
    the cheap monotonic clock, so the accounting costs next to nothing itself)."""
    tot = sum(parts.values()) or 1
    return {k: cpu_ns * v / tot for k, v in parts.items()}


def _group(sink):
    return (int.from_bytes(socket.inet_aton(sink.addr[0]), "little"), socket.htons(sink.addr[1]))


def _job(numel: int, workers: int, mtu: int, slots: int):
    from dosa.job import JobConfig

    return JobConfig(job_id=JOB_ID, numel=numel, hosts=HOSTS[:workers], dpus=[("127.0.0.1", wire.DEFAULT_PORT)],
                     slots=slots, mtu=mtu)


class XdpSide:
    """A loaded dataplane with the job installed and the engine reading its ring."""

    def __init__(self, job, sink):
        from dataplane import loader
        from dataplane.maps import MODES, DataplaneMaps, JobInfo
        from dataplane.layout import touched_list_cap

        self.inst = f"benchdpu-{uuid.uuid4().hex[:6]}"
        pm = job.pmap
        owned = len(pm.owned_by(0))
        slots = job.slots_on(0)
        stride = min(job.partition_size, job.numel)
        self.info = JobInfo(job_id=JOB_ID, workers=job.workers, partition_size=job.partition_size,
                            numel=job.numel, num_partitions=pm.num_partitions, dpu_index=0, num_dpus=1,
                            num_owned=owned, mode=MODES[job.mode], pool_off=0, pstate_off=0, wstate_off=0,
                            scale_exp=job.scale_exp, port=wire.DEFAULT_PORT, stride=stride, slots=slots,
                            list_cap=touched_list_cap(stride))
        loader.load(self.inst, loader.LoadConfig(pool_buffers=2 * slots, pstate_slots=max(64, slots),
                                                 wstate_slots=max(1024, 2 * slots * job.workers),
                                                 ringbuf_pages=256))
        self.maps = DataplaneMaps.open(self.inst)
        self.prog = loader.open_prog(self.inst)
        self.maps.add_port(wire.DEFAULT_PORT)
        self.maps.clear_job_state(self.info)
        self.maps.put_job(self.info)
        for w, (a, p) in enumerate(job.hosts):
            self.maps.put_flow(JOB_ID, w, a, p)
        from dpu_fw.state import JobState

        self.ep, self.engine = _engine(sink)
        self.engine.set_ring(self.maps.ring(0), self.maps.settings, 0)
        self.state = JobState.in_maps(self.maps, job)
        self.engine.add_job(JOB_ID, self.info, *self.state.addresses(),
                            hosts=(np.zeros(1, np.uint32), np.zeros(1, np.uint16)), group=_group(sink))

    def floor_ns(self, n: int = 2000) -> float:
        """Median kernel time of a test run of a UDP packet to another port (the program passes
        it at its first checks): the harness's floor under every packet's time."""
        from dataplane import libbpf

        f = frame(0, b"x" * 64)
        f = f[:36] + struct.pack(">H", 9) + f[38:]  # another destination port
        return float(np.median([libbpf.prog_test_run_timed(self.prog, f)[1] for _ in range(n)]))

    def round(self, per_part, sink) -> dict:
        from dataplane import libbpf

        e = self.engine
        t = dict(settle=e.ns_settle, build=e.ns_build, send=e.ns_send, completions=e.completions)
        before = e.stats(JOB_ID)
        xdp_ns = npk = cpu = 0
        for frames in per_part:
            for f in frames:
                act, dur = libbpf.prog_test_run_timed(self.prog, f)
                xdp_ns += dur
                npk += 1
            c = time.thread_time_ns()
            e.step(0.0)
            cpu += time.thread_time_ns() - c
            sink.drain()
        after = e.stats(JOB_ID)
        part = _split(cpu, {"settle": e.ns_settle - t["settle"], "build": e.ns_build - t["build"],
                            "send": e.ns_send - t["send"]})
        return {"xdp_ns": xdp_ns, "packets": npk, "engine_cpu_ns": cpu,
                "settle_ns": part["settle"], "build_ns": part["build"],
                "send_ns": part["send"], "completions": e.completions - t["completions"],
                "settled": after["settled"] - before["settled"],
                "result_entries": after["result_entries"] - before["result_entries"],
                "result_packets": after["result_packets"] - before["result_packets"]}

    def close(self):
        from dataplane import loader

        os.close(self.prog)
        self.ep.close()
        self.maps.close()
        loader.unload(self.inst)


class SoftSide:
    """A userspace DPU worker's merge and engine for the job, fed the round's packets."""

    def __init__(self, job, sink):
        from dpu_fw._softmerge import SoftMerge
        from dpu_fw._completion import ENGINE_MAX_JOBS
        from dosa.counters import NUM_COUNTERS
        from dpu_fw.state import JobState

        self.ep, self.engine = _engine(sink)
        self.state = JobState.allocate(job, 0)
        self.engine.add_job(JOB_ID, self.state.info, *self.state.addresses(),
                            hosts=self._hosts(job), group=_group(sink))
        self.verdicts = np.zeros((ENGINE_MAX_JOBS + 1, NUM_COUNTERS), np.int64)
        self.soft = SoftMerge(self.engine, [self.ep.fd], self.ep.counters, self.verdicts)

    @staticmethod
    def _hosts(job):
        from dosa.net import addr_arrays

        return addr_arrays(job.hosts)

    def round(self, per_part, sink) -> dict:
        from dosa.net import addr_arrays

        ip, port = addr_arrays(HOSTS)
        e = self.engine
        t0 = e.ns_settle + e.ns_build + e.ns_send
        merge = entries = wall = 0
        for pk in per_part:
            stride = max(len(p) for _, p in pk)
            data = np.zeros((len(pk), stride), np.uint8)
            lengths = np.zeros(len(pk), np.int64)
            ws = np.array([w for w, _ in pk], np.int64)
            for i, (_, p) in enumerate(pk):
                data[i, :len(p)] = np.frombuffer(p, np.uint8)
                lengths[i] = len(p)
                entries += struct.unpack_from(">H", p, COUNT_AT)[0]
            t, w = time.thread_time_ns(), time.perf_counter_ns()
            v, _ = self.soft.merge_batch(data, lengths, ip[ws], port[ws])
            merge += time.thread_time_ns() - t
            wall += time.perf_counter_ns() - w
            sink.drain()
        engine = e.ns_settle + e.ns_build + e.ns_send - t0  # wall clock: its share of the CPU
        return {"merge_ns": merge * (1 - engine / max(wall, 1)), "entries": entries}

    def close(self):
        self.ep.close()


def run(numel: int = 25_000_000, density: float = 0.01, workers: int = 4, correlation: float = 0.5,
        mtu: int = wire.DEFAULT_MTU, repeat: int = 5, cpu: int | None = None, slots: int = 64,
        seed: int = 0, log=print) -> dict:
    from dataplane.loader import require_root
    from dosa.progress import progress

    require_root("dosa bench dpu")
    if not 1 <= workers <= wire.MAX_WORKERS or repeat < 1 or not 0 < density <= 1:
        raise DosaError("need 1..64 workers, at least one repetition and a density in (0, 1]")
    cpu = min(os.sched_getaffinity(0)) if cpu is None else cpu
    os.sched_setaffinity(0, {cpu})
    log(f"building a round: {workers} hosts' top-{density:g} of {numel:,} entries ...")
    entries, scale = make_round(numel, density, workers, correlation, seed)
    job = _job(numel, workers, mtu, slots)
    pmap = job.pmap
    ref = exact(entries, numel)
    sink = _Sink()
    xdp = soft = None
    reps = []
    try:
        xdp, soft = XdpSide(job, sink), SoftSide(job, sink)
        floor = xdp.floor_ns()
        bar = progress(repeat, "dosa bench dpu", unit="repetition", every=0)
        for r in range(repeat):
            per_part = packets(entries, scale, pmap, r, mtu)
            frames = [[frame(w, p) for w, p in pk] for pk in per_part]
            x = xdp.round(frames, sink)
            x["wrong_entries"] = sink.wrong(ref, r)
            u = soft.round(per_part, sink)
            u["wrong_entries"] = sink.wrong(ref, r)
            reps.append({"xdp": x, "userspace": u})
            bar.update(1, status=f"XDP {x['xdp_ns'] / max(1, sum(len(i) for i, _ in entries)):.1f} ns/entry")
        bar.close()
    finally:
        for side in (xdp, soft):
            if side is not None:
                side.close()
        sink.sock.close()
    nent = sum(len(i) for i, _ in entries)
    per = {
        "xdp_merge_ns_per_entry": [x["xdp"]["xdp_ns"] / nent for x in reps],
        "xdp_merge_ns_per_packet": [x["xdp"]["xdp_ns"] / x["xdp"]["packets"] for x in reps],
        "xdp_merge_ns_per_entry_net_of_floor": [(x["xdp"]["xdp_ns"] - floor * x["xdp"]["packets"]) / nent
                                                for x in reps],
        "completion_ns_per_result_entry": [(x["xdp"]["build_ns"] + x["xdp"]["send_ns"]) /
                                           max(1, x["xdp"]["result_entries"]) for x in reps],
        "completion_ns_per_partition": [(x["xdp"]["build_ns"] + x["xdp"]["send_ns"]) /
                                        max(1, x["xdp"]["completions"]) for x in reps],
        "build_ns_per_result_entry": [x["xdp"]["build_ns"] / max(1, x["xdp"]["result_entries"]) for x in reps],
        "send_ns_per_result_packet": [x["xdp"]["send_ns"] / max(1, x["xdp"]["result_packets"]) for x in reps],
        "settle_ns_per_partition": [x["xdp"]["settle_ns"] / max(1, x["xdp"]["completions"]) for x in reps],
        "userspace_merge_ns_per_entry": [x["userspace"]["merge_ns"] / max(1, x["userspace"]["entries"])
                                         for x in reps],
        "dpu_ms_per_round_xdp": [(x["xdp"]["xdp_ns"] + x["xdp"]["build_ns"] + x["xdp"]["send_ns"]
                                  + x["xdp"]["settle_ns"]) / 1e6 for x in reps],
    }
    res = {k: float(statistics.median(v)) for k, v in per.items()}
    res.update({
        "spread": {k: [float(min(v)), float(max(v))] for k, v in per.items()},
        "config": {"numel": numel, "density": density, "workers": workers, "correlation": correlation,
                   "mtu": mtu, "repeat": repeat, "cpu": cpu, "slots": slots,
                   "partitions": pmap.num_partitions, "packets_per_round": reps[0]["xdp"]["packets"],
                   "entries_per_round": nent, "result_entries_per_round": reps[0]["xdp"]["result_entries"],
                   "result_packets_per_round": reps[0]["xdp"]["result_packets"]},
        "test_run_floor_ns_per_packet": floor,
        "wrong_result_entries": sum(x["xdp"]["wrong_entries"] + x["userspace"]["wrong_entries"]
                                    for x in reps),
        "targets": TARGETS, "repetitions": reps,
    })
    return res


def format_table(r: dict) -> str:
    c = r["config"]
    lines = [f"dosa bench dpu: {c['workers']} hosts x top-{c['density']:g} of {c['numel']:,} entries "
             f"(correlation {c['correlation']}), MTU {c['mtu']}, {c['partitions']} partitions in "
             f"{c['slots']} slots, {c['packets_per_round']} packets / {c['entries_per_round']:,} entries "
             f"-> {c['result_entries_per_round']:,} result entries a round; CPU {c['cpu']}, "
             f"median of {c['repeat']} (min..max)",
             f"{'figure':40} {'median':>10} {'min':>9} {'max':>9} {'target':>8}"]
    for k in ("xdp_merge_ns_per_entry", "xdp_merge_ns_per_entry_net_of_floor", "xdp_merge_ns_per_packet",
              "completion_ns_per_result_entry", "build_ns_per_result_entry", "send_ns_per_result_packet",
              "completion_ns_per_partition", "settle_ns_per_partition", "userspace_merge_ns_per_entry",
              "dpu_ms_per_round_xdp"):
        lo, hi = r["spread"][k]
        t = r["targets"].get(k)
        lines.append(f"{k:40} {r[k]:10.2f} {lo:9.2f} {hi:9.2f} {'' if t is None else f'<= {t:g}':>8}")
    lines.append(f"test-run floor {r['test_run_floor_ns_per_packet']:.0f} ns a packet (included above); "
                 f"every result checked against the exact sums: {r['wrong_result_entries']} wrong")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(FIGURES)
    fig, ax = plt.subplots(figsize=(8, 4))
    med = [r[k] for k in keys]
    lo = [r[k] - r["spread"][k][0] for k in keys]
    hi = [r["spread"][k][1] - r[k] for k in keys]
    ax.bar(range(len(keys)), med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    for i, k in enumerate(keys):
        if k in r["targets"]:
            ax.hlines(r["targets"][k], i - 0.4, i + 0.4, colors="#c44e52", linestyles="--")
    ax.set_xticks(range(len(keys)), ["XDP merge\nns/entry", "completion\nns/result entry",
                                     "settle\nns/partition / 100", "userspace merge\nns/entry"])
    med[2] /= 100
    ax.patches[2].set_height(med[2])
    ax.set_ylabel("ns")
    c = r["config"]
    ax.set_title(f"dosa bench dpu: {c['numel']:,} entries, {c['workers']} hosts, density {c['density']:g} "
                 f"(dashed: targets)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p) -> None:
    p.add_argument("--numel", type=int, default=25_000_000, help="gradient entries (default 25M)")
    p.add_argument("--density", type=float, default=0.01, help="fraction each host sends (default 0.01)")
    p.add_argument("--workers", type=int, default=4, help="hosts of the job (default 4)")
    p.add_argument("--correlation", type=float, default=0.5, help="between hosts' gradients (default 0.5)")
    p.add_argument("--mtu", type=int, default=wire.DEFAULT_MTU)
    p.add_argument("--slots", type=int, default=64, help="aggregation slots of the job (default 64)")
    p.add_argument("--repeat", type=int, default=5, help="alternated repetitions (default 5)")
    p.add_argument("--cpu", type=int, help="the core to pin to (default: the lowest allowed)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw the figures")


def run_cli(args) -> int:
    r = run(args.numel, args.density, args.workers, args.correlation, args.mtu, args.repeat,
            args.cpu, args.slots)
    print(format_table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(r, args.plot)
        print(f"wrote {args.plot}")
    if r["wrong_result_entries"]:
        raise DosaError(f"{r['wrong_result_entries']} result entries were wrong or missing (see the table)")
    return 0


if __name__ == "__main__":
    sys.exit(0)
