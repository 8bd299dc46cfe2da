"""Commands of this subsystem (filled in by its issue)."""


def add_commands(subparsers) -> None:
    """Register this subsystem's commands on the top-level ``slimkv`` parser."""
