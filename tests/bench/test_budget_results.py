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
