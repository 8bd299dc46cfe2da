"""The retrieval comparison (slimkv.retrieval.comparison): rows from slimkv reports and from other tools'
generations scored alike, winners only where the samples separate them, and the committed
markdown equal to what its JSON renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from slimkv.common.files import read_json
from slimkv.retrieval.comparison import aggregate, comparison, generations_row, render_markdown, slimkv_row, winners

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "niah"


def fake_report(scores: dict[tuple[str, int], list[float]], ratio: float | None) -> dict:
    identity = {"name": "x"} if ratio is None else {"name": "x", "converted": {"method": "mla", "cache_ratio": ratio, "achieved_cache_ratio": ratio, "healing": None}}
    cells = {f"{t}/{n}/0.50": {"task": t, "length": n, "scores": s, "seconds": 1.0} for (t, n), s in scores.items()}
    return {"settings": {"identity": identity, "model": "x"}, "cells": cells, "cache": {"1024": {"bytes_per_token": 100.0 if ratio is None else 100.0 * ratio}}}


def test_aggregate_pools_tasks_and_counts_full_answers():
    stats = aggregate([("passkey", 1024, 1.0), ("needle", 1024, 0.5), ("passkey", 2048, 0.0)])
    assert stats["per_length"]["1024"]["score"] == 0.75 and stats["per_length"]["1024"]["full"] == 1
    assert stats["per_task"]["needle/1024"]["prompts"] == 1


def test_external_generations_are_scored_with_slimkv_rules():
    prompts = {"a": {"task": "passkey", "length": 1024, "answers": ["12345"]}, "b": {"task": "passkey", "length": 1024, "answers": ["54321"]}}
    generations = {"label": "kvpress snapkv budget 0.5", "method": "kvpress", "cache_budget": 0.5,
                   "generations": [{"id": "a", "output_text": " 12345.", "cache_bytes": 500, "cache_tokens": 10},
                                   {"id": "b", "output_text": " 543210", "cache_bytes": 700, "cache_tokens": 10}]}
    row = generations_row(generations, prompts, "x.json")
    assert row["per_length"]["1024"]["score"] == 0.5  # 543210 does not contain the value as a whole
    assert row["bytes_per_token"]["1024"] == 60.0


def test_a_winner_is_named_separated_only_when_the_intervals_allow():
    strong = slimkv_row(fake_report({("passkey", 1024): [1.0] * 40}, 0.5), "strong", "s")
    weak = slimkv_row(fake_report({("passkey", 1024): [0.0] * 40}, 0.5), "weak", "w")
    few = slimkv_row(fake_report({("passkey", 1024): [1.0] * 3}, 0.5), "few", "f")
    none = slimkv_row(fake_report({("passkey", 1024): [0.0] * 2}, 0.5), "none", "n")
    assert winners([strong, weak])[0] == {"cache_budget": 0.5, "length": 1024, "best": "strong", "score": 1.0, "separated": True, "rows": 2}
    assert winners([few, none])[0]["separated"] is False  # 3/3 against 0/2: the samples cannot tell
    tie = winners([strong, slimkv_row(fake_report({("passkey", 1024): [1.0] * 40}, 0.5), "twin", "t")])[0]
    assert tie["best"] == "strong = twin" and tie["separated"] is False  # rows that tie separate from nothing
    text = render_markdown(comparison([few, none], {"tasks": ["passkey"], "depths": [0.5], "samples": 1, "seed": 0}, {"note": "n"}))
    assert "not separated" in text and "| few | slimkv | 0.50 | 0.5000 | 50 | 1.00 (3/3, 0.44-1.00) |" in text


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("niah*_smollm2.json")))
def test_each_committed_comparison_is_what_its_json_renders(name):
    data = read_json(RESULTS / f"{name}.json", expect=dict)
    assert (RESULTS / f"{name}.md").read_text(encoding="utf-8") == render_markdown(data)
