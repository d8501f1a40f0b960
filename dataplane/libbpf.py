"""Thin ctypes bindings to the system libbpf (libbpf.so.1, which libbcc itself links).

Why not BCC's Python API: BCC only knows maps of a program *it* compiled in *this* process. The
DPU worker and a restarted control process open the pinned maps of a program some other process
loaded, so they use libbpf directly: bpf_obj_get, map lookup/update/delete/next_key, ring buffers,
BPF_PROG_TEST_RUN and XDP attach by ifindex. Every function raises OSError with errno on failure.
The library is loaded at first use, not at import (a DosaError naming Debian's libbpf1 when it is
absent): what imports this module without calling it runs on machines that have no libbpf.
"""
from __future__ import annotations

import ctypes
import os

from dosa.errors import DosaError

SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
LIBRARY = "libbpf.so.1"


class _NotLoaded:
    """Stands for the library until its first use: importing this module (which the control
    plane's CLI and the DPU worker's modules do) must work on a machine without libbpf, a training
    host or a DPU running the userspace worker; only a BPF operation needs the library. The first
    attribute looked up loads it and puts the real handle in ``_lib``."""

    def __getattr__(self, name):
        global _lib
        _lib = _load()
        return getattr(_lib, name)


_lib = _NotLoaded()


def _load() -> ctypes.CDLL:
    """libbpf, its functions' signatures declared; a DosaError naming the package when it is absent."""
    try:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as e:
        raise DosaError(f"this needs the BPF library {LIBRARY} (install Debian's libbpf1 package: "
                        f"apt-get install libbpf1), which cannot be loaded: {e}") from None
    lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
    lib.bpf_obj_get.restype = ctypes.c_int
    lib.bpf_obj_pin.argtypes = [ctypes.c_int, ctypes.c_char_p]
    lib.bpf_obj_pin.restype = ctypes.c_int
    lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.bpf_map_lookup_elem.restype = ctypes.c_int
    lib.bpf_map_update_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    lib.bpf_map_update_elem.restype = ctypes.c_int
    lib.bpf_map_delete_elem.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.bpf_map_delete_elem.restype = ctypes.c_int
    lib.bpf_map_get_next_key.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.bpf_map_get_next_key.restype = ctypes.c_int
    lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    lib.bpf_obj_get_info_by_fd.restype = ctypes.c_int
    lib.bpf_xdp_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]
    lib.bpf_xdp_attach.restype = ctypes.c_int
    lib.bpf_xdp_detach.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]
    lib.bpf_xdp_detach.restype = ctypes.c_int
    lib.bpf_xdp_query_id.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
    lib.bpf_xdp_query_id.restype = ctypes.c_int
    lib.libbpf_num_possible_cpus.argtypes = []
    lib.libbpf_num_possible_cpus.restype = ctypes.c_int
    lib.ring_buffer__new.argtypes = [ctypes.c_int, SAMPLE_FN, ctypes.c_void_p, ctypes.c_void_p]
    lib.ring_buffer__new.restype = ctypes.c_void_p
    lib.ring_buffer__poll.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ring_buffer__poll.restype = ctypes.c_int
    lib.ring_buffer__consume.argtypes = [ctypes.c_void_p]
    lib.ring_buffer__consume.restype = ctypes.c_int
    lib.ring_buffer__epoll_fd.argtypes = [ctypes.c_void_p]
    lib.ring_buffer__epoll_fd.restype = ctypes.c_int
    lib.ring_buffer__free.argtypes = [ctypes.c_void_p]
    lib.ring_buffer__free.restype = None
    lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(TestRunOpts)]
    lib.bpf_prog_test_run_opts.restype = ctypes.c_int
    return lib


XDP_FLAGS_UPDATE_IF_NOEXIST = 1
XDP_FLAGS_SKB_MODE = 2
XDP_FLAGS_DRV_MODE = 4

BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_F_MMAPABLE = 1 << 10


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno() or -rc
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def obj_get(path: str) -> int:
    """Open a pinned map or program; returns a new fd."""
    return _check(_lib.bpf_obj_get(path.encode()), f"bpf_obj_get({path})")


def obj_pin(fd: int, path: str) -> None:
    _check(_lib.bpf_obj_pin(fd, path.encode()), f"bpf_obj_pin({path})")


def num_possible_cpus() -> int:
    return _check(_lib.libbpf_num_possible_cpus(), "libbpf_num_possible_cpus")


class MapInfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                ("map_flags", ctypes.c_uint32), ("name", ctypes.c_char * 16),
                ("ifindex", ctypes.c_uint32), ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("netns_dev", ctypes.c_uint64), ("netns_ino", ctypes.c_uint64),
                ("btf_id", ctypes.c_uint32), ("btf_key_type_id", ctypes.c_uint32),
                ("btf_value_type_id", ctypes.c_uint32), ("_pad", ctypes.c_uint32),
                ("map_extra", ctypes.c_uint64)]


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    n = ctypes.c_uint32(ctypes.sizeof(info))
    _check(_lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(n)), "bpf_obj_get_info_by_fd")
    return info


