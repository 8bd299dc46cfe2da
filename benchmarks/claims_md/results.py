"""Views of the two trained-model results files every claim section reads: the recall frontier
(``Recall``) and the LM frontier (``Frontier``)."""

from __future__ import annotations

from typing import Any

from .rules import seed_verdict, word
from .text import acc, bpb, join_words, table


class Recall:
    """recall_frontier.json: one aggregate row and the seed runs per entry."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d
        self.rows = {row["label"]: row for row in d["aggregate"]}
        self.entries = {entry["label"]: entry for entry in d["entries"]}
        self.lengths = [f"{n}x" for n in d["recipe"]["lengths"]]

    def stat(self, label: str, length: str) -> dict[str, Any]:
        return self.rows[label]["lengths"][length]["accuracy"]

    def cache(self, label: str, length: str = "1x") -> float:
        return self.rows[label]["lengths"][length]["cache_bytes_per_token"]

    def solved(self, label: str) -> int:
        return self.rows[label]["lengths"]["1x"]["solved_seeds"]

    def seeds(self, label: str) -> int:
        return len(self.rows[label]["seeds"])

    def runs(self, label: str) -> list[dict[str, Any]]:
        return sorted((r for r in self.d["runs"] if r["label"] == label), key=lambda r: r["seed"])

    def labels(self, kinds: tuple[str, ...]) -> list[str]:
        return [label for label, e in self.entries.items() if tuple(e["kinds"]) == kinds]

    def row(self, label: str) -> list[str]:
        return [f"`{label}`", f"{self.cache(label):.0f}"] + [acc(self.stat(label, n)) for n in self.lengths] + [f"{self.solved(label)}/{self.seeds(label)}"]

    def table(self, labels: list[str]) -> str:
        return table(["entry", "B/token at 1x"] + [f"accuracy {n}" for n in self.lengths] + ["solved"], [self.row(x) for x in labels], right={1, 2, 3, 4, 5})

    def against(self, label: str, other: str) -> dict[str, int]:
        return {n: seed_verdict(self.stat(label, n), self.stat(other, n)) for n in self.lengths}


def describe_against(verdicts: dict[str, int]) -> str:
    """Per-length verdicts (``Recall.against``) in words: "higher at 2x; within the spread at 1x and 4x"."""
    higher = [n for n, v in verdicts.items() if v > 0]
    lower = [n for n, v in verdicts.items() if v < 0]
    level = [n for n, v in verdicts.items() if v == 0]
    parts = []
    if higher:
        parts.append(f"higher at {join_words(higher)}")
    if lower:
        parts.append(f"lower at {join_words(lower)}")
    if level:
        parts.append(f"within the spread at {join_words(level)}")
    return "; ".join(parts)


class Frontier:
    """lm_frontier.json: seed statistics of val BPB (in domain) and Austen BPB (out of domain)."""

    METRICS = (("val_bpb", "val BPB"), ("other_bpb", "Austen BPB"))

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d
        self.rows = {row["label"]: row for row in d["aggregate"]}

    def cache(self, label: str) -> float:
        return self.rows[label]["cache"]["bytes_per_token_per_layer"]

    def ratio(self, label: str) -> float:
        return self.rows[label]["cache"]["ratio_to_mha"]

    def against(self, label: str, other: str) -> dict[str, int]:
        return {metric: seed_verdict(self.rows[label][metric], self.rows[other][metric]) for metric, _ in self.METRICS}

    def table(self, reference: str = "mha") -> str:
        rows = []
        for label, row in self.rows.items():
            verdicts = ["reference" if label == reference else word(v, "higher (worse)", "**lower (better)**")
                        for v in self.against(label, reference).values()]
            rows.append([f"`{label}`", f"{self.cache(label):.0f}", f"{self.ratio(label):.3f}", bpb(row["val_bpb"]), verdicts[0], bpb(row["other_bpb"]), verdicts[1]])
        return table(["entry", "B/token/layer", "of MHA's cache", "val BPB", f"vs {reference}", "Austen BPB", f"vs {reference}"], rows, right={1, 2})
