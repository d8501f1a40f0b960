"""Which top-k selector the encoder should use on CPU buckets: the Cython single pass through a
zero-copy numpy view, or torch (the code that runs on CUDA). Prints the median of each on one
gradient-like float32 tensor, with error feedback (r += g) included, as the encoder runs it.

    python -m benchmarks.train_select [--numel 1000000] [--density 0.01] [--repeat 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from host_lib.encoder import RoundEncoder


def median_ms(fn, repeat: int) -> float:
    fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.from_numpy((np.random.default_rng(0).standard_t(3, a.numel) * 1e-3).astype(np.float32))
    res = {}
    for name, kw in [("cython_fast (numpy view)", dict(backend="numpy", method="fast")),
                     ("torch_fast", dict(backend="torch", method="fast")),
                     ("torch_topk (exact)", dict(backend="torch", method="exact"))]:
        enc = RoundEncoder(a.numel, a.density, 4, **kw)
        res[name] = median_ms(lambda: enc.encode(g, 24), a.repeat)
    base = res["cython_fast (numpy view)"]
    print(f"encode (r += g, select, quantize) of {a.numel} float32 at density {a.density}, "
          f"median of {a.repeat}, 1 thread:")
    for name, ms in res.items():
        print(f"  {name:26s} {ms:7.2f} ms   {ms / base:5.2f}x cython")


if __name__ == "__main__":
    main()
