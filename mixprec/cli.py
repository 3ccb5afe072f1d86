"""The ``mixprec`` command (also ``python -m mixprec``).

Each subcommand lives in a module of ``mixprec.commands`` that exposes ``register(subparsers)``;
``register`` adds a parser and sets ``func`` (called with the parsed args, returns an exit code).
A module may also define ``normalize_argv(command, args) -> args``, applied to the arguments
after the subcommand's name before parsing (``explain`` uses it so that ``-inf`` is a value, not
an option); it returns ``args`` unchanged for commands it does not own.

The parsers are :class:`mixprec.commands.args.Parser`: an option that takes one value refuses
to be given twice (argparse would keep the last one silently); list options say so with
``action="extend", type=comma_list``.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .commands import advise, bench, demo, doctor, formats, plan, report
from .commands.args import Parser

# Subcommand modules, in the order ``mixprec --help`` lists them.
COMMANDS = {module.__name__.rpartition(".")[2]: module
            for module in (formats, doctor, bench, demo, plan, advise, report)}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mixprec", description="Mixed-precision training tools for PyTorch.")
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        module.register(sub)
    return parser


def normalize_argv(argv: list[str]) -> list[str]:
    """Apply the subcommand modules' ``normalize_argv`` hooks to the arguments after the
    subcommand's name (the first token that is not an option)."""
    argv = list(argv)
    for i, token in enumerate(argv):
        if not token.startswith("-"):
            rest = argv[i + 1:]
            for module in COMMANDS.values():
                hook = getattr(module, "normalize_argv", None)
                if hook is not None:
                    rest = hook(token, rest)
            return argv[:i + 1] + rest
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(normalize_argv(argv))
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `mixprec plan ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"mixprec {args.command}: error: {exc}", file=sys.stderr)
        return 2
