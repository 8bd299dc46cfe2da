"""Where a decode step's time goes (slimkv/bench/step_parts.py): what the instrumented entries see, and the split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import slimkv.ops.attention as attention_ops
import slimkv.ops.linear as linear_ops
from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.bench.step_parts import split_step, timed_parts
from slimkv.ops.native import decode_kernel

HYBRID = {"n_kv_heads": 2, "full_heads": [0], "window": 4}


@pytest.mark.skipif(decode_kernel(torch.float32) is None, reason="the native kernel could not be built here: no native call to time")
@pytest.mark.parametrize(("one_call", "kind", "options", "storage"), [(False, "gqa", {"n_kv_heads": 2}, None), (True, "gqa", {"n_kv_heads": 2}, None),
                                                                      (True, "hybrid", HYBRID, "int4:group=16,residual=4"), (True, "swa", {"window": 4}, None)],
                         ids=["module-path", "one-call-blocks", "one-call-hybrid-int4-blocks", "two-call-blocks"])
def test_a_decode_step_counts_every_linear_weight_once_and_its_attention_calls(one_call, kind, options, storage):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, attention=kind, attention_options=options)
    model = SlimKVForCausalLM(config).eval()
    for block in model.model.layers:
        block.native_step = one_call
    with torch.no_grad():
        cache = model.new_cache(1, storage=storage)
        model(torch.randint(0, 61, (1, 9)), cache=cache)
        with timed_parts() as totals:
            model(torch.tensor([[3]]), cache=cache)
    block_weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name and "layers." in name]
    lm_head = model.get_output_embeddings().weight
    head = lm_head.numel() if all(p is not lm_head for p in block_weights) else 0
    counted = totals["linear_weight_elements"] + totals["block_weight_elements"]
    assert counted == sum(p.numel() for p in block_weights) + head
    assert totals["linear_weight_bytes"] + totals["block_weight_bytes"] == 4 * counted
    if one_call and kind == "swa":  # two calls per block around its windowed attention: linears
        assert totals["block_calls"] == 0 and totals["attention_calls"] >= config.n_layers and totals["linear_calls"] == 2 * config.n_layers + 1
    elif one_call:  # each block one call: its linears and attention inside it
        assert totals["block_calls"] == config.n_layers and totals["attention_calls"] == 0 and totals["linear_weight_elements"] == head
        assert 0 < totals["block_s"]
    else:
        assert totals["attention_calls"] == config.n_layers and totals["linear_calls"] >= config.n_layers and totals["block_calls"] == 0
        assert 0 < totals["linear_s"] and 0 < totals["attention_s"]


def test_the_entries_are_restored_even_when_the_block_fails():
    before = (linear_ops.native_project, linear_ops.native_linear, attention_ops.native_decode_attention)
    with pytest.raises(RuntimeError), timed_parts():
        assert linear_ops.native_project is not before[0]
        raise RuntimeError("inside")
    assert (linear_ops.native_project, linear_ops.native_linear, attention_ops.native_decode_attention) == before


def test_the_split_puts_each_part_beside_its_bound():
    parts = {"linear_s": 0.02, "linear_calls": 5, "linear_weight_bytes": 1e9, "linear_weight_elements": 2.5e8, "attention_s": 0.03, "attention_calls": 2}
    rates = {"read_bytes_per_s": 1e11, "fma_flop_per_s": 1e11}
    split = split_step(0.06, parts, cache_bytes=2e9, attention_flops=1e9, rates=rates)
    assert split["linear_bound_s"] == pytest.approx(0.01) and split["linear_over_bound"] == pytest.approx(2.0)
    assert split["attention_bound"] == "memory" and split["attention_bound_s"] == pytest.approx(0.02)
    assert split["rest_s"] == pytest.approx(0.01)
    assert split_step(0.06, parts, cache_bytes=1e8, attention_flops=5e9, rates=rates)["attention_bound"] == "compute"


def test_blocks_in_one_call_take_their_share_of_the_attention_bound():
    """Two layers, one in one call (its weights 1e9 bytes) and one on the module path: the attention's bound is halved between them."""
    parts = {"linear_s": 0.01, "linear_calls": 3, "linear_weight_bytes": 5e8, "linear_weight_elements": 1.25e8, "attention_s": 0.01,
             "attention_calls": 1, "block_s": 0.03, "block_calls": 1, "block_weight_bytes": 1e9, "block_weight_elements": 2.5e8}
    split = split_step(0.06, parts, cache_bytes=2e9, attention_flops=1e9, rates={"read_bytes_per_s": 1e11, "fma_flop_per_s": 1e11})
    assert split["attention_bound_s"] == pytest.approx(0.01) and split["block_bound_s"] == pytest.approx(0.01 + 0.01)
    assert split["block_over_bound"] == pytest.approx(1.5) and split["rest_s"] == pytest.approx(0.01)
    assert split["parts_bound_s"] == pytest.approx(0.005 + 0.01 + 0.02)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "decode").glob("decode_smollm2_*.md")))
def test_the_committed_parts_page_is_what_its_json_renders(name):
    """Every committed page of benchmarks/decode_smollm2.py's parts renderer is what its JSON renders
    today (a run without ``--parts``, too: its slimkv rows with ``-`` where the instrumented step would be)."""
    from slimkv.common.results import results_path
    from tests.helpers import load_benchmark

    bench = load_benchmark("decode_smollm2.py")
    path = results_path(bench.RESULTS, f"{name}.json")
    payload = json.loads(path.read_text(encoding="utf-8"))
    page = bench.render_parts(payload)
    assert page.count("\n| slimkv ") == sum(r["model"].startswith("slimkv") for r in payload["rows"])
    assert path.with_suffix(".md").read_text(encoding="utf-8") == page, \
        f"run .venv/bin/python benchmarks/decode_smollm2.py --render benchmarks/results/decode/{name}.json"


def test_a_converted_folder_that_is_not_one_is_refused_before_loading(tmp_path, monkeypatch):
    """benchmarks/decode_smollm2.py --converted: a path that is not a conversion's folder (here two
    joined by a comma) is named before the model is fetched or loaded."""
    import sys

    from tests.helpers import load_benchmark

    bench = load_benchmark("decode_smollm2.py")
    monkeypatch.setattr(sys, "argv", ["decode_smollm2.py", "--converted", f"{tmp_path / 'mla'},{tmp_path / 'lrkv'}"])
    monkeypatch.setattr(bench, "fetch_smollm2", lambda: pytest.fail("fetched before the check"))
    with pytest.raises(SystemExit, match="--converted: .* is not a folder with config.json"):
        bench.main()
