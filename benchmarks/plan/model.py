"""One round of each method, predicted from unit costs (benchmarks.plan.costs) and a cluster's shape.

No measurement and no I/O here: every figure comes in as an argument, so the model can be read,
tested and argued with line by line. docs/performance.md (*Where dosa wins*) has the same equations
in prose. Times are seconds; a node's figures are per node (its ranks split the node's share).

**dosa** (``dosa_sum``, ``dosa_gtopk``): a node sends k = density x n entries (its L ranks one
interleaved slice each, docs/training.md) in partitions of ``partition_size``; the DPUs sum what
N nodes sent and return the union U of their indices (sum mode) or the k largest sums of each
partition (gtopk). A round is the encoder pass, then the network phase, whose stages are the
host's network work (a round's fixed cost; packetize, send, receive, take the results in; gtopk:
fold back what did not come back), the node's link out and in, the DPU's link and the DPU's cores
(merge per entry received, completion per result entry, settling per partition, a packet's kernel
path). The stages overlap across partitions, but only ``slots`` partitions of a DPU are in flight at
once, so a round holds ``waves`` = partitions / in-flight windows:
``network = max(stage) + (sum(stages) - max(stage)) / waves`` (a full pipeline
when the waves are many, the stages one after the other when there is one).

**ring allreduce** (what DDP does without a hook; NCCL or Gloo's ring): each node sends and
receives ``2 (N-1)/N x 4n`` bytes; with Gloo the host's CPU moves them (Gloo's cost a byte measured
on loopback, its TCP swapped for the path's) and adds ``(N-1)/N x n`` floats (in that cost);
the link and the CPU overlap (the ring pipelines chunks): ``round = max(link, cpu)`` plus a step
latency per ring step.

**sparse allgather** (DGC / Horovod's sparse path, with the encoder pass dosa's hook runs, so the
comparison is about the transport): each node sends its k (index, value) pairs (8 bytes each) to
every other node through a ring (``(N-1) x 8k`` bytes in and out), clears what the last round
wrote into its dense output and adds N x k entries into it; on the testbed the CPU and the link take turns (a Gloo allgather step waits
for its transfer), so ``round = encode + link + cpu``.

**Nodes of several ranks** (``ranks_per_node`` L > 1): a node's encoder and network work is split
over its L ranks (each its own core or GPU), and each bucket crosses the node's own interconnect
twice (reduce-scatter and all-gather, ``2 (L-1)/L x 4n`` bytes at ``intra_gbps``). The ring and the
allgather are taken hierarchical too (reduce inside the node first), so every method moves one
node's data over the node's one link.

**The testbed** (``Cluster.shared_host_cores``): every host's work runs on the same few cores, so
host work adds up over the nodes instead of running side by side; the DPU's link is not shaped.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dosa import wire
from dosa.job import ResultMode

METHODS = ("dosa_sum", "dosa_gtopk", "ring_allreduce", "sparse_allgather")
#: what can bound a round
BOUNDS = ("host", "link", "dpu_link", "dpu_cores", "intra_node")

#: The encoder pass on a GPU, ns an entry: 25M entries in 3.1-3.2 ms on a lent H200
#: (/work/shared/design/PLATFORM.md, *A lent GPU machine*; fp32 and bf16 alike).
GPU_ENCODE_NS_PER_ENTRY = 3.15e6 / 25e6
#: Dense work on a GPU (clearing and scattering into the output, adding), ns an entry: an
#: assumption, not measured here (no GPU in this session): HBM streams 4 bytes in ~1.3 ps at
#: ~3 TB/s, but a random scatter touches a 32-byte sector an entry, ~0.3 ns at that bandwidth.
GPU_DENSE_NS_PER_ENTRY = 0.3


@dataclass(frozen=True)
class Cluster:
    """The machines a round runs on."""

    nodes: int
    ranks_per_node: int = 1
    link_gbps: float = 100.0
    dpu_cores: int = 8
    dpus: int = 1
    mtu: int = wire.MAX_MTU
    #: the DPU's own link (None: the nodes' rate; math.inf: not a limit, as on the testbed)
    dpu_link_gbps: float | None = None
    #: how much slower a DPU core runs the DPU's per-unit work than the core the costs were
    #: measured on (1 on the testbed, whose DPU is this machine)
    dpu_slowdown: float = 1.0
    #: cores running the completion path (``dosa dpu run --workers N`` shards it over N)
    dpu_workers: int = 1
    #: None: every rank has its own core; an int: every host's work shares that many cores (the
    #: testbed's cpu split)
    shared_host_cores: int | None = None
    host_device: str = "cpu"  #: where the encoder runs: cpu (measured here) or cuda (PLATFORM.md)
    intra_gbps: float = 2400.0  #: a node's interconnect per rank (NVLink 4: ~300 GB/s a direction)
    step_latency_s: float = 10e-6  #: one message's latency across the fabric (a ring step)
    xdp: bool = True  #: the DPU merges in XDP (else its worker merges from a socket)


@dataclass(frozen=True)
class Workload:
    model: str
    numel: int
    density: float = 0.01
    #: |union of the nodes' top-k indices| / (nodes x k); None: nodes^-UNION_EXPONENT
    union_fraction: float | None = None
    partition_size: int = wire.DEFAULT_PARTITION_SIZE
    slots: int = 64  #: dosa.job.DEFAULT_SLOTS
    window: int = 256  #: a client's partitions in flight (host_lib.client)


#: The union of N nodes' top-k sets shrinks like N^-0.3 of N x k on the synthetic gradients of
#: ``dosa bench allreduce`` at correlation 0.5 (0.79 at 2 hosts, 0.65 at 4, 0.55 at 8; its
#: calibration found real MLP gradients in the same range: docs/performance.md *Method*).
UNION_EXPONENT = 0.3


@dataclass
class Prediction:
    method: str
    round_s: float
    bound: str
    parts: dict = field(default_factory=dict)  #: each stage's seconds and the traffic

    def as_dict(self) -> dict:
        return asdict(self)


def union_fraction(w: Workload, nodes: int) -> float:
    if w.union_fraction is not None:
        return w.union_fraction
    return nodes ** -UNION_EXPONENT


def _packets_and_bytes(entries_per_partition: float, partitions: int, psize: int, mtu: int) -> tuple[float, float]:
    """(packets, bytes on the wire) of ``partitions`` partitions of ``entries_per_partition``
    entries each: the cheaper of sparse and dense (wire.encoded_bytes), at least one packet each."""
    e = max(0, int(round(entries_per_partition)))
    sparse, dense = wire.encoded_bytes(e, psize, mtu)
    per_s = wire.entries_per_packet(wire.PacketType.SPARSE_DATA, mtu)
    per_d = wire.entries_per_packet(wire.PacketType.DENSE_DATA, mtu)
    if int(dense) < int(sparse):
        return partitions * -(-psize // per_d), partitions * float(dense)
    return partitions * max(1, -(-e // per_s)), partitions * float(sparse)


def _host_share(cluster: Cluster, per_rank_s: float) -> float:
    """A rank's host work as the round sees it: side by side on their own cores, or added up
    over every rank on the testbed's shared cores."""
    if cluster.shared_host_cores:
        ranks = cluster.nodes * cluster.ranks_per_node
        return per_rank_s * ranks / cluster.shared_host_cores
    return per_rank_s


