"""``slimkv demo``: its entries name registered kinds with valid options at the demo recipe, and
the recipe is short; unknown entries are refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

from slimkv.attention import ATTENTION_KINDS, build_attention
from slimkv.bench.entries import parse_entries
from slimkv.demo import DEMO_RECALL_ENTRIES, demo_entries, demo_recipe, run_demo
from slimkv.recall.frontier import check_entries
from slimkv.recall.recipe import RecallRecipe


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


def test_a_bad_worker_count_is_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match=r"--workers must be an integer >= 1, got 0"):
        run_demo(tmp_path / "demo", workers=0)
    assert not (tmp_path / "demo").exists()


def test_recall_demo_entries_build():
    recipe = RecallRecipe()
    entries = parse_entries(list(DEMO_RECALL_ENTRIES), recipe, check=lambda e: check_entries([e], recipe))
    assert len(entries) == len(DEMO_RECALL_ENTRIES) >= 3


def test_retrieval_demo_asks_the_original_and_the_conversion(tmp_path, monkeypatch, capsys):
    """The retrieval part on a tiny local Llama standing in for SmolLM2 (a conversion folder absent:
    the original alone)."""
    from transformers import AutoModelForCausalLM

    from tests.retrieval.test_models import char_tokenizer, tiny_config

    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    folder = tmp_path / "tiny"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    monkeypatch.setattr("slimkv.demo.SMOLLM2", str(folder))
    monkeypatch.setattr("slimkv.demo.fetch_smollm2", lambda: None)
    monkeypatch.setattr("slimkv.demo.DEMO_RETRIEVAL", {"tasks": ("passkey",), "lengths": (400, 500), "depths": (0.25,), "samples": 1})
    run_demo(tmp_path / "demo", parts=("retrieval",), progress=False)
    assert (tmp_path / "demo" / "retrieval" / "original" / "niah.json").is_file()
    timings = json.loads((tmp_path / "demo" / "demo_timings.json").read_text())
    assert list(timings["parts"]) == ["retrieval"] and timings["total"]["wall_clock_s"] > 0
    assert "original: pass key found (mean over depths) at 400 tokens" in capsys.readouterr().out


def test_small_runs_train_ahead_beside_the_smollm2_parts(tmp_path, monkeypatch, capsys):
    """The recall part on a tiny recipe; with 2 workers its runs train in a background process while
    the retrieval part runs here, and the recall part then reuses them, with the numbers of a
    serial demo."""
    monkeypatch.setattr("slimkv.demo.DEMO_RECALL_STEPS", 3)
    monkeypatch.setattr("slimkv.demo.DEMO_RECALL_ENTRIES", ("mha", "swa:window=16"))
    monkeypatch.setattr("slimkv.demo.run_retrieval_demo", lambda *args: print("retrieval part here"))
    threads = torch.get_num_threads()
    run_demo(tmp_path / "ahead", parts=("recall", "retrieval"), progress=False, workers=2)
    out = capsys.readouterr().out
    assert out.index("retrieval part here") < out.index("== recall demo") and torch.get_num_threads() == threads
    timings = json.loads((tmp_path / "ahead" / "demo_timings.json").read_text())
    assert list(timings["parts"]) == ["retrieval", "recall"] and timings["ahead"]["runs"] == 2
    assert timings["ahead"]["left"] == {"recall": 2 - timings["ahead"]["trained_ahead"]}
    ahead = json.loads((tmp_path / "ahead" / "recall" / "report.json").read_text())
    assert [run["reused"] for run in ahead["runs"]] == [True] * timings["ahead"]["trained_ahead"] + [False] * (2 - timings["ahead"]["trained_ahead"])
    assert run_demo(tmp_path / "serial", parts=("recall",), progress=False, workers=1) == {}
    assert (tmp_path / "serial" / "recall" / "report.md").is_file()
    serial = json.loads((tmp_path / "serial" / "recall" / "report.json").read_text())
    assert [run["label"] for run in serial["runs"]] == ["mha", "swa:window=16"]
    assert [run["lengths"] for run in ahead["runs"]] == [run["lengths"] for run in serial["runs"]]


def test_a_failing_smollm2_part_is_reported_without_waiting_for_the_runs_ahead(tmp_path, monkeypatch):
    """The error of a part run beside the background runs reaches the caller, and this process gets its threads back."""
    monkeypatch.setattr("slimkv.demo.DEMO_RECALL_STEPS", 3)
    monkeypatch.setattr("slimkv.demo.DEMO_RECALL_ENTRIES", ("mha",))

    def fails(*args):
        raise ValueError("apt-get: package dict-devil could not be downloaded")

    monkeypatch.setattr("slimkv.demo.run_retrieval_demo", fails)
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="dict-devil"):
        run_demo(tmp_path / "demo", parts=("retrieval", "recall"), progress=False, workers=2)
    assert torch.get_num_threads() == threads
