"""The committed bounded-memory conversion results: the markdown is what benchmarks/convert_kvm.py
renders from its JSON, and a few figures are read straight from the JSON."""

from __future__ import annotations

import json

import pytest

from slimkv.common.results import results_dir
from tests.helpers import BENCHMARKS, load_benchmark

NAME = "convert_kvm_smollm2"
RESULTS = results_dir(BENCHMARKS / "results", NAME)


@pytest.fixture(scope="module")
def script():
    return load_benchmark("convert_kvm.py")


def test_the_markdown_is_what_the_json_renders(script):
    data = script.read_results(RESULTS / f"{NAME}.json")
    committed = (RESULTS / f"{NAME}.md").read_text()
    assert committed == script.format_markdown(data["settings"], data["rows"]), f"run benchmarks/convert_kvm.py to regenerate {NAME}.md"


def test_the_ratios_follow_from_the_perplexities():
    data = json.loads((RESULTS / f"{NAME}.json").read_text())
    original = next(row for row in data["rows"] if row["label"] == "original")
    for row in data["rows"]:
        for text, result in row["texts"].items():
            assert result["ppl_vs_original"] == pytest.approx(result["ppl"] / original["texts"][text]["ppl"])


def test_a_run_names_its_cache_ratio_after_an_at_sign(script):
    assert script.split_ratio("mla-kvm:min_rows=192@0.75") == ("mla-kvm:min_rows=192", 0.75)
    assert script.split_ratio("kvm:min_rows=512") == ("kvm:min_rows=512", None)
    with pytest.raises(SystemExit, match="must be a cache ratio"):
        script.split_ratio("mla-kvm@half")


def test_the_committed_runs_read_in_todays_words(script):
    """The file was written before the renames: its methods read as today's, the old kvm defaults written out."""
    data = script.read_results(RESULTS / f"{NAME}.json")
    methods = {row["label"]: row["method"] for row in data["rows"]}
    assert methods["kvm"] == f"kvm:{script.KVM_RECIPE}" and methods["mla75-kvm"] == f"mla-kvm:{script.KVM_RECIPE},min_rows=192@0.75"
    assert data["settings"]["runs"]["kvm-rows1024"] == f"kvm:{script.KVM_RECIPE},min_rows=1024"
