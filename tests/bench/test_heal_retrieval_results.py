"""The committed healing-retrieval page (benchmarks/heal_retrieval.py) is what the script renders from its JSON, and
every model row on it names a conversion folder's healing as its manifest recorded it (tokens > 0 for a healed one)."""

from __future__ import annotations

import json

from slimkv.common.results import results_path
from tests.helpers import BENCHMARKS, load_benchmark

RESULTS = BENCHMARKS / "results"
NAME = "heal_retrieval_smollm2"


def test_the_page_is_what_the_json_renders():
    path = results_path(RESULTS, f"{NAME}.json")
    script = load_benchmark("heal_retrieval.py")
    payload = json.loads(path.read_text())
    assert results_path(RESULTS, f"{NAME}.md").read_text() == script.render(payload), "run benchmarks/heal_retrieval.py --report"
    healed = [m for m, entry in payload["models"].items() if entry["healing"]["tokens"] > 0]
    assert healed, "the comparison needs at least one healed conversion"
    assert all(payload["models"][m]["healing"]["seq_len"] for m in healed)
    for model in payload["models"]:  # every model measured at every length, beside the original
        assert {r["length"] for r in payload["copy"] if r["model"] == model} == set(payload["settings"]["lengths"])
    assert {r["length"] for r in payload["copy"] if r["model"] == script.ORIGINAL} == set(payload["settings"]["lengths"])
