"""The unit costs ``dosa plan`` builds a round from: what one entry, packet or byte costs a host core
and a DPU core.

* **Host side** (:func:`measure_host`): measured by the command itself on this machine, each step
  alone on synthetic data, median of a few runs, thread CPU time (steadier than wall time on a
  shared machine): the fused encoder pass (``r += g``, select, quantize) per gradient entry;
  packetize per sent entry; the result intake (decode, then write the dense output and clear the
  previous round's entries) per result entry; gtopk's fold-back (what was sent and did not come
  back, found and added to the residual) per sent entry; a round's fixed cost (a one-partition
  round against a userspace DPU worker on loopback, CPU a round); a float add (the ring's reduction); the allgather's
  local sum as its baseline makes it (the last round's entries cleared, each host's rows added);
  a byte of Gloo's ring allreduce and allgather (two ranks on loopback: TCP, Gloo's copies, the
  additions), and of loopback TCP alone, so that a path's TCP can replace it. The encoder's
  buffers rotate, with a fresh gradient each time, as a training step hands them over: a pass over
  arrays still in cache would be cheaper than a round's.
* **The path** (:class:`PathCosts`): what a packet or a byte costs the kernel on its way. For a
  cluster (:func:`measure_loopback_path`): a UDP GSO send and a GRO receive per packet and a TCP
  byte, on loopback (the kernel's own cost, no device), a DPU's frame received by XDP on a NIC and
  its multicast replicated by the switch (cited, not measured here). For the testbed
  (benchmarks.plan.testbed_path, root): the same, measured through the testbed's veths and bridge,
  where the fabric's work (segmenting before the DPU's XDP, the bridge's multicast copies) runs on
  the sending core.
* **DPU side** (:func:`load_dpu`): ``dosa bench dpu --json F``'s medians
  (``xdp_merge_ns_per_entry``, ``completion_ns_per_result_entry``, ``settle_ns_per_partition``,
  ``userspace_merge_ns_per_entry``), from ``--costs F``, else the checked-in
  ``docs/performance_dpu.json`` when there is one, else :data:`FALLBACK_DPU`: the figures the docs
  give today, each with where it comes from, labelled as a fallback in every output.
"""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dosa import wire
from dosa.errors import DosaError

REPO = Path(__file__).resolve().parents[2]
#: where a checked-in ``dosa bench dpu --json`` lives (read when --costs is not given)
DEFAULT_DPU_COSTS = REPO / "docs" / "performance_dpu.json"
DPU_KEYS = ("xdp_merge_ns_per_entry", "completion_ns_per_result_entry", "settle_ns_per_partition",
            "userspace_merge_ns_per_entry")

#: Today's DPU figures from the docs, used until ``dosa bench dpu`` has measured them (its JSON
#: replaces all four): value in ns, and the source.
FALLBACK_DPU = {
    "xdp_merge_ns_per_entry": (20.0, "docs/dpu_worker.md and issue 21: the XDP merge ~20 ns an entry "
                                     "(~22 ms a round for ~1M entries, bpftool run time)"),
    "completion_ns_per_result_entry": (45.0, "ARCHITECTURE.md / issue 21: the completion path ~45 ns "
                                             "a result entry, half of it interpreter glue"),
    "settle_ns_per_partition": (17_000.0, "docs/dpu_worker.md: settling is 11 % of the worker's "
                                          "~60 ms a round over 382 partitions = ~17 us a partition"),
    "userspace_merge_ns_per_entry": (20.7, "docs/dataplane.md: the Cython scatter-add, 48.2 M "
                                           "entries/s in cache"),
}


