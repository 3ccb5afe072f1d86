"""The ``mixprec`` command (also ``python -m mixprec``).

Each subcommand lives in a module of ``mixprec.commands`` that exposes ``register(subparsers)``;
``register`` adds a parser and sets ``func`` (called with the parsed args, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order ``mixprec --help`` lists them.
COMMANDS = (
    "formats",
    "doctor",
    "bench",
    "demo",
    "plan",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixprec", description="Mixed-precision training tools for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"mixprec.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"mixprec {args.command}: error: {exc}", file=sys.stderr)
        return 2
