"""A process that ends while its dosa stream's thread is inside torch (tests/unit/test_stream_exit.py).

The stream's thread completes a bucket's future, and DDP's callbacks run in that thread: here the
callback keeps calling torch for ``SPIN_S`` seconds while the main thread returns from ``main``.
A daemon thread would then be inside libtorch when the interpreter finalizes, and CPython 3.11's
``pthread_exit`` of such a thread aborts the process ("terminate called without an active
exception"). The stream's thread is not a daemon, so the interpreter waits for it and exits 0.

argv: JOB_CONFIG (a one-host job whose userspace DPU worker is running)."""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import torch

from dosa.job import JobConfig
from host_lib.client import AggregationClient

SPIN_S = 1.0


def main() -> None:
    job = JobConfig.load(sys.argv[1])
    client = AggregationClient(job, worker_id=0, timeout=10)
    stream = client.open_stream(job.scale_exp)
    in_torch = threading.Event()

    def ddp_like_callback(cf):
        cf.result()
        in_torch.set()
        end = time.monotonic() + SPIN_S
        while time.monotonic() < end:
            f = torch.futures.Future()
            f.then(lambda x: x.value() + 1)
            f.set_result(torch.zeros(16))

    idx = np.arange(0, job.numel, 97, dtype=np.uint32)
    stream.send(idx, np.ones(len(idx), np.int32), stream.P)
    stream.wait_for(0, stream.P).add_done_callback(ddp_like_callback)
    if not in_torch.wait(20):
        raise SystemExit("the stream never completed its round")
    print("main thread returns while the stream's thread is in torch", flush=True)


if __name__ == "__main__":
    main()
