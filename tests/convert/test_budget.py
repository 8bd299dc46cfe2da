"""``convert --cache-budget``: the byte model of a hybrid cache equals a live cache, the plan picks
the storage and head count the budget allows, and the command says the plan before any work."""

from __future__ import annotations

import json

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.cli import main
from slimkv.convert.budget import WEIGHED, head_bytes, plan_budget, weighed
from slimkv.convert.pipeline import check_before_work, read_shape
from slimkv.convert.source import Shape
from slimkv.eval.models import cache_label, load_language_model
from slimkv.ops.quantize import parse_storage
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.convert.test_kvm import kvm_options

SHAPE = Shape(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=128, vocab_size=50, rope_theta=1e4, norm_eps=1e-5,
              qkv_bias=False, tie_word_embeddings=True, max_position_embeddings=512)


@pytest.mark.parametrize("storage", ["full", "int8:group=8,residual=5", "int4:group=4,residual=0", "int4:group=4,residual=3,block=1",
                                     "int8:group=8,residual=2,block=3"])
def test_the_byte_model_is_the_live_cache(storage):
    attn = build_attention("hybrid", 256, 4, 64, n_kv_heads=2, full_heads=[1], window=6, sink_len=2).to(torch.bfloat16)
    cache = attn.new_cache(1, storage=storage)
    kind = parse_storage(storage)
    with torch.no_grad():
        for length in (1, 3, 7, 20, 41):
            attn(torch.randn(1, length - cache.seq_len, 256, dtype=torch.bfloat16), cache=cache)
            expected = sum(head_bytes(length, SHAPE, kind, exact=exact, sink_len=2, window=6) for exact in (True, False))
            assert cache.nbytes() == expected, (storage, length)


def test_the_plan_fits_the_budget_and_prefers_more_exact_heads():
    for budget in (0.9, 0.5, 0.3, 0.2):
        plan = plan_budget(SHAPE, budget, 512, window=32, sink_len=2)
        assert plan.predicted_fraction <= budget + 1e-12
        assert plan.exact_heads == max(c["exact_heads"] for c in plan.candidates)
    every = plan_budget(SHAPE, 0.9, 512, window=32, sink_len=2)
    assert every.storage == "int8:group=32,residual=128,block=16" and every.exact_heads == 4  # the most precise storage that keeps every head
    fixed = plan_budget(SHAPE, 0.5, 512, window=32, sink_len=2, storage="full")
    assert fixed.storage == "full" and len(fixed.candidates) == 1
    with pytest.raises(ValueError, match="--cache-budget 0.01 is below what a hybrid conversion can hold"):
        plan_budget(SHAPE, 0.01, 512, window=32, sink_len=2)


def test_weighing_takes_the_best_copy_accuracy_ties_to_the_more_precise_storage():
    assert not plan_budget(SHAPE, 0.3, 512, window=32, sink_len=2).to_weigh  # the default keeps the most heads exact
    plan = plan_budget(SHAPE, 0.3, 512, window=32, sink_len=2, storage=WEIGHED)
    names = [c["storage"] for c in plan.fitting()]
    assert plan.to_weigh and len(names) > 1 and plan.weighing is None
    measurement = {"contexts": 3, "length": 256}
    worst_first = weighed(plan, {name: 0.5 + 0.1 * i for i, name in enumerate(names)}, measurement)
    assert worst_first.storage == names[-1] and not worst_first.to_weigh and worst_first.weighing["copy_accuracy"][names[-1]] == pytest.approx(0.5 + 0.1 * (len(names) - 1))
    chosen = next(c for c in plan.candidates if c["storage"] == names[-1])
    assert (worst_first.exact_heads, worst_first.cache_ratio, worst_first.predicted_fraction) == (chosen["exact_heads"], chosen["cache_ratio"], chosen["fraction"])
    assert weighed(plan, dict.fromkeys(names, 0.7), measurement).storage == names[0]
    with pytest.raises(ValueError, match="no copy accuracy for"):
        weighed(plan, {names[0]: 0.9}, measurement)


def test_planned_windows_are_candidates_and_a_shorter_window_buys_exact_heads():
    """``--budget-windows``: every (window, storage) pair is a candidate; without weighing the most exact
    heads win, ties to the longer window; weighing names each candidate by its storage and window."""
    single = plan_budget(SHAPE, 0.3, 512, window=64, sink_len=2)
    several = plan_budget(SHAPE, 0.3, 512, window=(16, 64), sink_len=2)
    assert single.window == 64 and {c["name"] for c in single.candidates} == {c["storage"] for c in single.candidates}
    assert [(c["window"], c["storage"]) for c in several.candidates] == [(w, c["storage"]) for w in (64, 16) for c in single.candidates]
    by_window = {w: max(c["exact_heads"] for c in several.candidates if c["window"] == w) for w in (64, 16)}
    assert by_window[16] >= by_window[64] and several.exact_heads == by_window[16] and several.predicted_fraction <= 0.3 + 1e-12
    assert several.window == (16 if by_window[16] > by_window[64] else 64)
    assert plan_budget(SHAPE, 0.99, 512, window=(16, 64), sink_len=2).window == 64  # every head exact either way: the longer window
    weighable = plan_budget(SHAPE, 0.3, 512, window=(16, 64), sink_len=2, storage=WEIGHED)
    names = [c["name"] for c in weighable.fitting()]
    assert all(", window " in name for name in names)
    best = weighable.fitting()[-1]
    chosen = weighed(weighable, {name: float(name == best["name"]) for name in names}, {"contexts": 1, "length": 64})
    assert (chosen.window, chosen.storage, chosen.exact_heads) == (best["window"], best["storage"], best["exact_heads"])


