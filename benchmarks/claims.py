"""Write benchmarks/results/claims.md: the papers' claims checked against the committed results.

Every figure in claims.md is read or computed from a JSON file in benchmarks/results/ (each table
names its file) by the package beside this script, ``claims_md/`` (one module per section), and
every verdict is one of its rules (``claims_md/rules.py`` and the per-claim functions), so the
page cannot drift from its data:

    .venv/bin/python benchmarks/claims.py            # rewrite benchmarks/results/claims.md
    .venv/bin/python benchmarks/claims.py --check    # exit 1 when claims.md differs from what the JSON gives

tests/test_published_numbers.py runs the check. The script reads JSON only: it trains and times
nothing, and runs in about a second.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable

from claims_md import render  # benchmarks/claims_md/, beside this script
from claims_md.text import RESULTS

OUTPUT = RESULTS / "claims.md"


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Write claims.md, or with ``--check`` compare it with what the JSON gives (1 when they differ)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare the committed claims.md with what the JSON gives; exit 1 when they differ")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        committed = OUTPUT.read_text(encoding="utf-8") if OUTPUT.is_file() else ""
        if committed == text:
            out(f"{OUTPUT} is what the JSON gives")
            return 0
        out("".join(difflib.unified_diff(committed.splitlines(True), text.splitlines(True), "claims.md (committed)", "claims.md (from the JSON)")))
        out(f"{OUTPUT} differs from what the JSON gives: run .venv/bin/python benchmarks/claims.py")
        return 1
    OUTPUT.write_text(text, encoding="utf-8")
    out(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