@dataclass
class HostCosts:
    """ns per unit, on one host core of this machine (see the module doc)."""

    encode_ns_per_entry: float
    packetize_ns_per_entry: float
    intake_ns_per_result_entry: float
    fold_back_ns_per_sent_entry: float  #: gtopk: finding what did not come back, adding it to the residual
    #: a round's fixed host CPU, whatever its size: the call, the round's set-up and teardown, its
    #: first and last packets (a one-partition round against a userspace DPU worker on loopback)
    round_ns: float
    add_ns_per_entry: float
    scatter_add_ns_per_entry: float  #: one (int32 index, value) added into the dense output
    clear_ns_per_entry: float  #: one entry of the last round's output zeroed again
    #: a rank's CPU a byte it sends (and one it receives) in Gloo's ring allreduce / allgather on
    #: loopback: TCP, Gloo's copies and (the ring) its additions
    gloo_ring_ns_per_byte: float
    gloo_allgather_ns_per_byte: float
    tcp_loopback_ns_per_byte: float  #: what of those is loopback TCP (a path's own TCP replaces it)
    measured: dict = field(default_factory=dict)  #: how: sizes, repeats, the machine


#: A DPU's frame through XDP on a NIC driver, ns: XDP_DROP ran at ~24 Mpps on one core of a
#: ConnectX-5 (mlx5) in Høiland-Jørgensen et al., "The eXpress Data Path", CoNEXT 2018 (~42 ns a
#: frame); not measured here (no NIC).
NIC_XDP_RX_NS_PER_PACKET = 42.0


@dataclass
class PathCosts:
    """ns a packet or a byte costs the CPUs on its way (module doc)."""

    udp_send_ns_per_packet: float  #: a host's GSO send, the fabric's work on the sending core included
    udp_recv_ns_per_packet: float  #: a host's GRO receive of a result packet
    tcp_ns_per_byte: float  #: one byte through a TCP connection: both ends' CPU
    #: a data frame's kernel path to the DPU's XDP program (the testbed: measured as a UDP socket's
    #: receive of single frames, which also walks the IP and socket layers: an upper bound)
    dpu_rx_ns_per_packet: float
    #: each host's copy of a multicast result made on the DPU's core (0 where a switch makes them;
    #: the send itself is in dosa bench dpu's completion figure)
    dpu_tx_ns_per_copy: float
    source: str = ""
    measured: dict = field(default_factory=dict)


@dataclass
class DpuCosts:
    """ns per unit on one DPU core of the machine they were measured on."""

    xdp_merge_ns_per_entry: float
    completion_ns_per_result_entry: float
    settle_ns_per_partition: float
    userspace_merge_ns_per_entry: float
    source: str  #: the file, or "fallback"
    notes: dict = field(default_factory=dict)  #: per figure: where it comes from


@dataclass
class Costs:
    host: HostCosts
    dpu: DpuCosts
    path: PathCosts

    def as_dict(self) -> dict:
        return {"host": asdict(self.host), "dpu": asdict(self.dpu), "path": asdict(self.path)}

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(HostCosts(**d["host"]), DpuCosts(**d["dpu"]), PathCosts(**d["path"]))

    def on(self, path: PathCosts) -> "Costs":
        """The same host and DPU costs over another path (the testbed's)."""
        return Costs(self.host, self.dpu, path)


def load_dpu(path: str | None) -> DpuCosts:
    """The DPU's costs: ``path`` (``dosa bench dpu --json``), else docs/performance_dpu.json when
    present, else the fallback. A file without one of the four figures is a DosaError sentence."""
    p = Path(path) if path else (DEFAULT_DPU_COSTS if DEFAULT_DPU_COSTS.exists() else None)
    if p is None:
        return DpuCosts(**{k: v for k, (v, _) in FALLBACK_DPU.items()}, source="fallback",
                        notes={k: why for k, (_, why) in FALLBACK_DPU.items()})
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise DosaError(f"cannot read the DPU costs {p}: {e.strerror}") from None
    except ValueError as e:
        raise DosaError(f"the DPU costs {p} are not JSON: {e}") from None
    missing = [k for k in DPU_KEYS if not isinstance(d.get(k), (int, float))]
    if missing:
        raise DosaError(f"the DPU costs {p} lack {', '.join(missing)} (dosa bench dpu --json writes them)")
    return DpuCosts(**{k: float(d[k]) for k in DPU_KEYS}, source=str(p),
                    notes={k: "dosa bench dpu (median)" for k in DPU_KEYS})


