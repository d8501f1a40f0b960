"""The ``dosa`` command. Each component owns its subcommands in its own ``cli`` module, which
exposes ``register(subparsers)`` (top-level commands) and/or ``register_bench(bench_subparsers)``
(``dosa bench ...``). Handlers are ``args.func(args) -> int``. A DosaError (or a ProtocolError /
ValueError raised on bad user input) becomes one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from dosa.errors import DosaError

#: Modules that add commands. A module that is missing its optional dependencies is skipped with
#: a note in ``dosa --help`` rather than breaking the whole CLI.
COMMAND_MODULES = [
    "dosa.capture_cli",
    "control.cli",
    "testbed.cli",
    "dpu_fw.cli",
    "dpu_fw.offload_cli",
    "benchmarks.cli",
    "dosa.demo_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dosa", description="DPU-offloaded in-network sparse gradient aggregation.")
    parser.add_argument("--version", action="version", version="dosa 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks (print ratios against baselines run alongside)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench.set_defaults(func=lambda a: (bench.print_help(), 2)[1])
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (e.name == name or name.startswith(e.name + ".") or e.name.startswith(name)):
                continue  # that component is not written yet
            raise
        if hasattr(mod, "register"):
            mod.register(sub)
        if hasattr(mod, "register_bench"):
            mod.register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except DosaError as e:
        print(f"dosa: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dosa: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
