"""Markdown tables from one helper: the pipes, the alignment row and the escaping of a cell are
spelled here once, for every report that writes a table (``markdown_table``).

A table is GitHub-flavoured markdown::

    | model | ppl |
    | --- | ---: |
    | original | 12.34 |
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ALIGNS = {"left": "---", "right": "---:", "center": ":---:"}


def markdown_table(headers: Sequence[object], rows: Iterable[Sequence[object]], align: str | Sequence[str] = "left") -> str:
    """The table of ``headers`` (n cells) and ``rows`` (n cells each), one line per row, no final
    newline. Cells are written with ``str``; a ``|`` inside a cell is escaped so it stays one cell.
    ``align``: ``left``, ``right`` or ``center``, for every column or one per column."""
    aligns = [align] * len(headers) if isinstance(align, str) else list(align)
    if len(aligns) != len(headers):
        raise ValueError(f"align names {len(aligns)} columns, the headers {len(headers)}")
    for name in aligns:
        if name not in ALIGNS:
            raise ValueError(f"align={name!r} is not allowed; allowed values: {', '.join(ALIGNS)}")
    lines = [_line(headers), _line(ALIGNS[name] for name in aligns)]
    for index, row in enumerate(rows):
        cells = list(row)
        if len(cells) != len(headers):
            raise ValueError(f"row {index} has {len(cells)} cells, the headers {len(headers)}: {cells!r}")
        lines.append(_line(cells))
    return "\n".join(lines)


def _line(cells: Iterable[object]) -> str:
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"
