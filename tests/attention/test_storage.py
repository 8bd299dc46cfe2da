"""Every kind with per-token rows composes with quantized storage (``new_cache(storage=...)``);
the kinds whose memory is updated in place refuse it."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.model import SlimKVForCausalLM
from slimkv.model.config import STATEFUL_KINDS, ModelConfig
from slimkv.ops.quantize import QuantizedBuffer, parse_storage
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, attention_cases, case_id, random_splits, rel_rmse

CASES = [case for case in attention_cases() if case[0] not in STATEFUL_KINDS]
SEQ = 29


def _run(attn, x, sizes, storage):
    cache = attn.new_cache(x.shape[0], dtype=x.dtype, storage=storage)
    outs, start = [], 0
    for n in sizes:
        outs.append(attn(x[:, start:start + n], cache=cache))
        start += n
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_quantized_storage_is_close_and_smaller(case):
    kind, opts = case
    torch.manual_seed(0)
    attn = build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, **opts).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(2, SEQ, D_MODEL, dtype=torch.float64)
        full, full_cache = _run(attn, x, random_splits(SEQ, 0), None)
        within, _ = _run(attn, x, random_splits(SEQ, 1), "int4:group=4,residual=64")  # every row in the residual window
        assert rel_rmse(within, full) < 1e-12
        for spec, tol in (("int8:group=4,residual=0", 0.01), ("int4:group=4,residual=0", 0.08)):
            out, cache = _run(attn, x, [1] * SEQ, spec)
            error = rel_rmse(out, full)
            assert error < tol, (spec, error)
            if any(isinstance(t, QuantizedBuffer) and t.quantized_len() for t in cache.tensors()):  # streaming window=1 keeps only its sink
                assert error > 0 and cache.nbytes() <= full_cache.nbytes()  # equal for 5-wide float64 rows in int8, groups of 4
            assert parse_storage(spec).name in repr(cache)


@pytest.mark.parametrize("kind", STATEFUL_KINDS)
def test_stateful_kinds_refuse_quantized_storage(kind):
    opts = {"kv_rank": 6} if kind == "mla-kvm" else {}
    attn = build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, chunk_size=4, min_rows=6, **opts)
    with pytest.raises(ValueError, match="full"):
        attn.new_cache(1, storage="int8")
    with pytest.raises(ValueError, match="cache_storage"):
        ModelConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS, attention=kind, attention_options=dict(chunk_size=4, min_rows=6, **opts),
                    cache_storage="int4")


def test_model_storage_default_generate_and_save(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS, attention="gqa", attention_options={"n_kv_heads": 2})
    model = SlimKVForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, 40))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(1, storage="int8:group=8,residual=4")
        quantized = model(ids, cache=cache).logits
    assert 0 < rel_rmse(quantized, full) < 0.05 and cache.layers[0].k.quantized_len() == 32  # 36 past the window: two whole blocks of 16
    out = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="quantized",
                         cache_config={"backend": "quanto", "nbits": 4, "q_group_size": 8, "residual_length": 4})
    assert out.shape == (1, 43)
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        model.generate(ids, max_new_tokens=1, cache_implementation="static")
    with pytest.raises(ValueError, match="nbits"):
        model.generate(ids, max_new_tokens=1, cache_implementation="quantized", cache_config={"nbits": 2})
    model.config.cache_storage = "int4"
    model.save_pretrained(tmp_path)
    loaded = SlimKVForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.cache_storage == "int4:group=32,residual=128,block=16"
    assert loaded.new_cache(1).layers[0].storage == parse_storage("int4")
    with pytest.raises(ValueError, match="cache_storage"):
        ModelConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS, cache_storage="int5")


def test_perplexity_of_a_quantized_model_is_scored_through_its_cache():
    from slimkv.eval.ppl import cache_chunk
    from slimkv.scoring import perplexity_of_ids

    torch.manual_seed(0)
    model = SlimKVForCausalLM(ModelConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS, attention="gqa",
                                          attention_options={"n_kv_heads": 2})).eval()
    ids = torch.randint(0, 50, (90,))
    with torch.no_grad():
        plain = perplexity_of_ids(model, ids, 45)
        chunked = perplexity_of_ids(model, ids, 45, cache_chunk=8)
        assert cache_chunk(model) is None and abs(chunked["ppl"] - plain["ppl"]) < 1e-4 * plain["ppl"]
        model.config.cache_storage = "int4:group=4,residual=8"
        assert cache_chunk(model) == 8
        quantized = perplexity_of_ids(model, ids, 45, cache_chunk=cache_chunk(model))
    assert quantized["through_cache_in_calls_of"] == 8 and quantized["ppl"] != plain["ppl"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_float32_cache_counted_at_two_bytes_is_the_bfloat16_cache(case):
    """``nbytes(float_size=2)`` of a float32 model's cache equals the live bytes of the same model in
    bfloat16 after the same tokens, in every storage: the codes and row counts do not depend on the
    dtype (what lets a conversion measure its bfloat16 cache with a float32 prefill)."""
    kind, opts = case
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS, attention=kind, attention_options=opts)
    model = SlimKVForCausalLM(config).eval()
    bf16 = SlimKVForCausalLM(config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50, (1, 90))
    for storage in ("full", "int8:group=4,residual=8,block=4", "int4:group=4,residual=16"):
        caches = model.new_cache(1, storage=storage), bf16.new_cache(1, storage=storage)
        with torch.no_grad():
            for start, stop in ((0, 37), (37, 38), (38, 90)):
                model(ids[:, start:stop], cache=caches[0])
                bf16(ids[:, start:stop], cache=caches[1])
        assert caches[0].nbytes(float_size=2) == caches[1].nbytes(), storage
        assert caches[0].nbytes(float_size=4) == caches[0].nbytes() >= caches[1].nbytes()  # swa window=1 holds nothing between calls


def test_conversion_measures_the_bfloat16_cache_without_a_bfloat16_prefill():
    from slimkv.convert.cache_bytes import measured_cache_bytes
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS, attention="gqa", attention_options={"n_kv_heads": 2},
                         cache_storage="int4:group=4,residual=8")
    model = SlimKVForCausalLM(config).eval()
    bf16 = SlimKVForCausalLM(config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    sizes = measured_cache_bytes(model, [40, 100], torch.bfloat16)
    cache = bf16.new_cache(1)
    with torch.no_grad():
        bf16(torch.zeros(1, 40, dtype=torch.long), cache=cache)
        assert sizes[40] == cache.nbytes()
        bf16(torch.zeros(1, 60, dtype=torch.long), cache=cache)
    assert sizes[100] == cache.nbytes() and next(model.parameters()).dtype == torch.float32
