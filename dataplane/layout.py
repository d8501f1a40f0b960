"""The layouts of the structs in dataplane/dosa_state.h (the maps' keys and values): one ctypes table
per struct, and everything else derived from it (the numpy views of the mmapable arrays, the ring
buffer record decoding, JobInfo's struct conversion in dataplane/maps.py).

tests/dataplane/test_layout.py compares each table against the struct BCC compiled, field by field.
Constants the C side shares with user space are defined here and given to the compiler by
``c_defines()`` (the loader puts them before the program text, like the counter enum).
"""
from __future__ import annotations

import ctypes

import numpy as np

from dosa import wire

#: pstate.scale_tag = scale_exp + SCALE_TAG_BIAS: never 0 for a valid scale, so 0 means "unset"
SCALE_TAG_BIAS = 256
#: s32 sums of one aggregation buffer: the largest partition the wire allows (u16 offsets)
BUF_SUMS = wire.MAX_PARTITION_SIZE
#: u16 offsets one buffer's touched list holds: a quarter of its sums (control.alloc.touched_list_cap
#: of a full partition), 4 to a u64 word
LIST_CAP = BUF_SUMS // 4
LIST_WORDS = LIST_CAP // 4
#: completion rings (dosa_xdp.c completions0..): at most this many DPU worker shards per dataplane
MAX_SHARDS = 8
#: the saturation bound of a sum (the DPU worker always saturated at it): +-(2^31 - 1)
SUM_LIMIT = 2**31 - 1
#: pstate.touched of a completed buffer, as the DPU worker marks it (dpu_fw/_shadow.pyx): the
#: list is being overwritten (WRITING), the list area holds the offsets of the buffer's non-zero
#: sums sorted (SORTED, their count in the low 32 bits), or the result compacted (COMPACT, offsets
#: then values, the count in the low 32 bits), its sums zeroed already (ZEROED). XDP never sees
#: them: it writes the count only while it merges, before the completion.
TOUCHED_SORTED = 1 << 60
TOUCHED_WRITING = 1 << 61
TOUCHED_COMPACT = 1 << 62
TOUCHED_ZEROED = 1 << 63


class Job(ctypes.Structure):
    _fields_ = [("workers", ctypes.c_uint32), ("partition_size", ctypes.c_uint32),
                ("numel", ctypes.c_uint32), ("num_partitions", ctypes.c_uint32),
                ("dpu_index", ctypes.c_uint32), ("num_dpus", ctypes.c_uint32),
                ("num_owned", ctypes.c_uint32), ("mode", ctypes.c_uint32),
                ("pool_off", ctypes.c_uint32), ("pstate_off", ctypes.c_uint32),
                ("wstate_off", ctypes.c_uint32), ("scale_exp", ctypes.c_int32),
                ("port", ctypes.c_uint32), ("stride", ctypes.c_uint32), ("slots", ctypes.c_uint32),
                ("list_cap", ctypes.c_uint32)]


class FlowKey(ctypes.Structure):
    _fields_ = [("job_id", ctypes.c_uint32), ("worker_id", ctypes.c_uint32)]


class Flow(ctypes.Structure):
    # saddr and sport are in network byte order, as the packet carries them
    _fields_ = [("saddr", ctypes.c_uint32), ("sport", ctypes.c_uint16), ("reserved", ctypes.c_uint16)]


class PState(ctypes.Structure):
    _fields_ = [("base_gen", ctypes.c_uint64),
                ("workers_done", ctypes.c_uint64 * 2), ("scale_tag", ctypes.c_uint64 * 2),
                ("touched", ctypes.c_uint64 * 2)]


class WState(ctypes.Structure):
    _fields_ = [("seen", ctypes.c_uint64 * 4), ("received", ctypes.c_uint64),
                ("total", ctypes.c_uint64)]


class Buf(ctypes.Structure):
    _fields_ = [("sums", ctypes.c_int32 * BUF_SUMS), ("list", ctypes.c_uint64 * LIST_WORDS)]


class Settings(ctypes.Structure):
    _fields_ = [("shards", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("asleep", ctypes.c_uint64 * MAX_SHARDS)]


class Completion_(ctypes.Structure):
    _fields_ = [("job_id", ctypes.c_uint32), ("round", ctypes.c_uint32),
                ("partition", ctypes.c_uint16), ("scale_exp", ctypes.c_int8),
                ("reserved", ctypes.c_uint8), ("reserved2", ctypes.c_uint32)]


U32 = ctypes.c_uint32

#: numpy views of the mmapable state arrays and of ring buffer records, from the ctypes tables
#: (element stride = struct size, a multiple of 8)
PSTATE_DTYPE = np.dtype(PState)
WSTATE_DTYPE = np.dtype(WState)
COMPLETION_DTYPE = np.dtype(Completion_)
BUF_DTYPE = np.dtype(Buf)
SETTINGS_DTYPE = np.dtype(Settings)
#: bytes of one struct dosa_lock (a bpf_spin_lock padded to a cache line)
LOCK_SIZE = 64
assert PSTATE_DTYPE.itemsize == 56 and WSTATE_DTYPE.itemsize == 48 and COMPLETION_DTYPE.itemsize == 16
assert BUF_DTYPE.itemsize == 4 * BUF_SUMS + 8 * LIST_WORDS and BUF_DTYPE.itemsize % 4096 == 0


def touched_list_cap(stride: int) -> int:
    """Touched-list capacity of a buffer of ``stride`` sums: a quarter of them, rounded down to a
    multiple of 4 (the list is copied 4 u16 offsets a word); every buffer has room for the list of
    a full partition (LIST_CAP). Up to 25 % density the DPU worker reads only the listed sums;
    above, the list overflows and it scans the buffer, which then costs no more per non-zero than
    the list would. 0 (no lists) for buffers under 16 sums."""
    return (stride // 4) & ~3


def c_header() -> str:
    """The text of dataplane/dosa_layout.h (``python -m dataplane.gen_headers``): the constants
    above that the C side (dosa_state.h, the XDP program, the DPU worker's compiled code) shares."""
    defines = "".join(f"#define DOSA_{name} {value}\n" for name, value in (
        ("SCALE_TAG_BIAS", SCALE_TAG_BIAS), ("BUF_SUMS", BUF_SUMS), ("LIST_WORDS", LIST_WORDS),
        ("MAX_SHARDS", MAX_SHARDS), ("SUM_LIMIT", f"{SUM_LIMIT}LL"),
        ("TOUCHED_SORTED", f"(1ULL << {TOUCHED_SORTED.bit_length() - 1})"),
        ("TOUCHED_WRITING", f"(1ULL << {TOUCHED_WRITING.bit_length() - 1})"),
        ("TOUCHED_COMPACT", f"(1ULL << {TOUCHED_COMPACT.bit_length() - 1})"),
        ("TOUCHED_ZEROED", f"(1ULL << {TOUCHED_ZEROED.bit_length() - 1})")))
    return ("/* GENERATED from dataplane/layout.py by `python -m dataplane.gen_headers`; do not edit\n"
            " * (tests/unit/test_generated_headers.py fails when it is stale). */\n"
            "#ifndef DOSA_LAYOUT_H\n#define DOSA_LAYOUT_H\n\n" + defines + "\n#endif /* DOSA_LAYOUT_H */\n")