def _encode_s(cluster: Cluster, host, entries: float) -> float:
    ns = GPU_ENCODE_NS_PER_ENTRY if cluster.host_device == "cuda" else host.encode_ns_per_entry
    return entries * ns * 1e-9


def _dense_ns(cluster: Cluster, cpu_ns: float) -> float:
    return GPU_DENSE_NS_PER_ENTRY if cluster.host_device == "cuda" else cpu_ns


def _intra_s(cluster: Cluster, numel: int) -> float:
    """Reduce-scatter and all-gather of the gradient inside a node (0 with one rank a node)."""
    L = cluster.ranks_per_node
    if L <= 1:
        return 0.0
    return 2 * (L - 1) / L * 4 * numel * 8 / (cluster.intra_gbps * 1e9)


def _rate_bps(gbps: float | None, default: float) -> float:
    g = default if gbps is None else gbps
    return math.inf if g is None or math.isinf(g) else g * 1e9


def predict_dosa(cluster: Cluster, w: Workload, costs, mode: str = "sum") -> Prediction:
    h, d, x = costs.host, costs.dpu, costs.path
    N, L, M = cluster.nodes, cluster.ranks_per_node, cluster.dpus
    n = w.numel
    k = max(1.0, w.density * n)  # a node's entries (over its L slices)
    P_job = math.ceil(n / L / w.partition_size)  # partitions of one slice job
    P = P_job * L
    psize = min(w.partition_size, math.ceil(n / L))
    U = min(float(n), N * k * union_fraction(w, N))
    res_entries = U if mode == ResultMode.SUM else min(U, P * math.ceil(w.density * psize))
    data_pk, out_b = _packets_and_bytes(k / P, P, psize, cluster.mtu)
    res_pk, in_b = _packets_and_bytes(res_entries / P, P, psize, cluster.mtu)
    # the host: the encoder pass and the network work, split over the node's ranks
    enc = _host_share(cluster, _encode_s(cluster, h, n / L))
    fold = k * h.fold_back_ns_per_sent_entry if mode == ResultMode.GTOPK else 0.0
    net = _host_share(cluster, (k * h.packetize_ns_per_entry + data_pk * x.udp_send_ns_per_packet
                                + res_pk * x.udp_recv_ns_per_packet
                                + res_entries * h.intake_ns_per_result_entry + fold) / L * 1e-9
                      + h.round_ns * 1e-9)  # each rank's round has its fixed cost
    intra = _intra_s(cluster, n)
    # the links: the node's, full duplex; the DPU's takes every node's data and sends each result
    # packet once (multicast: the fabric replicates it)
    link_bps = _rate_bps(cluster.link_gbps, None)
    dpu_bps = _rate_bps(cluster.dpu_link_gbps, cluster.link_gbps) * M
    link_out, link_in = out_b * 8 / link_bps, in_b * 8 / link_bps
    dpu_link = max(N * out_b, in_b) * 8 / dpu_bps
    # the DPU's cores: the merge spreads over every core (RSS queues), the completion path runs on
    # the worker cores; the kernel's work a frame in, and each host's copy of a result packet where
    # the DPU's core makes the multicast copies (the testbed's bridge does; a switch does not)
    merge_ns = d.xdp_merge_ns_per_entry if cluster.xdp else d.userspace_merge_ns_per_entry
    merge = (N * k * merge_ns + N * data_pk * x.dpu_rx_ns_per_packet) / M
    # (the completion figure includes sending the result packets: dosa bench dpu times build + send)
    complete = (U * d.completion_ns_per_result_entry + P * d.settle_ns_per_partition
                + res_pk * N * x.dpu_tx_ns_per_copy) / M
    s = cluster.dpu_slowdown * 1e-9
    cores, workers = cluster.dpu_cores, min(cluster.dpu_workers, cluster.dpu_cores)
    dpu = max((merge + complete) * s / cores, complete * s / workers)
    stages = {"host": net, "link_out": link_out, "link_in": link_in, "dpu_link": dpu_link,
              "dpu_cores": dpu}
    in_flight = min(P_job, w.window, w.slots * M)
    waves = P_job / in_flight
    top = max(stages.values())
    network = top + (sum(stages.values()) - top) / waves
    round_s = enc + intra + network + 2 * cluster.step_latency_s
    by = {"host": enc + (net if net == top else 0.0), "link": max(link_out, link_in),
          "dpu_link": dpu_link, "dpu_cores": dpu, "intra_node": intra}
    parts = {"encode_s": enc, "intra_node_s": intra, "network_s": network, "waves": waves,
             **{f"{k_}_s": v for k_, v in stages.items()},
             "bytes_out_per_node": out_b, "bytes_in_per_node": in_b, "packets_out_per_node": data_pk,
             "packets_in_per_node": res_pk, "entries_per_node": k, "result_entries": res_entries,
             "partitions": P}
    return Prediction(f"dosa_{mode}", round_s, max(by, key=by.get), parts)


