"""How a job's index space is cut into partitions owned by DPUs (:class:`PartitionMap`), and many
packets in one buffer (:class:`PacketBatch`: what the packetizer builds and the batched socket
calls send and receive). Part of :mod:`dosa.wire`, which re-exports every name here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dosa.wire_format import (DEFAULT_MTU, HDR_LEN, HEADER_DTYPE, MAX_PARTITION_SIZE, MAX_PARTITIONS,
                              ProtocolError, stride_for_mtu)

DEFAULT_PARTITION_SIZE = 1 << 16


@dataclass(frozen=True)
class PartitionMap:
    """Cuts [0, numel) into contiguous partitions of ``partition_size`` indices (the last may be
    shorter) and assigns partition p to DPU ``p % num_dpus`` (round robin balances load when
    gradients are denser in some layers than others)."""

    numel: int
    partition_size: int = DEFAULT_PARTITION_SIZE
    num_dpus: int = 1

    def __post_init__(self):
        if self.numel < 1:
            raise ValueError(f"numel must be at least 1, got {self.numel}")
        if self.partition_size < 1:
            raise ValueError(f"partition_size must be at least 1, got {self.partition_size}")
        if self.num_dpus < 1:
            raise ValueError(f"num_dpus must be at least 1, got {self.num_dpus}")
        if self.partition_size > MAX_PARTITION_SIZE:
            raise ValueError(f"partition_size {self.partition_size} over {MAX_PARTITION_SIZE}: sparse "
                             "offsets in a partition are u16")
        if self.num_partitions > MAX_PARTITIONS:
            raise ValueError(
                f"{self.numel} entries in partitions of {self.partition_size} make "
                f"{self.num_partitions} partitions, more than the protocol's {MAX_PARTITIONS}")
        if self.numel > 2**32:
            raise ValueError("numel must fit a u32 index")

    @property
    def num_partitions(self) -> int:
        return -(-self.numel // self.partition_size)

    def bounds(self, p: int) -> tuple[int, int]:
        if not 0 <= p < self.num_partitions:
            raise ValueError(f"partition {p} outside 0..{self.num_partitions - 1}")
        lo = p * self.partition_size
        return lo, min(lo + self.partition_size, self.numel)

    def owner(self, p: int | np.ndarray):
        return p % self.num_dpus

    def owned_by(self, dpu: int) -> np.ndarray:
        return np.arange(dpu, self.num_partitions, self.num_dpus)

    def partition_of(self, index):
        return np.asarray(index) // self.partition_size


# --------------------------------------------------------------------------------------------------
# Many packets in one buffer
# --------------------------------------------------------------------------------------------------
STRIDE = stride_for_mtu(DEFAULT_MTU)  # 1472 = 46 x 32: every packet slot starts 32-byte aligned


@dataclass
class PacketBatch:
    """Packets in one contiguous buffer: packet i is ``data[i, :lengths[i]]``.

    A fixed stride (one MTU-sized slot per packet) makes building vectorized (a 2-D numpy view)
    and maps one-to-one onto the iovecs of sendmmsg/recvmmsg. ``dest`` says where each packet goes:
    the owning DPU's index for data packets, the host's rank for results (-1 = every host).
    """

    data: np.ndarray  # uint8, shape (n, stride), C-contiguous; stride = stride_for_mtu(job's MTU)
    lengths: np.ndarray  # int64, shape (n,)
    dest: np.ndarray  # int64, shape (n,)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def stride(self) -> int:
        return self.data.shape[1]

    @classmethod
    def empty(cls, n: int, stride: int = STRIDE) -> "PacketBatch":
        if stride % HDR_LEN or stride < HDR_LEN:
            raise ValueError(f"stride {stride} must be a positive multiple of {HDR_LEN}")
        return cls(np.zeros((n, stride), np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64))

    @classmethod
    def from_packets(cls, packets: list[bytes], dest=None, stride: int | None = None) -> "PacketBatch":
        longest = max((len(p) for p in packets), default=0)
        if stride is None:
            stride = max(STRIDE, -(-longest // HDR_LEN) * HDR_LEN)
        b = cls.empty(len(packets), stride)
        for i, p in enumerate(packets):
            if len(p) > stride:
                raise ProtocolError(f"packet {i} has {len(p)} bytes, more than the {stride}-byte slot")
            b.data[i, : len(p)] = np.frombuffer(p, np.uint8)
            b.lengths[i] = len(p)
        if dest is not None:
            b.dest[:] = dest
        return b

    def packet(self, i: int) -> bytes:
        return self.data[i, : self.lengths[i]].tobytes()

    def headers(self) -> np.ndarray:
        """All headers as one structured array (a copy), vectorized."""
        return np.ascontiguousarray(self.data[:, :HDR_LEN]).view(HEADER_DTYPE).reshape(-1)

    def select(self, mask) -> "PacketBatch":
        return PacketBatch(self.data[mask], self.lengths[mask], self.dest[mask])
