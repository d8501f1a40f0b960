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

#: pstate.scale_tag = scale_exp + SCALE_TAG_BIAS: never 0 for a valid scale, so 0 means "unset"
SCALE_TAG_BIAS = 256


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
assert PSTATE_DTYPE.itemsize == 56 and WSTATE_DTYPE.itemsize == 48 and COMPLETION_DTYPE.itemsize == 16


def buffer_pitch(stride: int, list_cap: int) -> int:
    """Pool entries of one aggregation buffer (struct dosa_job): its ``stride`` s64 sums, then its
    touched list, ``list_cap`` u16 offsets packed 4 per entry (dosa_xdp.c locate() computes the
    same)."""
    return stride + list_cap // 4


def c_defines() -> str:
    """C text of the constants above the program shares with user space."""
    return f"#define DOSA_SCALE_TAG_BIAS {SCALE_TAG_BIAS}\n"
