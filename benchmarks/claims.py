"""Write benchmarks/results/claims.md, or with ``--check`` exit 1 when it differs from what the JSON gives.

The page's one renderer: it fills the template ``claims_md/claims.md.in``, section ``@@ NAME`` with the fields
``claims_md/figures.NAME()`` reads or computes from the JSON of benchmarks/results/, if any, and ``rule``,
the thresholds of ``claims_md/rules.py`` (which holds every verdict rule).
Fields are ``str.format``'s; ``@LIST rest`` repeats ``rest`` per item of ``LIST``; ``|-`` is a table's delimiter row.
A spec is a Python format, a name in ``figures.FORMATS`` or ``rules.WORDS``, alternatives ``a/b`` (true/false) or
``a/b/c`` (sign -1/0/+1), or ``and:SPEC`` (a list as "a, b and c"); other lists give table cells.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import re
import string
import sys
from collections.abc import Callable
from typing import Any

from claims_md import figures  # benchmarks/claims_md/, beside this script
from claims_md.rules import RULES, WORDS

OUTPUT = figures.RESULTS / "claims.md"


class Page(string.Formatter):
    """``str.format`` with the page's named formats, verdict words, alternatives and lists."""

    def format_field(self, value: Any, spec: str) -> str:
        if spec.startswith("and"):
            items = [self.format_field(v, spec[4:]) for v in value]
            return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items) or "none"
        if isinstance(value, list):
            return " | ".join(self.format_field(v, spec) for v in value)
        if spec in WORDS:  # a verdict's sign (-1, 0, +1; False and True read as -1 and +1) in words
            return value if isinstance(value, str) else WORDS[spec][(2 if value else 0) if isinstance(value, bool) else value + 1]
        if "/" in spec:
            words = spec.split("/")
            return words[value + 1] if len(words) == 3 else words[0] if value else words[1]
        return figures.FORMATS[spec](value) if spec in figures.FORMATS else "-" if value is None else format(value, spec)


def fill(template: str, fields: dict[str, Any]) -> list[str]:
    """The lines of one section's template with its fields filled in."""
    lines = []
    for line in template.splitlines():
        repeated, _, row = line[1:].partition(" ") if line.startswith("@") else ("", "", line)
        items = Page().get_field(repeated, (), fields)[0] if repeated else [{}]
        lines += [Page().vformat(row, (), fields | item) for item in items]
    for i, line in enumerate(lines):  # a column is right-aligned when each of its cells but "-" starts with a number
        if line == "|-":
            columns = zip(*(row.strip("| ").split(" | ") for row in itertools.takewhile(lambda row: row.startswith("|"), lines[i + 1:])))
            lines[i] = "| " + " | ".join("---:" if all(re.match(r"\**[-+]?\d", c) for c in column if c != "-") else "---" for column in columns) + " |"
    return lines


def render() -> str:
    """The whole of claims.md from the committed JSON."""
    sections = re.split(r"^@@ (\w+)\n", figures.TEMPLATE.read_text(encoding="utf-8"), flags=re.M)[1:]
    filled = (fill(text, {"rule": RULES} | getattr(figures, name, dict)()) for name, text in zip(sections[::2], sections[1::2]))
    return "\n".join(line for lines in filled for line in lines).strip() + "\n"


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Write claims.md, or with ``--check`` compare it with what the JSON gives (1 when they differ)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare the committed claims.md with what the JSON gives; exit 1 when they differ")
    text, committed = render(), OUTPUT.read_text(encoding="utf-8") if OUTPUT.is_file() else ""
    if not p.parse_args(argv).check:
        OUTPUT.write_text(text, encoding="utf-8")
        out(f"wrote {OUTPUT}")
        return 0
    if committed == text:
        out(f"{OUTPUT} is what the JSON gives")
        return 0
    out("".join(difflib.unified_diff(committed.splitlines(True), text.splitlines(True), "claims.md (committed)", "claims.md (from the JSON)")))
    out(f"{OUTPUT} differs from what the JSON gives: run .venv/bin/python benchmarks/claims.py")
    return 1


if __name__ == "__main__":
    sys.exit(main())
