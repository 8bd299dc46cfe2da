"""The task x length x depth grid that both retrieval stacks run (``runs`` on training runs,
``models`` on pretrained models): the grammar of ``--lengths``, ``--depths`` and ``--tasks``, the
runner that measures each cell once, the depth x length table of the report and its heatmaps.

The length grammar, accepted by every command that takes ``--lengths`` (docs/evaluation.md,
"Lengths and depths")::

    2048     a token count
    2k       a count of 1024 tokens (1.5k = 1536)
    2x       a multiple of the command's reference length (0.5x allowed): a training run's
             length for ``slimkv eval niah RUN_DIR``, ``--seq-len`` for ``slimkv eval recall``;
             refused where a command has none (``--model``, ``slimkv eval ruler``)

Entries are comma-separated, spaces and case ignored, each length given once; a product is
rounded to the nearest token. Depths are comma-separated fractions of the haystack in [0, 1]
(0 = its first line, 1 = its last), distinct and at least 0.01 apart: a cell is named by its
depth to 2 decimals (``cell_id``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
from tqdm import tqdm

from slimkv.common.checks import check_int
from slimkv.common.files import save_figure
from slimkv.common.markdown import markdown_table
from slimkv.common.plotting import new_figure

KILO = 1024  # tokens in 1k
DEPTHS_SYNTAX = "comma-separated fractions of the haystack in [0, 1], distinct and at least 0.01 apart, like 0,0.25,0.5,0.75,1"

Prompt = TypeVar("Prompt")
Result = TypeVar("Result")


def lengths_syntax(reference: str | None = None) -> str:
    """The accepted ``--lengths`` spellings in words, for help texts and errors; ``reference``
    names what ``2x`` multiplies (None: a command without a reference length, no ``2x``)."""
    counts = "comma-separated token counts like 2048, or counts of 1024 tokens like 2k"
    return counts if reference is None else f"{counts}, or multiples of {reference} like 2x"


def parse_lengths(text: str, reference: int | None = None, *, reference_name: str = "the training length") -> list[int]:
    """``"2048,2k,2x"`` -> token counts in the order given (``2x`` = 2 x ``reference``, refused
    without one). ValueError naming ``--lengths`` and the accepted spellings otherwise."""
    return [tokens for _, tokens in _parse_lengths(text, reference, reference_name)]


def length_factors(text: str, seq_len: int) -> tuple[int, ...]:
    """``"1x,2x,4x"`` -> (1, 2, 4): ``slimkv eval recall``'s test lengths, whole multiples of
    ``--seq-len``, 1x among them; a token count is accepted where it is one (``128`` at
    ``--seq-len 64`` is 2)."""
    check_int("--seq-len", seq_len, 1)
    factors = []
    for entry, tokens in _parse_lengths(text, seq_len, "--seq-len"):
        if tokens % seq_len:
            bare = "" if entry.lower().endswith(("x", "k")) else " (a bare number is a token count)"
            raise ValueError(f"--lengths {entry}: recall tests at whole multiples of --seq-len ({seq_len}), including 1x; write them as factors "
                             f"like 1x,2x,4x{bare}; {tokens} tokens is not a multiple of {seq_len}")
        factors.append(tokens // seq_len)
    if 1 not in factors:
        raise ValueError(f"--lengths {text}: recall tests at whole multiples of --seq-len including 1x (the training length), like 1x,2x,4x")
    return tuple(factors)


def _parse_lengths(text: str, reference: int | None, reference_name: str) -> list[tuple[str, int]]:
    """(entry as written, tokens) per entry of ``text``; the checks of ``parse_lengths``."""
    accepted = lengths_syntax(reference_name if reference is not None else None)
    entries = [part.strip() for part in str(text).split(",") if part.strip()]
    if not entries:
        raise ValueError(f"--lengths is empty ({text!r}); give {accepted}")
    parsed: list[tuple[str, int]] = []
    for entry in entries:
        spelled = entry.lower().replace(" ", "")
        unit = spelled[-1] if spelled[-1] in "kx" else ""
        if unit == "x" and reference is None:
            raise ValueError(f"--lengths {entry}: a multiple like 2x needs a reference length (a training run's, recall's --seq-len) and there is none here; give {accepted}")
        try:
            tokens = round(float(spelled[:-1]) * (KILO if unit == "k" else reference)) if unit else int(spelled)
        except (ValueError, OverflowError):  # abc, 1.5 (no unit), infk, nanx: no token count
            raise ValueError(f"--lengths: {entry!r} is not a length; give {accepted}") from None
        if tokens < 1:
            raise ValueError(f"--lengths {entry}: a length is at least 1 token, got {tokens}")
        twice = next((first for first, n in parsed if n == tokens), None)
        if twice is not None:
            raise ValueError(f"--lengths lists {tokens} tokens twice ({twice} and {entry}); give each length once")
        parsed.append((entry, tokens))
    return parsed


def parse_depths(text: str) -> list[float]:
    """``"0,0.5,1"`` -> fractions of the haystack in [0, 1], in the order given; ValueError naming
    ``--depths`` and the accepted form otherwise (two depths in one cell included)."""
    try:
        depths = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        depths = []
    if not depths or any(not (0.0 <= d <= 1.0) for d in depths) or len(set(depths)) != len(depths):
        raise ValueError(f"--depths must be {DEPTHS_SYNTAX}, got {text!r}")
    cells: dict[str, float] = {}
    for depth in depths:  # a cell is named by its depth to 2 decimals (cell_id): two depths there would be one cell
        if f"{depth:.2f}" in cells:
            raise ValueError(f"--depths {cells[f'{depth:.2f}']:g} and {depth:g} are one cell (depth {depth:.2f}): give depths at least 0.01 apart")
        cells[f"{depth:.2f}"] = depth
    return depths


def parse_tasks(text: str, choices: Iterable[str]) -> list[str]:
    """``"s1,s2"`` -> task names in the order given, each of ``choices`` at most once; ``all`` =
    every choice. ValueError naming ``--tasks`` and the choices otherwise."""
    choices = list(choices)
    names = [part.strip().lower() for part in str(text).split(",") if part.strip()]
    if names == ["all"]:
        return choices
    for name in names:
        if name not in choices:
            raise ValueError(f"--tasks: {name!r} is not allowed; allowed values: {', '.join(choices)} (or all)")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--tasks must name each of {', '.join(choices)} at most once, got {text!r}")
    return names


class Cell(NamedTuple):
    """One cell of the grid: a task at one prompt length and needle depth."""

    task: str
    length: int
    depth: float


def cell_id(task: str, length: int, depth: float) -> str:
    """The cell's name in reports: ``task/length/depth`` with the depth to 2 decimals."""
    return f"{task}/{length}/{depth:.2f}"