def predict_ring(cluster: Cluster, w: Workload, costs) -> Prediction:
    h, x = costs.host, costs.path
    N, n = cluster.nodes, w.numel
    B = 2 * (N - 1) / N * 4 * n  # bytes each way per node
    link = B * 8 / _rate_bps(cluster.link_gbps, None)
    if cluster.host_device == "cuda":  # NCCL: the GPU reduces, the NIC moves the bytes
        cpu = (N - 1) / N * n * GPU_DENSE_NS_PER_ENTRY * 1e-9
    else:  # Gloo's own cost a byte (its copies and additions), its loopback TCP swapped for the path's
        per_byte = h.gloo_ring_ns_per_byte + x.tcp_ns_per_byte - h.tcp_loopback_ns_per_byte
        cpu = _host_share(cluster, B * per_byte / cluster.ranks_per_node * 1e-9)
    intra = _intra_s(cluster, n)
    round_s = max(link, cpu) + intra + 2 * (N - 1) * cluster.step_latency_s
    by = {"link": link, "host": cpu, "intra_node": intra}
    return Prediction("ring_allreduce", round_s, max(by, key=by.get),
                      {"link_s": link, "host_s": cpu, "intra_node_s": intra, "bytes_each_way_per_node": B})


def predict_allgather(cluster: Cluster, w: Workload, costs) -> Prediction:
    h, x = costs.host, costs.path
    N, L, n = cluster.nodes, cluster.ranks_per_node, w.numel
    k = max(1.0, w.density * n)
    B = (N - 1) * (8 * k + 8)  # bytes each way per node: every other node's (index, value) pairs
    link = B * 8 / _rate_bps(cluster.link_gbps, None)
    enc = _host_share(cluster, _encode_s(cluster, h, n / L))
    dense = N * k * (_dense_ns(cluster, h.clear_ns_per_entry) + _dense_ns(cluster, h.scatter_add_ns_per_entry))
    per_byte = (h.gloo_allgather_ns_per_byte + x.tcp_ns_per_byte - h.tcp_loopback_ns_per_byte
                if cluster.host_device != "cuda" else 0.0)
    cpu = _host_share(cluster, (B * per_byte + dense) / L * 1e-9)
    intra = _intra_s(cluster, n)
    round_s = enc + intra + link + cpu + 2 * (N - 1) * cluster.step_latency_s
    by = {"host": enc + cpu, "link": link, "intra_node": intra}
    return Prediction("sparse_allgather", round_s, max(by, key=by.get),
                      {"encode_s": enc, "link_s": link, "host_s": cpu, "intra_node_s": intra,
                       "bytes_each_way_per_node": B})


def predict(method: str, cluster: Cluster, w: Workload, costs) -> Prediction:
    if method == "dosa_sum":
        return predict_dosa(cluster, w, costs, "sum")
    if method == "dosa_gtopk":
        return predict_dosa(cluster, w, costs, ResultMode.GTOPK)
    if method == "ring_allreduce":
        return predict_ring(cluster, w, costs)
    if method == "sparse_allgather":
        return predict_allgather(cluster, w, costs)
    raise ValueError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
