"""Benchmarks of dosa against its baselines, side by side in one run (``dosa bench allreduce``).

``gradients``: per-host gradients (synthetic with a controllable correlation, or saved from a model);
``baselines``: torch.distributed Gloo dense allreduce and sparse allgather over the same inputs;
``limit``: the link limit for dosa's bytes and this machine's raw UDP packet rate;
``report``: JSON, a table of ratios, a PNG plot; ``runner``: ties them together (CLI options, run).
"""

from host_lib.bench.baselines import prepare_workdir, run_baselines  # noqa: E402,F401
from host_lib.bench.runner import add_arguments, cli_run, main, run_bench  # noqa: E402,F401
