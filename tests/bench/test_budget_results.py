"""The committed ``convert --cache-budget`` results: the markdown pages are what
benchmarks/budget_smollm2.py renders from the JSON, and each conversion met its budget."""

from __future__ import annotations

import json

import pytest

from slimkv.common.results import results_path
from slimkv.scoring import wilson
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
        # a quantized cache is measured live at conversion; a full-storage one is the model's own count (cache_bytes_table), which
        # tests/convert/test_budget.py checks against a live cache and RULER measures again after every prompt
        assert at["measured"] or row["plan"]["storage"] == "full"
        assert at["ratio"] <= row["budget"] and at["ratio"] == pytest.approx(row["plan"]["predicted_fraction"], abs=1e-12)


def test_rows_are_labelled_from_the_manifest_as_the_command_spells_them(script):
    planned = {"budget_plan": {"budget": 0.125, "storage": "int4:group=32", "exact_heads": 30}, "method_options": {"score": "combined"},
               "healing": {"config": {"tokens": 65536}}}
    assert script.conversion_label(planned) == "convert --cache-budget 0.125 (int4, 30 exact heads by combined, healed 65536 tokens)"
    healed = {"method": "mla", "cache_ratio": 0.5, "healing": {"config": {"tokens": 65536, "copy_fraction": 0.5}}}
    assert script.conversion_label(healed) == "convert --to mla --cache-ratio 0.5, healed 65536 tokens, copy fraction 0.5"
    assert (script.conversion_label({"method": "latent", "cache_ratio": 0.5, "cache_storage": "int4:group=32,residual=128", "budget_plan": None})
            == "convert --to latent --cache-ratio 0.5 --cache-storage int4")
    assert script.conversion_label({"method": "kvm", "cache_ratio": None, "cache_storage": "full"}) == "convert --to kvm"
    options = {"split": "rule", "rope_placement": "decoupled", "rope_pairs": None}  # the manifest keeps every option; the label the changed ones
    assert (script.conversion_label({"method": "lrkv", "cache_ratio": 0.5, "method_options": options})
            == "convert --to lrkv:rope_placement=decoupled --cache-ratio 0.5")
    assert (script.compression_label({"method": "latentllm", "ratio": 0.2})
            == "compress --method latentllm --ratio 0.2 (weights; the cache is the original's)")


def test_no_compressed_or_converted_model_is_labelled_the_original(script):
    for row in script.ruler_rows():
        if row["method"] == "original":
            assert row["ratio"] == 2.0  # the float32 original's own cache, against its bfloat16 bytes


def test_the_ranking_places_methods_by_measured_bytes_and_names_no_winner_inside_the_intervals(script):
    def row(method, ratio, full, n=40, task="niah_single_1", option="none"):
        low, high = wilson(full, n)
        return {"method": method, "task": task, "length": 4096, "ratio": ratio, "score": full / n, "low": low, "high": high, "option": option}

    rows = [row("original", 2.0, 40), row("original, bfloat16 model", 1.0, 40), row("plan a", 0.27, 38), row("press b", 0.25, 38, option="press:b@0.25"),
            row("press c", 0.25, 10, option="press:c@0.25"), row("plan d", 0.14, 30), row("wide e", 0.5, 40),
            row("original", 2.0, 5, task="niah_multikey_3"), row("plan a", 0.27, 4, task="niah_multikey_3")]
    table = [line.split(" | ") for line in "\n".join(script.ranking(rows)).splitlines() if line.startswith("| niah")]
    ranked = [(cells[2], cells[3], cells[4], cells[-2], cells[-1].rstrip(" |")) for cells in table]
    assert ranked == [("0.25", "1", "press b", "0.95", "no"), ("0.25", "1", "plan a", "0.95", "no"),  # equal scores: one rank, fewer bytes first
                      ("0.25", "3", "press c", "0.25", "yes"),  # its interval below the best's
                      ("0.125", "1", "plan d", "0.75", "no")]  # 0.5 and the originals are in no ranked tier; multikey_3's original fails
