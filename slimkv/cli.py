"""The ``slimkv`` command line. Each subsystem adds its commands from its own ``cli`` module."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define ``add_commands(subparsers)``; each command sets ``func`` on its parser.
COMMAND_MODULES = (
    "slimkv.data.cli",
    "slimkv.train.cli",
    "slimkv.eval.cli",
    "slimkv.eval.diversity",
    "slimkv.compress.cli",
    "slimkv.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimkv",
        description="Train, compare, compress and serve attention with smaller key-value caches.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"slimkv {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
