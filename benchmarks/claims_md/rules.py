"""The verdict rules of claims.md: the thresholds and the two comparisons every verdict rests on."""

from __future__ import annotations

from typing import Any

from slimkv.bench.statistics import compare_pair

PPL_MARGIN = 0.10  # deterministic procedures: a perplexity gap counts when it exceeds this fraction on every text
SOLVED = 0.9  # recall: a seed solves the task at >= 90% at 1x (slimkv eval recall's definition)
NEEDLES_TARGET = 0.9  # the needles-in-prose target the recipe search aimed at
CONTEXT_EXPONENT_FLAT = 0.2  # decode time ~ context^e: "flat" (O(1)) when e is below this
CONTEXT_EXPONENT_SQRT = 0.6  # "at most O(sqrt N)" when e is below this (0.5 plus timing noise)
MUCH_FASTER = 2.0  # decode: "much faster than full attention" when every run's speed-up at the longest context exceeds this


def seed_verdict(a: dict[str, Any], b: dict[str, Any]) -> int:
    """+1 when statistic ``a`` is higher than ``b`` by the seed rule, -1 when lower, 0 when the
    seeds do not resolve it (fewer than 3 seeds, overlapping ranges, or a gap within the stds).
    The rule is ``slimkv.bench.statistics.compare_pair``, the one ``slimkv compare`` applies."""
    verdict = compare_pair({"label": "a", "x": a}, {"label": "b", "x": b}, "x")
    if verdict["verdict"].startswith(("within", "no claim")):
        return 0
    return 1 if verdict["delta_bpb"] > 0 else -1


def ppl_verdict(a: dict[str, float], b: dict[str, float]) -> int:
    """-1 when perplexities ``a`` are lower than ``b`` by more than ``PPL_MARGIN`` on every text,
    +1 when higher by that much on every text, 0 otherwise."""
    gaps = [a[text] / b[text] - 1 for text in b]
    if all(g < -PPL_MARGIN for g in gaps):
        return -1
    if all(g > PPL_MARGIN for g in gaps):
        return 1
    return 0


def word(sign: int, higher: str, lower: str, level: str = "within the spread") -> str:
    """The word for a verdict's sign: ``higher`` for +1, ``lower`` for -1, ``level`` for 0."""
    return higher if sign > 0 else lower if sign < 0 else level
