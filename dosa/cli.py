"""The ``dosa`` command. Each component owns its subcommands in its own ``cli`` module, which
exposes ``register(subparsers)`` (top-level commands) and/or ``register_bench(bench_subparsers)``
(``dosa bench ...``). Handlers are ``args.func(args) -> int``. A DosaError (or a ProtocolError /
ValueError raised on bad user input) becomes one line on stderr and exit status 2, and so does a bad
argument (``_Parser.error``: the sentence and a pointer to ``--help``, not the whole usage). Output
into a closed pipe (``dosa capture show F | head``) ends quietly with status 141, as for SIGPIPE."""
from __future__ import annotations

import argparse
import importlib
import os
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


class _Parser(argparse.ArgumentParser):
    """One sentence for a bad argument; subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (``| head``): nothing more to say, and nothing to flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except DosaError as e:  # a type= check that raised ours instead of argparse's
        print(f"dosa: {e}", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside main, not at interpreter exit
    except DosaError as e:
        print(f"dosa: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dosa: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
