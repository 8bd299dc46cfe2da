"""The LM around the attention kinds: cached decode, generate(), save/load, config errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import slimkv  # noqa: F401  (registers the Auto classes)
from slimkv import ModelConfig, SlimKVForCausalLM
from tests.helpers import attention_cases, case_id, rel_rmse

CASES = attention_cases()


def tiny(kind="mha", opts=None, **kw) -> SlimKVForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, attention=kind, attention_options=opts or {}, **kw)
    return SlimKVForCausalLM(cfg).eval()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_then_decode_equals_full_forward(case):
    model = tiny(*case).double()
    ids = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        pieces = [model(ids[:, :11], cache=cache).logits]
        for t in range(11, 30):
            pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert cache.seq_len == 30
    assert cache.nbytes() == model.cache_bytes(30, torch.float64, batch_size=2)
    assert rel_rmse(torch.cat(pieces, 1), full) < 1e-10


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generate_equals_handwritten_greedy_loop(case):
    model = tiny(*case)
    prompt = torch.randint(1, 61, (2, 7))  # 0 is the pad token
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        cache, tokens = model.new_cache(2), [prompt]
        logits = model(prompt, cache=cache).logits[:, -1]
        for _ in range(12):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = model(nxt, cache=cache).logits[:, -1]
    assert torch.equal(generated, torch.cat(tokens, 1))


def test_sampling_generate_runs_and_is_seeded():
    model = tiny()
    prompt = torch.randint(1, 61, (1, 5))
    torch.manual_seed(3)
    a = model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(3)
    b = model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=20, pad_token_id=0)
    assert a.shape == (1, 15) and torch.equal(a, b)


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_roundtrip_through_auto_classes(tmp_path, tie):
    model = tiny(["mha", "swa"], kind_options={"swa": {"window": 5}}, tie_word_embeddings=tie, mlp="relu2")
    ids = torch.randint(0, 61, (2, 17))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.pt"))
    assert AutoConfig.from_pretrained(tmp_path).model_type == "slimkv"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, SlimKVForCausalLM)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_hybrid_layers_use_their_own_kinds():
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=4, attention=["mha", "swa"], kind_options={"swa": {"window": 5}})
    model = SlimKVForCausalLM(cfg)
    assert [a.kind for a in model.attention_layers] == ["mha", "swa", "mha", "swa"]
    assert [getattr(a, "window", None) for a in model.attention_layers] == [None, 5, None, 5]


def test_loss_is_next_token_cross_entropy():
    model = tiny()
    ids = torch.randint(0, 61, (2, 9))
    out = model(ids, labels=ids)
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 61), ids[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, manual)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"attention": "mhx"}, "mhx"),
        ({"attention": "mha", "attention_options": {"window": 3}}, "window"),
        ({"attention": ["mha", "swa", "mha"], "n_layers": 4}, "n_layers"),
        ({"attention": "mha", "kind_options": {"swa": {"window": 3}}}, "swa"),
        ({"mlp": "gelu"}, "mlp"),
        ({"n_layers": 0}, "n_layers"),
        ({"d_model": 30, "n_heads": 4}, "n_heads"),
        ({"attention": "kvm", "attention_options": {"chunk_size": 4, "schedule": lambda ctx: 3}}, "schedule"),
    ],
)
def test_config_errors_name_the_option(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ModelConfig(**kwargs)


def test_padding_mask_is_refused():
    model = tiny()
    ids = torch.randint(0, 61, (2, 5))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=mask)