def test_convert_plans_the_window_it_is_given(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    options = kvm_options(tmp_path, "hybrid:sink_len=2,roles_contexts=1", cache_budget=0.5)
    argv = ["convert", "--model", str(tiny_folder), "--cache-budget", "0.5", "--at", "128", "--to", "hybrid:sink_len=2,roles_contexts=1",
            "--budget-windows", "30,8", "--calib", options.calib, "--calib-tokens", "96", "--calib-seq-len", "32", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    manifest = json.loads((out / CONVERTED_MANIFEST).read_text())
    plan = manifest["budget_plan"]
    assert manifest["options"]["budget_windows"] == [30, 8] and manifest["method_options"]["window"] == plan["window"] in (30, 8)
    assert f"(window {plan['window']})" in said and {c["window"] for c in plan["candidates"]} == {30, 8}
    assert all(layer["options"]["window"] == plan["window"] for layer in manifest["layers"])
    measured = [row for row in manifest["cache_bytes"] if row["context"] == 128]
    assert measured[0]["ratio"] == pytest.approx(plan["predicted_fraction"], abs=1e-12) and measured[0]["ratio"] <= 0.5


@pytest.mark.parametrize("storage", [None, WEIGHED])
def test_convert_with_a_budget_says_the_plan_and_meets_it(tiny_folder, tmp_path, capsys, storage):
    out = tmp_path / "out"
    options = kvm_options(tmp_path, "hybrid:window=30,sink_len=2,roles_contexts=1", cache_budget=0.5)
    argv = ["convert", "--model", str(tiny_folder), "--cache-budget", "0.5", "--at", "128", "--to", "hybrid:window=30,sink_len=2,roles_contexts=1",
            "--calib", options.calib, "--calib-tokens", "96", "--calib-seq-len", "32", "--out", str(out), "--no-progress", *(["--cache-storage", storage] if storage else [])]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert said.index("plan for --cache-budget 0.5") < said.index("converted")
    manifest = json.loads((out / CONVERTED_MANIFEST).read_text())
    plan = manifest["budget_plan"]
    assert manifest["options"]["cache_budget"] == 0.5 and manifest["options"]["cache_ratio"] is None
    assert manifest["cache_storage"] == plan["storage"] and plan["at"] == 128
    measured = [row for row in manifest["cache_bytes"] if row["context"] == 128]
    assert measured and measured[0]["ratio"] == pytest.approx(plan["predicted_fraction"], abs=1e-12) and measured[0]["ratio"] <= 0.5
    loaded = load_language_model(str(out))  # the manifest's checks read a budget's ratio off its plan
    assert loaded.identity["converted"]["budget_plan"] == plan
    assert ("storage" in cache_label(loaded.identity["converted"])) == (plan["storage"] != "full")  # tiny 12-wide heads: int codes save nothing
    fitting = [c for c in plan["candidates"] if c["exact_heads"] >= 0]
    if storage is None:  # the most exact heads, nothing measured
        assert plan["weighing"] is None and plan["exact_heads"] == max(c["exact_heads"] for c in fitting) and "weighed" not in said
    else:
        assert len(fitting) > 1 and plan["weighing"] and set(plan["weighing"]["copy_accuracy"]) == {c["storage"] for c in fitting}
        assert plan["weighing"]["copy_accuracy"][plan["storage"]] == max(plan["weighing"]["copy_accuracy"].values())
        assert said.index("to be weighed") < said.index("weighed: ")


@pytest.mark.parametrize("fields, message", [
    ({"method": "mla", "cache_budget": 0.25}, "--cache-budget plans --to hybrid"),
    ({"method": "hybrid:window=8", "cache_budget": 0.25, "cache_ratio": 0.5}, "give one"),
    ({"method": "hybrid:window=8", "cache_budget": 1.5}, "--cache-budget"),
    ({"method": "hybrid:window=8", "cache_ratio": 0.5, "cache_storage": "weighed"}, "--cache-storage weighed weighs the storages a --cache-budget allows"),
    ({"method": "hybrid", "cache_ratio": 0.5, "budget_windows": [8]}, "--budget-windows gives the windows a --cache-budget plan chooses from"),
    ({"method": "hybrid:window=8", "cache_budget": 0.5, "budget_windows": [8, 4]}, "--budget-windows and --to hybrid:window=8 both set window"),
    ({"method": "hybrid", "cache_budget": 0.5, "budget_windows": [8, 0]}, "--budget-windows"),
    ({"method": "hybrid:at=64", "cache_budget": 0.5, "budget_windows": [8, 70]}, "--budget-windows 70: --to hybrid: at must be"),
])
def test_bad_budgets_fail_before_any_work(tiny_folder, tmp_path, no_loading, fields, message):
    method = fields.pop("method")
    with pytest.raises(ValueError, match=message):
        check_before_work(str(tiny_folder), kvm_options(tmp_path, method, **fields), tmp_path / "out")


def test_at_needs_a_hybrid_conversion(tiny_folder, tmp_path, capsys):
    assert main(["convert", "--model", str(tiny_folder), "--to", "mla", "--cache-ratio", "0.5", "--at", "64", "--out", str(tmp_path / "o")]) == 2
    assert "--at sets where a hybrid conversion's budget is measured" in capsys.readouterr().err
    assert read_shape(str(tiny_folder)).max_position_embeddings >= 128
