"""Compression of tiny random Llama (GQA, gated SiLU), OPT (ReLU, biases) and GPT-2 (fused Conv1D) models."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from slimkv.compress import CompressOptions, FactorizationError, compress_model, load, save
from slimkv.compress.arch import Architecture
from slimkv.compress.cost import linear_flops_per_token, unique_parameters
from slimkv.compress.factored import FactoredLinear, IdentityBlockInputFactor, SharedInputFactor, SplitOutputLinear
from slimkv.compress.persist import MANIFEST_NAME
from slimkv.compress.pipeline import iter_leaf_entries
from tests.compress.helpers import rank_step_slack

from .conftest import calib_ids, tiny_model

FAMILIES = ("llama", "qwen2", "opt", "gpt2")
TEST_IDS = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(9))


@torch.no_grad()
def logits(model):
    return model(TEST_IDS).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["svd", "asvd", "rootcov", "latentllm"])
def test_full_rank_compression_changes_logits_only_at_round_off(family, method):
    model = tiny_model(family)
    before = logits(model)
    # damping 0: the ReLU alternation's least-squares maps are then exact (a fixed point at full rank)
    compress_model(model, calib_ids(), CompressOptions(method=method, ratio=0.0, full_rank=True, damping=0.0), progress=False)
    assert any(isinstance(m, FactoredLinear) for m in model.modules())
    # float32 round-off: the logits are O(1) and differ by ~2e-7
    assert (logits(model) - before).abs().max() < 2e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_gives_identical_logits_and_generate_works(family, tmp_path):
    model = tiny_model(family)
    manifest = compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.3), progress=False)
    expected = logits(model)
    out = save(model, None, {"base_model": {"name": "tiny"}, **manifest}, tmp_path / "out")
    reloaded, tokenizer = load(out)
    assert tokenizer is None
    assert torch.equal(logits(reloaded), expected)
    assert unique_parameters(reloaded) == unique_parameters(model)
    prompt = TEST_IDS[:1, :5]
    generated = reloaded.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=2)
    # greedy generate() with the KV cache == argmax of full forward passes
    ids = prompt
    for _ in range(6):
        ids = torch.cat([ids, reloaded(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)


def test_manifest_describes_every_replaced_leaf(tmp_path):
    model = tiny_model("llama")
    manifest = compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.25), progress=False)
    save(model, None, manifest, tmp_path / "m")
    data = json.loads((tmp_path / "m" / MANIFEST_NAME).read_text())
    entries = {e["module"]: e for e in data["modules"]}
    assert len(entries) == 2 * 7
    q = entries["model.layers.0.self_attn.q_proj"]
    assert q["how"] == "joint_qk" and q["identity_block"] and sorted(q["permutation"]) == list(range(48))
    assert q["objective"] == sorted(q["objective"], reverse=True)
    gate, up = entries["model.layers.1.mlp.gate_proj"], entries["model.layers.1.mlp.up_proj"]
    assert gate["shared_input"] == up["shared_input"] is not None and gate["rank"] == up["rank"]
    assert gate["owns_input_factor"] and not up["owns_input_factor"]
    down = entries["model.layers.0.mlp.down_proj"]
    assert down["how"] == "rootcov" and down["damping"] is None  # inversion-free: nothing is damped
    assert q["damping"] == {"pseudo_inverse_rtol": 1e-12}
    assert q["rope"].startswith("aware (offsets 0..47")
    assert data["propagation"].startswith("compressed")
    # the shared factor is one module, applied once per MLP call
    mlp = model.model.layers[1].mlp
    assert mlp.gate_proj.input_factor is mlp.up_proj.input_factor
    assert isinstance(mlp.gate_proj.input_factor, SharedInputFactor)


def test_shared_input_factor_reuse_matches_the_reference_path():
    model = tiny_model("llama")
    compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.3), progress=False)
    fast = logits(model)
    for module in model.modules():
        if isinstance(module, SharedInputFactor):
            module.reuse = False
    assert torch.equal(logits(model), fast)


def test_gpt2_fused_qkv_becomes_three_factored_parts():
    model = tiny_model("gpt2")
    manifest = compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.3), progress=False)
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, SplitOutputLinear) and len(c_attn.parts) == 3
    split = next(e for e in manifest["modules"] if e["module"] == "transformer.h.0.attn.c_attn")
    assert [p["projection"] for p in split["parts"]] == ["q", "k", "v"]
    assert [p["how"] for p in split["parts"]] == ["joint_qk", "joint_qk", "rootcov"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["svd", "rootcov", "latentllm"])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5])
def test_budget_achieves_the_requested_ratio_within_one_rank_step(family, method, ratio):
    model = tiny_model(family)
    dense_flops = linear_flops_per_token(model)
    manifest = compress_model(model, calib_ids(sequences=3), CompressOptions(method=method, ratio=ratio), progress=False)
    achieved = manifest["achieved_ratio"]
    assert ratio <= achieved <= ratio + rank_step_slack(manifest["modules"])
    # the manifest's count is the modules' real count
    weights = sum(m.num_weights(count_input=not isinstance(m.input_factor, SharedInputFactor) or _owner(m, model))
                  for m in model.modules() if isinstance(m, FactoredLinear))
    assert weights == manifest["budget"]["weights_after"]
    assert linear_flops_per_token(model) < dense_flops
    identity = [e["identity_block"] for e in iter_leaf_entries(manifest["modules"])]
    assert all(identity) if method == "latentllm" else not any(identity)
    if method == "latentllm":
        assert any(isinstance(m, IdentityBlockInputFactor) for m in model.modules())


def _owner(module: FactoredLinear, model) -> bool:
    """The first FactoredLinear (in module order) using a shared factor owns its weights."""
    first = next(m for m in model.modules() if isinstance(m, FactoredLinear) and m.input_factor is module.input_factor)
    return first is module


def test_latentllm_components_can_be_switched_off():
    model = tiny_model("llama")
    manifest = compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.3, joint_qk=False, joint_mlp=False, identity_block=False),
                              progress=False)
    hows = {e["how"] for e in iter_leaf_entries(manifest["modules"])}
    assert hows == {"rootcov"}
    assert not any(e["identity_block"] for e in iter_leaf_entries(manifest["modules"]))


def test_nan_weights_raise_a_clear_error_and_never_yield_a_layer():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(FactorizationError, match=r"model\.layers\.1\.self_attn\.v_proj"):
        compress_model(model, calib_ids(), CompressOptions(method="rootcov", ratio=0.3), progress=False)


def test_opt_relu_mlp_uses_the_paper_alternation():
    model = tiny_model("opt")
    manifest = compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.3), progress=False)
    fc1 = next(e for e in manifest["modules"] if e["module"] == "model.decoder.layers.0.fc1")
    fc2 = next(e for e in manifest["modules"] if e["module"] == "model.decoder.layers.0.fc2")
    assert fc1["how"] == fc2["how"] == "relu_ud" and len(fc1["objective"]) == 4
    assert fc1["damping"]["relative"] == 1e-6 and all(lam > 0 for lam in fc1["damping"]["lambda"])


def test_nan_activations_raise():
    model = tiny_model("opt")
    with torch.no_grad():
        model.model.decoder.layers[0].self_attn_layer_norm.weight[0] = float("nan")
    with pytest.raises(FactorizationError, match="non-finite"):
        compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.3), progress=False)


def test_unsupported_architecture_lists_the_supported_ones():
    config = GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="gpt_neox.*Llama, Mistral, Qwen2.*OPT.*GPT-2"):
        Architecture(model)


@pytest.mark.parametrize("bad", [{"method": "tucker", "ratio": 0.2}, {"method": "svd", "ratio": 1.0}, {"method": "svd", "ratio": -0.1}])
def test_bad_options_raise_before_work(bad):
    with pytest.raises(ValueError, match="method|ratio"):
        compress_model(tiny_model("llama"), None, CompressOptions(**bad), progress=False)


def test_data_methods_need_calibration_tokens():
    with pytest.raises(ValueError, match="calibration"):
        compress_model(tiny_model("llama"), None, CompressOptions(method="rootcov", ratio=0.2), progress=False)


def test_identity_block_factor_matches_its_dense_weight():
    torch.manual_seed(0)
    factor = IdentityBlockInputFactor(12, 5)
    with torch.no_grad():
        factor.perm.copy_(torch.randperm(12))
        factor.rest_weight.normal_()
    x = torch.randn(2, 7, 12)
    assert torch.allclose(factor(x), x @ factor.dense_weight().T, atol=1e-6)
    assert torch.allclose(factor(x[0, :1]), x[0, :1] @ factor.dense_weight().T, atol=1e-6), "one token (decode)"
