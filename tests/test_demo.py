"""``slimkv demo``: its entries name registered kinds with valid options at the demo recipe, and
the recipe is short; unknown entries are refused before any work."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import ATTENTION_KINDS, build_attention
from slimkv.bench.entries import parse_entries
from slimkv.bench.recall import check_entries
from slimkv.demo import DEMO_RECALL_ENTRIES, demo_entries, demo_recipe, run_demo
from slimkv.eval.recall import RecallRecipe


def test_every_demo_entry_builds_with_the_recipe():
    recipe = demo_recipe()
    entries = parse_entries(list(demo_entries()), recipe)
    kinds = {k for e in entries for k in e.kinds}
    assert kinds == {"mha", "gqa", "mqa", "swa", "mla", "lrkv", "kvm"} and kinds <= set(ATTENTION_KINDS)
    mha = build_attention("mha", recipe.d_model, recipe.n_heads)
    ratios = {}
    torch.manual_seed(0)
    for entry in entries:
        for kind in entry.kinds:
            attn = build_attention(kind, recipe.d_model, recipe.n_heads, **entry.options[kind])
            ratios[entry.label] = attn.cache_bytes(recipe.seq_len) / mha.cache_bytes(recipe.seq_len)
    assert ratios["lrkv"] == pytest.approx(0.5)  # lrkv at about 50% of MHA's cache
    assert {e.label: e.options for e in entries}["kvm:schedule=sqrt"]["kvm"]["schedule"] == "sqrt"
    assert recipe.steps <= 120 and recipe.dataset == "shakespeare"  # short: at most the default recipe


def test_unknown_demo_entry_is_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match=r"--kinds: 'mla2' is not a demo entry; allowed values: mha, gqa"):
        run_demo(tmp_path / "demo", kinds=["mla2"])
    assert not (tmp_path / "demo").exists()


def test_recall_demo_runs_on_a_tiny_recipe(tmp_path, monkeypatch):
    monkeypatch.setattr("slimkv.demo.DEMO_RECALL_STEPS", 3)
    monkeypatch.setattr("slimkv.demo.DEMO_RECALL_ENTRIES", ("mha", "swa:window=16"))
    report = run_demo(tmp_path / "demo", parts=("recall",), progress=False)
    assert report == {} and (tmp_path / "demo" / "recall" / "report.md").is_file()
    recall = (tmp_path / "demo" / "recall" / "report.json").read_text()
    assert '"swa:window=16"' in recall


def test_recall_demo_entries_build():
    recipe = RecallRecipe()
    entries = parse_entries(list(DEMO_RECALL_ENTRIES), recipe, check=lambda e: check_entries([e], recipe))
    assert len(entries) == len(DEMO_RECALL_ENTRIES) >= 3
