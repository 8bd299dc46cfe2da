"""Measured per-layer sensitivity (``slimkv.convert.sensitivity``) and the allocation that reads it
(``latent:allocation=sensitivity``), on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from slimkv.convert import latent, lrkv, mla
from slimkv.convert.context import layer_budget
from slimkv.convert.methods import get_conversion, parse_method
from slimkv.convert.pipeline import build_converted, check_before_work, convert_pretrained
from slimkv.convert.sensitivity import layer_sensitivity
from slimkv.convert.source import exact_copy
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.compress.conftest import tiny_model
from tests.convert.conftest import options
from tests.convert.test_methods import contexts, perturbed

WINDOWS = torch.randint(3, 99, (3, 40), generator=torch.Generator().manual_seed(5))


def test_an_exact_layer_moves_nothing_and_a_compressed_one_does():
    source, layers = contexts(perturbed(tiny_model("llama")))
    exact = exact_copy(source)
    kept = [block.attn for block in exact.model.layers]
    assert layer_sensitivity(exact, exact_copy(source), WINDOWS, progress=False) == pytest.approx([0.0] * len(layers), abs=1e-9)
    _, settings = parse_method("latent")
    squeezed, _, _ = build_converted(source, get_conversion("latent"), layers, latent.plan(layers, 0.1, **settings)[0])
    values = layer_sensitivity(exact, squeezed, WINDOWS, seq_len=16, progress=False)
    assert len(values) == len(layers) and all(v > 1e-6 for v in values)
    assert [block.attn for block in exact.model.layers] == kept  # the exact copy is restored


def test_the_measurement_matches_a_full_forward_pass_per_swapped_layer():
    """The measurement reruns only the layers from the swapped one on; the plain way, a whole
    forward pass of the model with one attention module replaced, gives the same KL."""
    source, layers = contexts(perturbed(tiny_model("qwen2")))
    exact = exact_copy(source)
    _, settings = parse_method("latent")
    squeezed, _, _ = build_converted(source, get_conversion("latent"), layers, latent.plan(layers, 0.2, **settings)[0])
    ids = WINDOWS[:2, :24]
    with torch.no_grad():
        teacher = torch.log_softmax(exact(ids).logits, -1)
        plain = []
        for i in range(len(layers)):
            hybrid = exact_copy(source)
            hybrid.model.layers[i].attn = squeezed.model.layers[i].attn
            student = torch.log_softmax(hybrid(ids).logits, -1)
            plain.append(float((teacher.exp() * (teacher - student)).sum() / ids.numel()))
    assert layer_sensitivity(exact, squeezed, WINDOWS, seq_len=24, count=2, progress=False) == pytest.approx(plain, rel=1e-4, abs=1e-7)


def test_the_sensitivity_allocation_gives_the_sensitive_layer_more_and_keeps_the_total():
    source, layers = contexts(perturbed(tiny_model("llama")))
    _, settings = parse_method("latent:allocation=sensitivity")
    with pytest.raises(RuntimeError, match="sensitivity"):
        latent.plan(layers, 0.3, **settings)
    [probe] = latent.probe_plans(layers, 0.3, **settings)
    assert probe == latent.plan(layers, 0.3, **{**settings, "allocation": "uniform"})[0]
    assert latent.probe_plans(layers, 0.3, **parse_method("latent")[1]) is None
    for loud in range(len(layers)):
        for i, layer in enumerate(layers):
            layer.sensitivity = [1.0 if i == loud else 1e-4]
        planned, why = latent.plan(layers, 0.3, **settings)
        ranks = [p["kv_rank"] for p in planned]
        assert sum(ranks) == sum(p["kv_rank"] for p in probe) and "sensitivity" in why
        assert ranks[loud] == max(ranks) > probe[loud]["kv_rank"]


def test_a_sensitivity_conversion_records_what_it_measured(tiny_folder, tmp_path):
    out = tmp_path / "out"
    model, _ = convert_pretrained(str(tiny_folder), options("latent:allocation=sensitivity", 0.5, tmp_path), out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    measured = stored["sensitivity"]
    [values] = measured["kl_per_plan_and_layer"]
    assert len(values) == len(model.model.layers) and all(v >= 0 for v in values)
    assert measured["tokens"] > 0 and stored["allocation"].startswith("sensitivity")
    assert stored["achieved_cache_ratio"] <= 0.5
    assert convert_pretrained(str(tiny_folder), options("latent", 0.5, tmp_path), None, progress=False)[1]["sensitivity"] is None


def _plan_with_best(layers, best: list[int], count: int, plan):
    """The plan ``plan()`` makes when layer i measured best (KL 0, the others 1) at candidate
    ``best[i]`` of ``count``; it must say it was measured."""
    for layer, b in zip(layers, best):
        layer.sensitivity = [0.0 if k == b else 1.0 for k in range(count)]
    planned, why = plan()
    assert "measured" in why
    return planned


def test_mla_measured_pairs_take_each_layers_best_candidate_at_the_same_cache():
    source, layers = contexts(perturbed(tiny_model("llama")))
    _, settings = parse_method("mla:pairs=measured")
    probes = mla.probe_plans(layers, 0.5, **settings)
    candidates = mla.pair_candidates(layers[0].shape, 0.5)
    assert len(probes) == len(candidates) > 1 and mla.probe_plans(layers, 0.5, **parse_method("mla")[1]) is None
    budget = layer_budget(layers[0].shape, 0.5)
    assert all(o["kv_rank"] + o["rope_dim"] == budget for probe in probes for o in probe)
    with pytest.raises(RuntimeError, match="pairs=measured"):
        mla.plan_uniform(layers, 0.5, **settings)
    best = [i % len(candidates) for i in range(len(layers))]
    planned = _plan_with_best(layers, best, len(candidates), lambda: mla.plan_uniform(layers, 0.5, **settings))
    assert [o["rope_dim"] // 2 for o in planned] == [candidates[b] for b in best]
    model, _, _ = build_converted(source, get_conversion("mla"), layers, planned)
    assert sum(model.cache_elements_per_token()) == budget * len(layers)


def test_lrkv_measured_split_takes_each_layers_best_key_rank_at_the_same_cache():
    source, layers = contexts(perturbed(tiny_model("llama")))
    _, settings = parse_method("lrkv:split=measured")
    probes = lrkv.probe_plans(layers, 0.6, **settings)
    candidates = lrkv.split_candidates(layers[0].shape, 0.6)
    assert len(probes) == len(candidates) > 1 and lrkv.probe_plans(layers, 0.6, **parse_method("lrkv")[1]) is None
    rule = lrkv.plan_uniform(layers, 0.6)[0]
    width = rule[0]["rank_k"] + rule[0]["rank_v"]
    assert rule[0]["rank_k"] in candidates and all(o["rank_k"] + o["rank_v"] == width for probe in probes for o in probe)
    with pytest.raises(RuntimeError, match="split=measured"):
        lrkv.plan_uniform(layers, 0.6, **settings)
    best = [(len(candidates) - 1 - i) % len(candidates) for i in range(len(layers))]
    planned = _plan_with_best(layers, best, len(candidates), lambda: lrkv.plan_uniform(layers, 0.6, **settings))
    assert [o["rank_k"] for o in planned] == [candidates[b] for b in best]
    model, _, _ = build_converted(source, get_conversion("lrkv"), layers, planned)
    rule_model, _, _ = build_converted(source, get_conversion("lrkv"), layers, rule)
    assert model.cache_elements_per_token() == rule_model.cache_elements_per_token()


def test_bad_measurement_options_are_refused_naming_the_option(tiny_folder, tmp_path):
    for method, option in (("mla:pairs=best", "pairs"), ("latent:allocation=kl", "allocation"), ("lrkv:split=2:1", "split")):
        with pytest.raises(ValueError, match=f"--to {method.partition(':')[0]}: {option}"):
            check_before_work(str(tiny_folder), options(method, 0.5, tmp_path), None)
