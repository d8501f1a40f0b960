"""Benchmarks of dosa against its baselines, side by side in one run (``dosa bench allreduce``).

``gradients``: per-host gradients (synthetic with a controllable correlation, or saved from a model);
``baselines``: torch.distributed Gloo dense allreduce and sparse allgather over the same inputs;
``limit``: the link limit for dosa's bytes and this machine's raw UDP packet rate;
``report``: JSON, a table of ratios, a PNG plot; ``runner``: ties them together (CLI options, run).
"""

_EXPORTS = {"prepare_workdir": "baselines", "run_baselines": "baselines", "add_arguments": "runner",
            "cli_run": "runner", "main": "runner", "run_bench": "runner"}


def __getattr__(name):
    # lazy: the worker processes run ``python -m benchmarks.allreduce.baselines`` / ``.limit``, which must
    # not be imported by the package first (runpy would warn and run the module twice)
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"benchmarks.allreduce.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'benchmarks.allreduce' has no attribute {name!r}")
