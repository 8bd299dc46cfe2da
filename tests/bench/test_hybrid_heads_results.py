"""The committed head-choice screens (benchmarks/hybrid_heads.py): each page is what the script renders from its JSON;
in the score screen every conversion kept the same number of exact heads (the comparison is at equal bytes) and the
default score the docs name is the one that copied best on average over the lengths measured; the storage screen read
every conversion through its own cache (what a storage changes is only seen there)."""

from __future__ import annotations

import json

import pytest

from slimkv.common.results import results_path
from slimkv.convert.hybrid import METHOD_OPTIONS
from slimkv.ops.quantize import parse_storage
from tests.helpers import BENCHMARKS, load_benchmark

RESULTS = BENCHMARKS / "results"
NAME = "convert_hybrid_heads_smollm2"
STORAGE_NAME = "convert_hybrid_heads_storage_smollm2"


@pytest.mark.parametrize("name", [NAME, STORAGE_NAME])
def test_the_page_is_what_the_json_renders(name):
    script = load_benchmark("hybrid_heads.py")
    payload = json.loads(results_path(RESULTS, f"{name}.json").read_text())
    assert results_path(RESULTS, f"{name}.md").read_text() == script.render(payload, name), f"run benchmarks/hybrid_heads.py --name {name} --report"


def test_the_default_score_copied_best_at_equal_heads():
    script = load_benchmark("hybrid_heads.py")
    payload = json.loads(results_path(RESULTS, f"{NAME}.json").read_text())
    rows = [r for r in payload["rows"] if r["model"] != script.ORIGINAL]
    assert len({r["exact_heads"] for r in rows}) == 1
    by_model: dict[str, list[float]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row["mean"])
    best = max(by_model, key=lambda model: sum(by_model[model]) / len(by_model[model]))
    assert best == f"score={METHOD_OPTIONS['score']}"


def test_the_storage_screen_read_each_storage_through_its_cache():
    payload = json.loads(results_path(RESULTS, f"{STORAGE_NAME}.json").read_text())
    assert payload["settings"]["through_cache"] and len(payload["settings"]["storages"]) > 1
    converted = [r for r in payload["rows"] if r["model"] != "original"]
    assert {r["storage"] for r in converted} == {parse_storage(name).name for name in payload["settings"]["storages"]}