def grid_cells(tasks: Iterable[str], lengths: Iterable[int], depths: Iterable[float]) -> list[Cell]:
    """Every cell, task by task, then length by length, then depth by depth (the order they run)."""
    lengths, depths = list(lengths), list(depths)
    return [Cell(task, length, depth) for task in tasks for length in lengths for depth in depths]


def build_prompts(cells: Sequence[Cell], samples: int, build: Callable[[Cell, int], Prompt]) -> dict[Cell, list[Prompt]]:
    """``build(cell, sample)`` for every cell and sample, before any model runs (a bad length or
    depth fails before the first generation)."""
    return {cell: [build(cell, sample) for sample in range(samples)] for cell in cells}


def run_grid(cells: Sequence[Cell], measure: Callable[[Cell], Result], keep: Callable[[Cell, Result], None], *,
             done: Container[Cell] = frozenset(), desc: str = "niah", progress: bool = True) -> None:
    """Measure each cell not in ``done`` in order and hand the result to ``keep`` (which may write
    it at once, so an interrupted run resumes), with one progress bar over the whole grid."""
    todo = [cell for cell in cells if cell not in done]
    with tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="cell", disable=not progress) as bar:
        for cell in todo:
            keep(cell, measure(cell))
            bar.update()


def grid_table(lengths: Sequence[int], depths: Sequence[float], score: Callable[[int, float], float], *,
               summary: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """Markdown: one row per depth, one column per length, each cell ``score(length, depth)`` to 2
    decimals, then the ``summary`` rows (label, one text per length)."""
    rows = [[f"{d:.2f}", *(f"{score(n, d):.2f}" for n in lengths)] for d in depths]
    rows += [[label, *texts] for label, texts in summary]
    return markdown_table(["depth", *lengths], rows, align="right")


def plot_grids(panels: Mapping[str, np.ndarray], lengths: Sequence[int], depths: Sequence[float], path: str | Path, *,
               length_labels: Mapping[str, Sequence[str]] | None = None, xlabel: str = "prompt tokens", suptitle: str = "") -> None:
    """One heatmap per panel (title -> scores of shape (depths, lengths), in [0, 1]), the score
    annotated in each cell; ``length_labels``: the x tick labels per panel (default the lengths);
    atomic PNG."""
    width = max(3.0, 0.9 * len(lengths) + 1.0)
    fig, axes = new_figure(1, len(panels), figsize=(width * len(panels) + 1.0, 2.0 + 0.45 * len(depths)), squeeze=False, layout="constrained")
    for index, (ax, (title, grid)) in enumerate(zip(axes[0], panels.items())):
        grid = np.asarray(grid, dtype=float)
        if grid.shape != (len(depths), len(lengths)):
            raise ValueError(f"panel {title!r} has scores of shape {grid.shape}, not (depths, lengths) = ({len(depths)}, {len(lengths)})")
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black", fontsize=8)
        ax.set_xticks(range(len(lengths)), list(length_labels[title]) if length_labels else [str(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        if index == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(title, fontsize=8)
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03)
    save_figure(fig, path)