def lookup(fd: int, key, value) -> bool:
    """Look ``key`` up into the ctypes object ``value``; False when absent (ENOENT)."""
    rc = _lib.bpf_map_lookup_elem(fd, ctypes.byref(key), ctypes.byref(value))
    if rc < 0:
        err = ctypes.get_errno() or -rc
        if err == 2:
            return False
        raise OSError(err, f"bpf_map_lookup_elem: {os.strerror(err)}")
    return True


def update(fd: int, key, value, flags: int = 0) -> None:
    _check(_lib.bpf_map_update_elem(fd, ctypes.byref(key), ctypes.byref(value), flags),
           "bpf_map_update_elem")


def delete(fd: int, key) -> bool:
    rc = _lib.bpf_map_delete_elem(fd, ctypes.byref(key))
    if rc < 0:
        err = ctypes.get_errno() or -rc
        if err == 2:
            return False
        raise OSError(err, f"bpf_map_delete_elem: {os.strerror(err)}")
    return True


def keys(fd: int, key_type) -> list:
    """All keys of a hash map (a snapshot)."""
    out = []
    cur, nxt = None, key_type()
    while True:
        rc = _lib.bpf_map_get_next_key(fd, ctypes.byref(cur) if cur is not None else None,
                                       ctypes.byref(nxt))
        if rc < 0:
            break
        out.append(nxt)
        cur, nxt = nxt, key_type()
    return out


class TestRunOpts(ctypes.Structure):
    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32)]


def _test_run(prog_fd: int, data: bytes, repeat: int) -> tuple[TestRunOpts, ctypes.Array]:
    inbuf = ctypes.create_string_buffer(data, len(data))
    outbuf = ctypes.create_string_buffer(len(data) + 512)
    o = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_in=ctypes.addressof(inbuf),
                    data_out=ctypes.addressof(outbuf), data_size_in=len(data),
                    data_size_out=len(outbuf), repeat=repeat)
    _check(_lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(o)), "bpf_prog_test_run_opts")
    return o, outbuf


def prog_test_run(prog_fd: int, data: bytes, repeat: int = 1) -> tuple[int, bytes]:
    """Run an XDP program once on ``data`` (BPF_PROG_TEST_RUN); returns (action, output packet)."""
    o, outbuf = _test_run(prog_fd, data, repeat)
    return o.retval, outbuf.raw[: o.data_size_out]


def prog_test_run_timed(prog_fd: int, data: bytes) -> tuple[int, int]:
    """Run once; returns (action, nanoseconds the kernel measured for the program run)."""
    o, _ = _test_run(prog_fd, data, 1)
    return o.retval, o.duration


def xdp_attach(ifindex: int, prog_fd: int, flags: int = 0) -> None:
    _check(_lib.bpf_xdp_attach(ifindex, prog_fd, flags, None), f"bpf_xdp_attach(ifindex {ifindex})")


def xdp_detach(ifindex: int, flags: int = 0) -> None:
    _check(_lib.bpf_xdp_detach(ifindex, flags, None), f"bpf_xdp_detach(ifindex {ifindex})")


def xdp_query_id(ifindex: int, flags: int = 0) -> int:
    """Id of the XDP program attached to ``ifindex`` (0 = none)."""
    pid = ctypes.c_uint32(0)
    _check(_lib.bpf_xdp_query_id(ifindex, flags, ctypes.byref(pid)), f"bpf_xdp_query_id({ifindex})")
    return pid.value


class RingBuffer:
    """A libbpf ring buffer consumer on a (pinned) BPF_MAP_TYPE_RINGBUF fd. ``callback(bytes)``
    receives each record; poll() returns the number of records consumed."""

    def __init__(self, map_fd: int, callback):
        def _cb(_ctx, data, size):
            callback(ctypes.string_at(data, size))
            return 0

        self._cb = SAMPLE_FN(_cb)  # keep a reference: libbpf calls it later
        self._rb = _lib.ring_buffer__new(map_fd, self._cb, None, None)
        if not self._rb:
            err = ctypes.get_errno()
            raise OSError(err, f"ring_buffer__new: {os.strerror(err)}")

    def poll(self, timeout_ms: int) -> int:
        return _check(_lib.ring_buffer__poll(self._rb, timeout_ms), "ring_buffer__poll")

    def consume(self) -> int:
        return _check(_lib.ring_buffer__consume(self._rb), "ring_buffer__consume")

    def epoll_fd(self) -> int:
        """An fd that polls readable while records wait (to wait on it next to sockets)."""
        return _check(_lib.ring_buffer__epoll_fd(self._rb), "ring_buffer__epoll_fd")

    def close(self) -> None:
        if self._rb:
            _lib.ring_buffer__free(self._rb)
            self._rb = None

    def __del__(self):
        self.close()
