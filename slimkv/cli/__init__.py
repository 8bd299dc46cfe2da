"""The ``slimkv`` command line: the top floor. Each module here defines ``add_commands(subparsers)``
for one group of commands and only parses arguments and calls the library; errors a user can fix
(bad options, missing files, a busy folder) print one line and exit with status 2."""

from __future__ import annotations

import argparse
import sys

from slimkv.cli import analyze, compare, compress, convert, data, demo, eval, train
from slimkv.common.files import FolderBusyError, WriteFailed

COMMAND_MODULES = (data, train, eval, analyze, compare, compress, convert, demo)
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError, IsADirectoryError, PermissionError, FolderBusyError,
               WriteFailed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimkv",
        description="Train, compare, convert, compress and serve attention with smaller key-value caches.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        print(f"slimkv {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slimkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
