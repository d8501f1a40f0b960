"""The ``dosa`` command. Each component owns its subcommands in its own ``cli`` module, which
exposes ``register(subparsers)`` (top-level commands) and/or ``register_bench(bench_subparsers)``
(``dosa bench ...``); only the running command's module is imported (``COMMANDS``), so a machine
without the DPU side's libraries runs every command that does not need them. Handlers are
``args.func(args) -> int``. A DosaError (dosa.wire's ProtocolError, a malformed packet, is one)
becomes one line on stderr and exit status 2, and so does a bad argument (``_Parser.error``: the sentence and a pointer to ``--help``, not the whole usage). Output
into a closed pipe (``dosa capture show F | head``) ends quietly with status 141, as for SIGPIPE."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from dosa.errors import DosaError

#: Each top-level command and the module that adds it. Only the module of the command being run is
#: imported (``dosa capture verify`` never imports the control plane, the testbed or the benchmarks:
#: a training host or a DPU in userspace mode has no libbpf, BCC or pyroute2); ``dosa --help``
#: imports them all, and lists one it cannot import with the reason instead of failing.
COMMANDS = {
    "capture": "dosa.app.capture_cli",
    "ctl": "control.cli",
    "testbed": "testbed.cli",
    "deploy": "testbed.cli",
    "dpu": "dpu_fw.cli",
    "offload": "dosa.app.offload_cli",
    "bench": "benchmarks.cli",
    "plan": "benchmarks.plan.cli",
    "demo": "dosa.app.demo_cli",
}
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))

#: Python packages some commands need that a training host may lack: a missing one ends the command
#: with this sentence instead of a traceback.
OPTIONAL_PACKAGES = {
    "torch": "PyTorch (the training host's own build, or: pip install torch)",
    "pyroute2": "pyroute2 (pip install 'dosa[dpu]')",
    "prometheus_client": "prometheus-client (pip install 'dosa[dpu]')",
    "scapy": "scapy (pip install scapy)",
    "sklearn": "scikit-learn (pip install 'dosa[train]')",
    "matplotlib": "matplotlib (pip install 'dosa[plot]')",
    "bcc": "BCC's Python bindings (Debian's python3-bpfcc; make setup installs them)",
}


def _missing_package(e: ModuleNotFoundError) -> str | None:
    """The sentence for an optional package that is not installed; None for anything else."""
    top = (e.name or "").split(".")[0]
    return OPTIONAL_PACKAGES.get(top)


class _Parser(argparse.ArgumentParser):
    """One sentence for a bad argument; subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _command_of(argv: list[str]) -> str | None:
    """The command named on the command line (the first word that is not an option), if known."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or, given ``command``, with that command's module only."""
    parser = _Parser(
        prog="dosa", description="DPU-offloaded in-network sparse gradient aggregation.")
    parser.add_argument("--version", action="version", version="dosa 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks (print ratios against baselines run alongside)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench.set_defaults(func=lambda a: (bench.print_help(), 2)[1])
    for name in [COMMANDS[command]] if command else COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except (ImportError, OSError, DosaError) as e:
            if command:
                raise
            _unavailable(sub, name, e)
            continue
        if hasattr(mod, "register"):
            mod.register(sub)
        if hasattr(mod, "register_bench"):
            mod.register_bench(bench_sub)
    return parser


def _unavailable(sub, module: str, e: Exception) -> None:
    """List the commands of a module that cannot be imported here, with why, in ``dosa --help``;
    running one says the same sentence."""
    why = (f"needs {_missing_package(e)}" if isinstance(e, ModuleNotFoundError) and _missing_package(e)
           else f"cannot be loaded here: {e}")
    for cmd in (c for c, m in COMMANDS.items() if m == module and c != "bench"):
        p = sub.add_parser(cmd, help=f"(unavailable: {why})", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)

        def refuse(_args, cmd=cmd):
            raise DosaError(f"dosa {cmd} {why}")
        p.set_defaults(func=refuse)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (``| head``): nothing more to say, and nothing to flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _command_of(argv)
    try:
        parser = build_parser(command)
        args = parser.parse_args(argv)
    except DosaError as e:  # a type= check that raised ours instead of argparse's
        print(f"dosa: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # the command's module needs a package that is not installed
        if not _missing_package(e):
            raise
        print(f"dosa: {command} needs {_missing_package(e)}, which is not installed", file=sys.stderr)
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
    except ModuleNotFoundError as e:  # a step of the command needs a package that is not installed
        if not _missing_package(e):
            raise
        print(f"dosa: {command} needs {_missing_package(e)}, which is not installed", file=sys.stderr)
        return 2
    except OSError as e:  # a file it may not read or write (not root, a read-only directory)
        if e.filename is None or isinstance(e, BrokenPipeError):
            raise
        print(f"dosa: {command}: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dosa: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
