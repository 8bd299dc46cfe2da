"""The committed head-choice screen (benchmarks/hybrid_heads.py): its page is what the script renders from the JSON,
every conversion kept the same number of exact heads (the comparison is at equal bytes), and the default score the
docs name is the one that copied best on average over the lengths measured."""

from __future__ import annotations

import json

from slimkv.common.results import results_path
from slimkv.convert.hybrid import METHOD_OPTIONS
from tests.helpers import BENCHMARKS, load_benchmark

RESULTS = BENCHMARKS / "results"
NAME = "convert_hybrid_heads_smollm2"


def test_the_page_is_what_the_json_renders_and_the_default_copied_best():
    script = load_benchmark("hybrid_heads.py")
    payload = json.loads(results_path(RESULTS, f"{NAME}.json").read_text())
    assert results_path(RESULTS, f"{NAME}.md").read_text() == script.render(payload), "run benchmarks/hybrid_heads.py --report"
    rows = [r for r in payload["rows"] if r["model"] != script.ORIGINAL]
    assert len({r["exact_heads"] for r in rows}) == 1
    by_model: dict[str, list[float]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row["mean"])
    best = max(by_model, key=lambda model: sum(by_model[model]) / len(by_model[model]))
    assert best == f"score={METHOD_OPTIONS['score']}"