# ---------------------------------------------------------------------------- host measurements

def _cpu_ns(fn, units: float, repeat: int) -> float:
    """Median thread CPU ns per unit of ``fn()`` over ``repeat`` runs (one warm-up first)."""
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        fn()
        out.append((time.thread_time_ns() - t0) / max(units, 1))
    return float(statistics.median(out))


def _udp_costs(mtu: int, packets: int = 20_000) -> tuple[float, float]:
    """(send, receive) thread CPU ns per packet of UDP GSO sends and GRO receives on loopback, at
    ``mtu``'s largest dosa packet. On loopback the kernel's delivery into the receiving socket runs
    in the send call, as it does on the testbed's veth pairs."""
    seg = wire.max_udp_payload(mtu)
    per = min(64, 65507 // seg)  # segments a GSO datagram: dosa's bound, and a UDP datagram's
    payload = b"\0" * (seg * per)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 25)
        rx.bind(("127.0.0.1", 0))
        try:
            rx.setsockopt(socket.IPPROTO_UDP, 104, 1)  # UDP_GRO
            tx.setsockopt(socket.IPPROTO_UDP, 103, seg)  # UDP_SEGMENT
        except OSError:
            payload, per = payload[:seg], 1  # no GSO here: one packet a datagram
        dest = rx.getsockname()
        buf = bytearray(len(payload) + 4096)
        rx.settimeout(1.0)
        sends, recvs = [], []
        for _ in range(3):
            s = r = 0
            n = 0
            while n < packets:
                t0 = time.thread_time_ns()
                tx.sendto(payload, dest)
                t1 = time.thread_time_ns()
                got = 0
                while got < len(payload):
                    got += rx.recv_into(buf)
                r += time.thread_time_ns() - t1
                s += t1 - t0
                n += per
            sends.append(s / n)
            recvs.append(r / n)
        return float(statistics.median(sends)), float(statistics.median(recvs))
    finally:
        rx.close()
        tx.close()


