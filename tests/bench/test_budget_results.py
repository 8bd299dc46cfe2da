"""The committed ``convert --cache-budget`` results: the markdown pages are what
benchmarks/budget_smollm2.py renders from the JSON, and each conversion met its budget."""

from __future__ import annotations

import json

import pytest

from slimkv.common.results import results_path
from tests.helpers import BENCHMARKS, load_benchmark

RESULTS = BENCHMARKS / "results"


@pytest.fixture(scope="module")
def script():
    return load_benchmark("budget_smollm2.py")


def test_the_pages_are_what_the_json_renders(script):
    payload = json.loads(results_path(RESULTS, "budget_smollm2.json").read_text())
    assert results_path(RESULTS, "budget_smollm2.md").read_text() == script.render(payload), "run benchmarks/budget_smollm2.py report"
    assert results_path(RESULTS, "budget_comparison.md").read_text() == script.render_ruler(script.ruler_rows()), "run benchmarks/budget_smollm2.py report"


def test_every_conversion_met_its_budget_at_its_length():
    for row in json.loads(results_path(RESULTS, "budget_smollm2.json").read_text())["rows"]:
        at = {r["context"]: r for r in row["cache_bytes"]}[row["plan"]["at"]]
        assert at["measured"] and at["ratio"] <= row["budget"] and at["ratio"] == pytest.approx(row["plan"]["predicted_fraction"], abs=1e-12)
