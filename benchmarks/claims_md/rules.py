"""The verdict rules of claims.md as data: every threshold and target, the two comparisons every verdict
rests on, and the words a verdict is written with. The page quotes its thresholds from here."""

from __future__ import annotations

from typing import Any

from slimkv.bench.statistics import MIN_SEEDS_FOR_CLAIM, compare_pair

RULES: dict[str, float] = {
    "min_seeds": MIN_SEEDS_FOR_CLAIM,  # trained models: seeds per side before A may differ from B (slimkv compare's rule)
    "ppl_margin": 0.10,  # deterministic procedures: a perplexity gap counts when it exceeds this fraction on every text
    "solved": 0.9,  # recall: a seed solves the task at >= this accuracy at the training length
    "past_window_seeds": 2,  # retrieval past the window: seeds that solve the task, each above every SWA seed far back
    "exponent_flat": 0.2,  # decode time ~ context^e: "flat" (O(1)) when e is below this
    "exponent_sqrt": 0.6,  # "at most O(sqrt N)" when e is below this (0.5 plus timing noise)
    "much_faster": 2.0,  # decode: every run's speed-up over MHA at the longest context above this
    "state_context": 8192,  # bounded memory: the context at which the state is set against the original's cache
    "state_target": 1 / 8,  # bounded memory: the state there over the original's cache
    "niah_margin": 0.30,  # bounded memory: retrieval score above streaming's at no more bytes
    "decode_target": 3.0,  # bounded memory: tokens/s over transformers' at the longest context, with a flat cache
    "task_solved": 0.5,  # retrieval under a budget: a RULER (task, length) counts when the original's score interval lies above this
}
# retrieval under a budget: a --cache-budget plan's RULER score over the original's, by budget
BUDGET_RETENTION: dict[float, float] = {0.25: 0.95, 0.125: 0.85}
# perplexity over the original's, in domain (the first text) and out of domain, within minutes of healing
CONVERSION_TARGETS: list[dict[str, Any]] = [
    {"method": "latent", "ratio": 0.5, "healed": False, "in_domain": 1.15, "out_of_domain": 1.15, "minutes": 0},
    {"method": "latent", "ratio": 0.5, "healed": True, "in_domain": 1.03, "out_of_domain": 1.08, "minutes": 30},
    {"method": "latent", "ratio": 0.25, "healed": True, "in_domain": 1.3, "out_of_domain": 1.3, "minutes": 60},
]
BOUNDED_TARGET: dict[str, Any] = {"in_domain": 1.15, "out_of_domain": 1.25, "minutes": 60}  # KVM on SmolLM2, 4K windows
WORDS: dict[str, tuple[str, str, str]] = {  # a verdict's sign (-1, 0, +1; False, True) in words, by the template's spec
    "claim": ("not supported", "inconclusive", "supported"),
    "target": ("**missed**", "-", "**met**"),
    "higher": ("lower", "within the spread", "higher"),
    "worse": ("**lower (better)**", "within the spread", "higher (worse)"),
    "than": ("better than", "level with", "worse than"),
    "beats": ("beats", "not separated", "loses"),
}


def seed_verdict(a: dict[str, Any], b: dict[str, Any]) -> int:
    """+1 when statistic ``a`` is higher than ``b`` by the seed rule, -1 when lower, 0 when the seeds
    do not resolve it: ``slimkv.bench.statistics.compare_pair``, the rule ``slimkv compare`` applies."""
    verdict = compare_pair({"label": "a", "x": a}, {"label": "b", "x": b}, "x")
    return 0 if verdict["verdict"].startswith(("within", "no claim")) else 1 if verdict["delta_bpb"] > 0 else -1


def ppl_verdict(a: dict[str, float], b: dict[str, float]) -> int:
    """-1 when perplexities ``a`` are lower than ``b`` by more than the margin on every text of ``b``,
    +1 when higher by that much on every text, 0 otherwise."""
    gaps = [a[text] / b[text] - 1 for text in b]
    return -1 if all(g < -RULES["ppl_margin"] for g in gaps) else 1 if all(g > RULES["ppl_margin"] for g in gaps) else 0


def missed(over_original: dict[str, float], target: dict[str, Any], minutes: float = 0) -> list[str]:
    """The texts on which perplexity / the original's misses ``target``, and ``time`` when healing took too long."""
    first = next(iter(over_original))
    return [t for t, x in over_original.items() if x > target["in_domain" if t == first else "out_of_domain"]] + ["time"] * (minutes > target["minutes"])