def _tcp_ns_per_byte(total: int = 200 << 20, chunk: int = 1 << 20) -> float:
    """Process CPU ns per byte through a loopback TCP connection (sent by one thread, received by
    another): what a byte of Gloo's traffic costs the two ends together."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    data = b"\0" * chunk

    def recv_all():
        view = bytearray(chunk)
        left = total
        while left > 0:
            n = b.recv_into(view)
            if not n:
                return
            left -= n

    try:
        out = []
        for _ in range(3):
            t = threading.Thread(target=recv_all)
            c0 = time.process_time_ns()
            t.start()
            for _ in range(total // chunk):
                a.sendall(data)
            t.join()
            out.append((time.process_time_ns() - c0) / total)
        return float(statistics.median(out))
    finally:
        a.close()
        b.close()


def measure_host(numel: int = 8_000_000, density: float = 0.01, mtu: int = wire.MAX_MTU,
                 repeat: int = 5, say=None) -> HostCosts:
    """The host costs on this machine (module doc): a few seconds."""
    import torch

    from benchmarks.host import synthetic_gradient
    from dosa.packetizer import packetize, parse_batch
    from host_lib.compress import topk_fast, target_k
    from host_lib.encoder import RoundEncoder
    from host_lib.quantize import choose_scale_exp, quantize

    say = say or (lambda m: None)
    torch.set_num_threads(1)
    g = synthetic_gradient(numel, 0)
    k = target_k(numel, density)
    say(f"encoder pass over {numel} entries")
    encs = [RoundEncoder(numel, density, 4, method="fast", seed=i) for i in range(4)]
    grads = [torch.from_numpy(g.copy()) for _ in encs]
    src = torch.from_numpy(g)
    times = []
    for i in range(repeat * len(encs) + 1):
        e, gt = encs[i % len(encs)], grads[i % len(encs)]
        gt.copy_(src)  # a fresh gradient, as backward writes it
        t0 = time.thread_time_ns()
        e.encode(gt, 20)
        if i:
            times.append((time.thread_time_ns() - t0) / numel)
    encode = float(statistics.median(times))
    # gtopk: what this host sent and the DPU did not return goes back into the residual
    sent = encs[0].encode(grads[0], 20)
    rng = np.random.default_rng(4)
    keep = np.sort(rng.choice(len(sent), len(sent) // 3, replace=False))
    res_idx = np.union1d(sent.indices[keep], rng.choice(numel, len(sent), replace=False).astype(np.uint32))
    res_idx = res_idx.astype(np.uint32)
    fold = _cpu_ns(lambda: encs[0].fold_back(*encs[0].unapplied(sent, res_idx), 20), len(sent), repeat)
    del encs, grads
    idx, vals = topk_fast(g, k, rng=np.random.default_rng(1))
    s = choose_scale_exp(float(np.abs(vals).max()), 4)
    q, _ = quantize(vals, s, 4)
    pmap = wire.PartitionMap(numel, num_dpus=1)
    say(f"packetize / intake of {len(idx)} entries")
    pk = _cpu_ns(lambda: packetize(idx, q, pmap, job_id=1, worker_id=0, round=0, scale_exp=s, mtu=mtu),
                 len(idx), repeat)
    batch = packetize(idx, q, pmap, job_id=1, worker_id=0, round=0, scale_exp=s, mtu=mtu)
    dense = np.zeros(numel, np.float32)
    prev = np.sort(np.random.default_rng(2).choice(numel, len(idx), replace=False)).astype(np.int64)

    def intake():
        p = parse_batch(batch)
        dense[prev] = 0.0
        dense[p.indices] = np.ldexp(p.values.astype(np.float32), -s)

    intake_ns = _cpu_ns(intake, len(idx), repeat)
    a, b = np.ones(numel, np.float32), np.ones(numel, np.float32)
    add = _cpu_ns(lambda: np.add(a, b, out=a), numel, repeat)
    # the allgather's local sum, as benchmarks/allreduce's baseline makes it: clear what the last
    # round wrote, then add each host's (int32 index, value) rows into the dense output
    hosts = 4
    rows = [np.sort(np.random.default_rng(3 + r).choice(numel, k, replace=False)).astype(np.int32)
            for r in range(hosts)]
    vals = np.ones(k, np.float32)
    clear = _cpu_ns(lambda: [a.__setitem__(r, 0.0) for r in rows], hosts * k, repeat)

    def scatter():
        for r in rows:
            a[r] += vals

    scatter_ns = _cpu_ns(scatter, hosts * k, repeat)
    say("a round's fixed cost (one partition, a userspace DPU worker on loopback)")
    round_ns = measure_round_overhead()
    say("Gloo's ring allreduce and allgather, two ranks on loopback")
    ring_b, ag_b = measure_gloo()
    tcp_loop = _tcp_ns_per_byte()
    return HostCosts(encode, pk, intake_ns, fold, round_ns, add, scatter_ns, clear, ring_b, ag_b, tcp_loop,
                     measured={"numel": numel, "density": density, "mtu": mtu, "repeat": repeat,
                               "how": "thread CPU time, median; loopback sockets; one core",
                               "when": time.strftime("%Y-%m-%d %H:%M:%S")})


def measure_loopback_path(mtu: int = wire.MAX_MTU, say=None) -> PathCosts:
    """A cluster's path: the kernel's UDP and TCP costs on loopback (no device, no fabric), a DPU's
    frame through XDP on a NIC (:data:`NIC_XDP_RX_NS_PER_PACKET`, cited), its result sends as a
    host's, their multicast copies made by the switch."""
    say = say or (lambda m: None)
    say("UDP GSO send / GRO receive on loopback")
    send, recv = _udp_costs(mtu)
    say("TCP bytes on loopback")
    tcp = _tcp_ns_per_byte()
    return PathCosts(send, recv, tcp, NIC_XDP_RX_NS_PER_PACKET, 0.0,
                     source="loopback (measured) + a NIC's XDP frame (cited)",
                     measured={"mtu": mtu, "when": time.strftime("%Y-%m-%d %H:%M:%S")})


