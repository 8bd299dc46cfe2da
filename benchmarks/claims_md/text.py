"""Reading the results files and writing their figures: one spelling of each number format for every section."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


def load(name: str) -> dict[str, Any]:
    """The JSON file ``name`` of benchmarks/results/."""
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def link(name: str) -> str:
    """A Markdown link to the results file ``name`` (claims.md sits beside it)."""
    return f"[`{name}`]({name})"


def when(d: dict[str, Any]) -> str:
    """Threads, 1-minute load average and date of a results file written by ``write_results``."""
    machine = d.get("machine", {})
    parts = [f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}"] if machine.get("threads") else []
    load_average = machine.get("load_average") or d.get("load_average")
    parts.append(f"load {load_average[0]:.2f} when written" if load_average else "load not recorded")
    if d.get("time"):
        parts.append(d["time"][:10])
    return ", ".join(parts)


def f2(x: float) -> str:
    """Two decimals."""
    return f"{x:.2f}"


def f3(x: float) -> str:
    """Three decimals."""
    return f"{x:.3f}"


def times(x: float) -> str:
    """A factor: ``16.4x``, ``2.35x`` below 10."""
    return f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def pct(x: float) -> str:
    """A fraction as a whole percentage."""
    return f"{100 * x:.0f}%"


def pct1(x: float) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{100 * x:.1f}%"


def ppl(x: float) -> str:
    """A perplexity: two decimals, or ``1.2e5`` from 10,000 on."""
    if x < 1e4:
        return f"{x:.2f}"
    exponent = math.floor(math.log10(x))
    return f"{x / 10**exponent:.1f}e{exponent}"


def acc(stat: dict[str, Any]) -> str:
    """An accuracy over seeds as the recall report prints it: mean [min, max]."""
    return f"{stat['mean']:.3f} [{stat['min']:.2f}, {stat['max']:.2f}]" if stat["n"] > 1 else f"{stat['mean']:.3f}"


def bpb(stat: dict[str, Any]) -> str:
    """A BPB over seeds: mean ± std [min, max]."""
    return f"{stat['mean']:.4f} ± {stat['std']:.4f} [{stat['min']:.4f}, {stat['max']:.4f}]"


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """A Markdown table; the columns in ``right`` are right-aligned."""
    align = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def join_words(words: list[str]) -> str:
    """``a, b and c``."""
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]
