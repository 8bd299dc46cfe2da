"""The conversion methods' numerics on tiny random models (no downloads): with no compression every
method computes what the original computes (Llama, and Qwen2 with q/k/v biases), each method end to
end at half the cache, and the pieces the methods share (complex pairs, the weighted fit)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimkv.convert import gqa, latent, lowrank, mla, pairs
from slimkv.convert.calibrate import layer_statistics
from slimkv.convert.context import layer_budget
from slimkv.convert.manifest import finished_conversion
from slimkv.convert.methods import CONVERSIONS, LayerContext, get_conversion, parse_method
from slimkv.convert.pipeline import build_converted, convert_pretrained
from slimkv.convert.source import Source
from slimkv.eval.cache import cache_report
from slimkv.eval.models import load_language_model
from slimkv.pretrained import LoadedModel
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.compress.conftest import tiny_config, tiny_model
from tests.convert.conftest import options


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial biases and norm gains."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def contexts(original: torch.nn.Module) -> tuple[Source, list[LayerContext]]:
    source = Source(LoadedModel(original, None, {}))
    stats = layer_statistics(source, torch.randint(3, 99, (4, 32), generator=torch.Generator().manual_seed(0)), progress=False)
    return source, [LayerContext(i, source.shape, source.attention(i), stats[i], source.rotary_inv_freq()) for i in range(source.shape.n_layers)]


def uncompressed(method: str, shape) -> dict:
    """Options that keep everything: every pair rotated and the full latent, full residual ranks, all heads."""
    kind = CONVERSIONS[method].kind
    if kind == "mla":
        rotated = shape.head_dim * (1 if method == "mla-prefix" else shape.n_kv_heads)
        return {"rope_dim": rotated, "kv_rank": 2 * shape.n_kv_heads * shape.head_dim}
    if kind == "lrkv":
        return {"rank_k": shape.head_dim, "rank_v": shape.head_dim}
    if kind == "latent":
        return {"kv_rank": 2 * shape.n_kv_heads * shape.head_dim, **CONVERSIONS[method].settings}
    return {"n_kv_heads": shape.n_kv_heads}


def max_logit_error(original: torch.nn.Module, converted: torch.nn.Module) -> float:
    ids = torch.randint(3, 99, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float((converted(ids).logits - original(ids).logits).abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["mla", "latent", "lrkv", "gqa", "gqa-mean"])
def test_without_compression_every_method_computes_the_original(family, method):
    original = perturbed(tiny_model(family))
    source, layers = contexts(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lrkv at full rank caches more than the original and says so
        model, _, _ = build_converted(source, get_conversion(method), layers, [uncompressed(method, source.shape)] * len(layers))
    assert max_logit_error(original, model) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mla_prefix_is_exact_for_one_kv_head(family):
    """One component per frequency reconstructs every key pair when there is one K/V head."""
    config = tiny_config(family)
    config.num_key_value_heads = 1
    torch.manual_seed(0)
    original = perturbed(AutoModelForCausalLM.from_config(config).eval())
    source, layers = contexts(original)
    model, _, _ = build_converted(source, get_conversion("mla-prefix"), layers, [uncompressed("mla-prefix", source.shape)] * len(layers))
    assert max_logit_error(original, model) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoupled_lrkv_at_full_rank_is_the_partial_rope_layer(family):
    """With one K/V head and full residual ranks, ``lrkv:rope_placement=decoupled`` loses only the rotations
    it drops: it must compute what ``rope-partial`` (the same pairs kept, the rest read with the
    rotation's expectation) computes, through a different fit (mixed pairs, channel map, alignment)."""
    config = tiny_config(family)
    config.num_key_value_heads = 1
    torch.manual_seed(0)
    original = perturbed(AutoModelForCausalLM.from_config(config).eval())
    source, layers = contexts(original)
    pairs, hd = 3, source.shape.head_dim
    partial, _, _ = build_converted(source, get_conversion("rope-partial"), layers, [{"rope_pairs": pairs}] * len(layers))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full ranks cache more than the original and say so
        decoupled, _, info = build_converted(source, get_conversion("lrkv"), layers, [{"rank_k": hd - 2 * pairs, "rank_v": hd, "rope_pairs": pairs}] * len(layers))
    assert all(layer.rope_placement == "decoupled" and layer.rotary.rot_dim == 2 * pairs for layer in decoupled.attention_layers)
    assert max_logit_error(partial, decoupled) < 1e-4
    assert max_logit_error(original, decoupled) > 1e-3  # the dropped rotations do cost something


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_aware_merge_of_single_heads_is_exact(family):
    """Merging groups of one head runs the whole aware machinery (rank-1 pair fits, value maps folded
    into o_proj) and must change nothing."""
    original = perturbed(tiny_model(family))
    source, layers = contexts(original)
    for layer in layers:
        merged = gqa.merge_aware(layer, source.shape.n_kv_heads)
        assert gqa.merge_error(layer, merged) < 1e-12
        assert not torch.allclose(merged.layer.q, layer.affine().q)  # the queries were rephased
    ids = torch.randint(3, 99, (1, 30))
    state = {f"model.layers.{i}.attn.{k}": v.float() for i, layer in enumerate(layers) for k, v in gqa.merged_state(layer, gqa.merge_aware(layer, 2)).items()}
    copy, _, _ = build_converted(source, get_conversion("gqa"), layers, [{"n_kv_heads": 2}] * len(layers))
    copy.load_state_dict(state, strict=False)
    with torch.no_grad():
        assert torch.allclose(copy(ids).logits, original(ids).logits, atol=1e-4)


@pytest.mark.parametrize("method", ["mla", "mla-prefix", "latent", "lrkv", "gqa"])
def test_each_method_end_to_end_at_half_the_cache(method, tiny_folder, tmp_path):
    out = tmp_path / "out"
    model, manifest = convert_pretrained(str(tiny_folder), options(method, 0.5, tmp_path), out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    assert stored["method"] == method and stored["kind"] == CONVERSIONS[method].kind
    assert stored["achieved_cache_ratio"] <= 0.5 and stored["changed_parameters"]
    assert set(stored["seconds"]) == {"calibration", "plan", "fit", "refine", "total"} and stored["refinement"] is None
    assert finished_conversion(out, options(method, 0.5, tmp_path)) == stored  # what the benchmarks and the demo reuse
    assert finished_conversion(out, options(method, 0.4, tmp_path)) is None and finished_conversion(tmp_path / "none", options(method, 0.5, tmp_path)) is None
    reloaded = load_language_model(str(out))
    ids = torch.randint(3, 99, (1, 24))
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids).logits, model(ids).logits)
    report = cache_report(str(out), 40, new_tokens=4, text=str(tmp_path / "held.txt"))
    assert report["ratio_to_original"] == pytest.approx(stored["achieved_cache_ratio"]) and report["ratio_to_original"] <= 0.5
    if CONVERSIONS[method].kind == "mla":
        config = json.loads((out / "config.json").read_text())
        assert config["attention_options"]["latent_norm"] is False
        layer = config["per_layer_options"][0]
        assert len(layer["rope_frequencies"]) == layer["rope_dim"] // 2
        ladder = 1.0 / 10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12)
        if method == "mla-prefix":  # the fastest frequencies, the same in every layer
            assert layer["rope_frequencies"] == pytest.approx(ladder[: layer["rope_dim"] // 2].tolist())
            assert all(o["rope_frequencies"] == layer["rope_frequencies"] for o in config["per_layer_options"])


def test_decoupled_lrkv_end_to_end_decodes_from_the_compact_cache(tiny_folder, tmp_path):
    """``--to lrkv:rope_placement=decoupled`` at 3/4 of the cache (residual ranks 4 and 2 on the tiny model):
    every layer rotates the rule's pairs at the frequencies its fit chose, the cache is what
    ``rope_placement=full`` keeps, and a decode step by step (factored, never rebuilding a key) gives the
    logits of one forward pass over the sequence."""
    out = tmp_path / "out"
    model, manifest = convert_pretrained(str(tiny_folder), options("lrkv:rope_placement=decoupled", 0.75, tmp_path), out, progress=False)
    full_rope, _ = convert_pretrained(str(tiny_folder), options("lrkv", 0.75, tmp_path), tmp_path / "full", progress=False)
    config = json.loads((out / "config.json").read_text())
    for layer_options, layer in zip(config["per_layer_options"], model.attention_layers):
        assert layer_options["rope_placement"] == "decoupled" and len(layer_options["rope_frequencies"]) == 4  # round(5 x head_dim 12 / 16) pairs
        assert layer.rope_placement == "decoupled" and layer.decode_path == "factored" and (layer.rank_k, layer.rank_v) == (4, 2)
    assert manifest["achieved_cache_ratio"] == json.loads((tmp_path / "full" / CONVERTED_MANIFEST).read_text())["achieved_cache_ratio"] <= 0.75
    ids = torch.randint(3, 99, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(ids).logits
        cache = model.new_cache(1)
        steps = [model(ids[:, :4], cache=cache).logits] + [model(ids[:, t : t + 1], cache=cache).logits for t in range(4, ids.shape[1])]
    assert torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-4)
    assert not torch.allclose(whole, full_rope(ids).logits, atol=1e-3)  # a different conversion, not the full-rope one renamed
    from slimkv.eval.ppl import describe  # the label eval prints names the method with its options

    assert describe(load_language_model(str(out)).identity, str(out)).startswith("convert lrkv:rope_placement=decoupled (lrkv layers)")
    # a folder converted before the layer option was renamed (config.json and the manifest say rope_mode) loads as the same model
    manifest_file = out / CONVERTED_MANIFEST
    written = json.loads(manifest_file.read_text())
    for stored, key in ((config, "per_layer_options"), (written, "layers")):
        for entry in stored[key]:
            layer_options = entry if key == "per_layer_options" else entry["options"]
            layer_options["rope_mode"] = layer_options.pop("rope_placement")
    (out / "config.json").write_text(json.dumps(config))
    manifest_file.write_text(json.dumps(written))
    old = load_language_model(str(out)).model
    assert all(o["rope_placement"] == "decoupled" and "rope_mode" not in o for o in old.config.per_layer_options)
    with torch.no_grad():
        assert torch.equal(old(ids).logits, whole)


def test_the_methods_refuse_ratios_below_their_minimum(tiny_folder, tmp_path):
    from slimkv.cli import main

    base = ["convert", "--model", str(tiny_folder), "--calib", str(tmp_path / "calib.txt"), "--calib-tokens", "64", "--calib-seq-len", "32"]
    for method, ratio, minimum in (("lrkv", 0.4, "0.5000"), ("latent", 0.01, "0.0208"), ("mla", 0.05, "0.0625"), ("mla-prefix", 0.05, "0.0625"), ("gqa-mean", 0.3, "0.5000")):
        with pytest.raises(ValueError, match=f"below what --to {method} can represent for this model: the minimum is {minimum}"):
            convert_pretrained(str(tiny_folder), options(method, ratio, tmp_path), tmp_path / "never", progress=False)
        assert main(base + ["--to", method, "--cache-ratio", str(ratio), "--out", str(tmp_path / "never")]) == 2
    assert not (tmp_path / "never").exists()


def test_size_rules():
    shape = Source(LoadedModel(tiny_model("llama"), None, {})).shape
    smol = type(shape)(30, 576, 9, 3, 64, 1536, 49152, 1e5, 1e-5, False, True, 8192)
    assert [mla.rope_pairs_for(smol, r, layer_budget(smol, r)) for r in (0.5, 1 / 3 + 1e-9, 0.25)] == [20, 16, 16]
    assert layer_budget(smol, 0.5) == 192 and layer_budget(smol, 0.33) == 126
    from slimkv.convert import lrkv

    assert lrkv.ranks_for(smol, 192) == (14, 7) and lrkv.ranks_for(smol, 152) == (5, 3)
    assert mla.min_ratio(shape) == pytest.approx(3 / 48) and lrkv.min_ratio(shape) == 0.5


def test_pair_mixing_reconstructs_every_head_and_ranks_by_weighted_error():
    torch.manual_seed(0)
    d, heads, freqs = 7, 3, 4
    x = torch.randn(500, d, dtype=torch.float64)
    cov = x.T @ x / 500
    keys = torch.randn(heads, 2 * freqs, d, dtype=torch.float64)
    complex_keys = pairs.to_complex(keys)
    assert torch.equal(pairs.from_complex(complex_keys), keys)
    weight = torch.rand(heads, freqs, dtype=torch.float64) + 0.1
    mix = pairs.mix_pairs(complex_keys, weight, cov)
    rebuilt = torch.einsum("pgj,pjd->gpd", mix.recon, mix.keys)
    assert torch.allclose(rebuilt, complex_keys, atol=1e-10)
    # keeping the strongest component leaves exactly the other eigenvalues as weighted error
    single = mix.recon[:, :, :1] @ mix.keys[:, :1]  # (P, m, d)
    lost = (weight.T * pairs.pair_energy(complex_keys.transpose(0, 1) - single, cov)).sum(1)
    assert torch.allclose(lost, mix.energy[:, 1:].sum(1), rtol=1e-8)
    # the expectation of the rotation: 1 at distance 0, the mean phase otherwise
    distance = torch.zeros(2, 5, dtype=torch.float64)
    distance[0, 0], distance[1, 3] = 1.0, 2.0
    rho = pairs.rotation_expectation(distance, torch.tensor([0.5, 0.1], dtype=torch.float64))
    assert torch.allclose(rho[0], torch.ones(2, dtype=torch.complex128))
    assert torch.allclose(rho[1], torch.exp(1j * 3 * torch.tensor([0.5, 0.1], dtype=torch.float64)))


def test_weighted_factors_minimise_the_weighted_error():
    torch.manual_seed(0)
    x = torch.randn(400, 6, dtype=torch.float64)
    cov = x.T @ x / 400
    target = torch.randn(5, 6, dtype=torch.float64)
    weight = lowrank.damped_sqrt(torch.diag(torch.tensor([9.0, 1.0, 1.0, 0.01, 0.01], dtype=torch.float64)), 0.0)
    down, up = lowrank.weighted_factors(target, cov, weight, 2)
    best = lowrank.weighted_error(target, up @ down, cov, weight)
    for seed in range(5):  # random rank-2 maps do worse
        g = torch.Generator().manual_seed(seed)
        other = torch.randn(2, 6, generator=g, dtype=torch.float64)
        assert lowrank.weighted_error(target, lowrank.least_squares_up(target, other, cov) @ other, cov, weight) > best
    full_down, full_up = lowrank.weighted_factors(target, cov, weight, 5)
    # full rank fits exactly, up to the fit's ridge (1e-10 of the Gram's mean diagonal in least_squares_up), which
    # leaves a relative squared error near 1e-20: under it on an AMD EPYC, 1.00001e-20 on an Intel Xeon; the bound sits above it
    assert lowrank.weighted_error(target, full_up @ full_down, cov, weight) < 1e-16


def test_the_calibration_records_the_mean_for_biases():
    original = tiny_model("qwen2")
    source, layers = contexts(original)
    stats = layers[0].stats
    augmented = stats.augmented_cov()
    assert augmented.shape == (49, 49) and augmented[-1, -1] == 1 and torch.equal(augmented[:-1, -1], stats.mean)
    assert layers[0].affine().q.shape == (4, 12, 49) and torch.equal(layers[0].affine().q[..., -1], layers[0].weights.q_bias)


def test_latent_spectrum_allocation_spreads_the_same_total():
    """``latent:allocation=spectrum`` moves latent channels between layers, never more in all than
    the uniform plan, every layer at least half the uniform latent."""
    original = perturbed(tiny_model("llama"))
    source, layers = contexts(original)
    _, uniform = parse_method("latent")
    _, spread = parse_method("latent:allocation=spectrum")
    even, _ = latent.plan(layers, 0.3, **uniform)
    planned, why = latent.plan(layers, 0.3, **spread)
    ranks = [p["kv_rank"] for p in planned]
    assert sum(ranks) == sum(p["kv_rank"] for p in even) and min(ranks) >= even[0]["kv_rank"] // 2
    assert "spectrum" in why
    model, _, _ = build_converted(source, get_conversion("latent"), layers, planned)
    assert [block.attn.kv_rank for block in model.model.layers] == ranks