def measure_gloo(numel: int = 4_000_000, world: int = 2, rounds: int = 5) -> tuple[float, float]:
    """(ring allreduce, allgather) CPU ns a rank pays a byte it sends, two Gloo ranks on loopback
    (benchmarks.plan.gloo_probe), the median of ``rounds``, averaged over the ranks."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.plan.gloo_probe", str(r), str(world),
                               str(port), str(numel), str(rounds)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                raise DosaError(f"measuring Gloo on loopback failed: {err.strip()[-300:]}")
            outs.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ring_bytes = 2 * (world - 1) / world * 4 * numel
    ag_bytes = (world - 1) * 4 * (numel // world)
    ring = statistics.mean(o["ring_cpu_s"] for o in outs) / ring_bytes * 1e9
    ag = statistics.mean(o["allgather_cpu_s"] for o in outs) / ag_bytes * 1e9
    return ring, ag


def median_host(runs: list[HostCosts]) -> HostCosts:
    """Field by field, the median of several measurements (the validation takes one before each
    bench run: the machine's load moves them)."""
    if len(runs) == 1:
        return runs[0]
    fields = [f for f in asdict(runs[0]) if f != "measured"]
    vals = {f: float(statistics.median(getattr(r, f) for r in runs)) for f in fields}
    return HostCosts(**vals, measured={**runs[0].measured, "runs": len(runs),
                                       "how": runs[0].measured.get("how", "") + "; median of the runs"})


def measure_round_overhead(rounds: int = 40, partitions: int = 1) -> float:
    """Median thread CPU ns of one dosa round that carries almost nothing (one partition of 1024
    entries, 10 of them sent) against a userspace DPU worker on loopback: what a round costs a
    host before its entries and packets do."""
    import subprocess
    import sys
    import tempfile

    from dosa.job import JobConfig
    from host_lib.client import AggregationClient

    def port(kind=socket.SOCK_DGRAM) -> int:
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    with tempfile.TemporaryDirectory(prefix="dosa-plan-round-") as tmp:
        dport = port()
        job = JobConfig(job_id=4242, numel=1024 * partitions, hosts=[("127.0.0.1", port())], dpus=[("127.0.0.1", dport)],
                        partition_size=1024, scale_exp=20)
        cfg, ready = Path(tmp) / "job.json", Path(tmp) / "dpu.ready"
        cfg.write_text(json.dumps(job.to_dict()))
        dpu = subprocess.Popen([sys.executable, "-m", "dosa", "dpu", "run", "--mode", "userspace", "--job-config",
                                str(cfg), "--addr", "127.0.0.1", "--port", str(dport), "--pid-file", str(ready)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            end = time.monotonic() + 60
            while not ready.exists():
                if dpu.poll() is not None or time.monotonic() > end:
                    raise DosaError("measuring a round's fixed cost: the userspace DPU worker did not start: "
                                    + (dpu.stderr.read().decode(errors="replace").strip()[-300:] if dpu.poll() is not None else "timeout"))
                time.sleep(0.05)
            idx = (np.arange(0, 1000, 100, dtype=np.uint32)[None, :]
                   + 1024 * np.arange(partitions, dtype=np.uint32)[:, None]).reshape(-1)
            q = np.ones(len(idx), np.int32)
            out = []
            with AggregationClient(job, worker_id=0, timeout=10) as c:
                for i in range(rounds + 3):
                    t0 = time.thread_time_ns()
                    c.allreduce_sparse(idx, q, 20)
                    if i >= 3:
                        out.append(time.thread_time_ns() - t0)
            return float(statistics.median(out))
        finally:
            dpu.terminate()
            try:
                dpu.wait(timeout=5)
            except subprocess.TimeoutExpired:
                dpu.kill()
                dpu.wait()
