"""The committed ``convert --cache-budget`` results: the markdown pages are what
benchmarks/budget_smollm2.py renders from the JSON, and each conversion met its budget."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("budget_smollm2_under_test", BENCHMARKS / "budget_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_pages_are_what_the_json_renders(script):
    payload = json.loads((RESULTS / "budget_smollm2.json").read_text())
    assert (RESULTS / "budget_smollm2.md").read_text() == script.render(payload), "run benchmarks/budget_smollm2.py report"
    assert (RESULTS / "ruler" / "budget_comparison.md").read_text() == script.render_ruler(script.ruler_rows()), "run benchmarks/budget_smollm2.py report"


def test_every_conversion_met_its_budget_at_its_length():
    for row in json.loads((RESULTS / "budget_smollm2.json").read_text())["rows"]:
        at = {r["context"]: r for r in row["cache_bytes"]}[row["plan"]["at"]]
        assert at["measured"] and at["ratio"] <= row["budget"] and at["ratio"] == pytest.approx(row["plan"]["predicted_fraction"], abs=1e-12)
