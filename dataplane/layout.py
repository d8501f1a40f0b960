"""ctypes / numpy mirrors of the structs in dataplane/dosa_state.h (the maps' keys and values).

tests/dataplane/test_layout.py compares each against the struct BCC compiled, field by field.
"""
from __future__ import annotations

import ctypes

import numpy as np

SCALE_TAG_BIAS = 256  # DOSA_SCALE_TAG_BIAS


class Job(ctypes.Structure):
    _fields_ = [("workers", ctypes.c_uint32), ("partition_size", ctypes.c_uint32),
                ("numel", ctypes.c_uint32), ("num_partitions", ctypes.c_uint32),
                ("dpu_index", ctypes.c_uint32), ("num_dpus", ctypes.c_uint32),
                ("num_owned", ctypes.c_uint32), ("mode", ctypes.c_uint32),
                ("pool_off", ctypes.c_uint32), ("pstate_off", ctypes.c_uint32),
                ("wstate_off", ctypes.c_uint32), ("scale_exp", ctypes.c_int32),
                ("port", ctypes.c_uint32), ("stride", ctypes.c_uint32)]


class FlowKey(ctypes.Structure):
    _fields_ = [("job_id", ctypes.c_uint32), ("worker_id", ctypes.c_uint32)]


class Flow(ctypes.Structure):
    # saddr and sport are in network byte order, as the packet carries them
    _fields_ = [("saddr", ctypes.c_uint32), ("sport", ctypes.c_uint16), ("reserved", ctypes.c_uint16)]


class PState(ctypes.Structure):
    _fields_ = [("base_round", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("workers_done", ctypes.c_uint64 * 2), ("scale_tag", ctypes.c_uint64 * 2)]


class WState(ctypes.Structure):
    _fields_ = [("seen", ctypes.c_uint64 * 4), ("received", ctypes.c_uint64),
                ("total", ctypes.c_uint64)]


class Completion_(ctypes.Structure):
    _fields_ = [("job_id", ctypes.c_uint32), ("round", ctypes.c_uint32),
                ("partition", ctypes.c_uint16), ("scale_exp", ctypes.c_int8),
                ("reserved", ctypes.c_uint8), ("reserved2", ctypes.c_uint32)]


U32 = ctypes.c_uint32

#: numpy views of the mmapable state arrays (element stride = struct size, a multiple of 8)
PSTATE_DTYPE = np.dtype([("base_round", "<u4"), ("reserved", "<u4"), ("workers_done", "<u8", 2),
                         ("scale_tag", "<u8", 2)])
WSTATE_DTYPE = np.dtype([("seen", "<u8", 4), ("received", "<u8"), ("total", "<u8")])
assert PSTATE_DTYPE.itemsize == ctypes.sizeof(PState) == 40
assert WSTATE_DTYPE.itemsize == ctypes.sizeof(WState) == 48
