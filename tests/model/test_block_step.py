"""A decode step of a plain GQA block in one native call (slimkv.model.block_step, csrc/decode_block.h)
against the module path, its reference: the same logits and the same cache to the bit, and the
module path wherever the block or the call is not one the entry takes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.model.block_step import block_step, block_step_counts
from slimkv.model.modeling import Block
from slimkv.ops import native
from tests.ops.kernel_markers import needs_kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tiny(kind="gqa", opts=None, **kw) -> SlimKVForCausalLM:
    torch.manual_seed(0)
    opts = {"n_kv_heads": 2} if opts is None and kind == "gqa" else opts or {}
    cfg = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, attention=kind, attention_options=opts, **kw)
    return SlimKVForCausalLM(cfg).eval()


def blocks(model) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


def decode(model, ids, steps, one_call, storage=None):
    """Prefill ``ids``, then ``steps`` greedy tokens one at a time: (every step's logits, the cache)."""
    for block in blocks(model):
        block.native_step = one_call
    cache = model.new_cache(1, storage=storage) if storage else model.new_cache(1)
    logits = [model(ids, cache=cache).logits[:, -1:]]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1), cache=cache).logits)
    return torch.cat(logits, 1), cache


def _states(cache) -> list[torch.Tensor]:
    """Every live tensor a cache holds (codes, scales, minima, rows), layer by layer."""
    out = []
    for layer in cache.layers:
        for part in layer.tensors():
            if isinstance(part, torch.Tensor):
                out.append(part)
            elif hasattr(part, "codes"):
                out += [part.codes.view(), part.scale.view(), part.low.view(), part.recent.view()]
            else:
                out.append(part.view())
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "opts", "storage"), [
    ("gqa", None, None), ("mha", None, None), ("mqa", None, None), ("gqa", {"n_kv_heads": 2, "rope_fraction": 0.5}, None),
    ("hybrid", {"n_kv_heads": 2, "full_heads": [1], "window": 6, "sink_len": 2}, None),
    ("hybrid", {"n_kv_heads": 4, "full_heads": [0, 2], "window": 5, "sink_len": 3}, None),
    ("hybrid", {"n_kv_heads": 2, "full_heads": [], "window": 1, "sink_len": 0}, None),
    ("hybrid", {"n_kv_heads": 2, "full_heads": [0, 1], "window": 4}, None),
    ("gqa", None, "int8:group=16,residual=3,block=2"),
    ("mqa", None, "int4:group=32,residual=0,block=5"),
    ("hybrid", {"n_kv_heads": 2, "full_heads": [0], "window": 6, "sink_len": 2}, "int4:group=16,residual=4,block=2"),
    ("hybrid", {"n_kv_heads": 4, "full_heads": [1, 3], "window": 9, "sink_len": 1}, "int8:group=32,residual=2,block=3"),
], ids=["gqa", "mha", "mqa", "gqa-half-rope", "hybrid", "hybrid-apart", "hybrid-no-exact-window-1", "hybrid-all-exact", "gqa-int8",
        "mqa-int4-no-residual", "hybrid-int4", "hybrid-int8-apart"])
def test_native_step_equals_the_module_path_to_the_bit(dtype, kind, opts, storage):
    """Prefill 60 tokens then 12 steps: the buffers grow past their first 64 rows mid-way (the
    reserve moves the storage), a hybrid's window drops rows and its storage is compacted; the
    first step after an empty cache is covered by the 1-token prefill case below. Per-head roles
    (hybrid): exact heads apart from each other, no exact head, no streaming head, no sinks.
    int8 / int4 storage: rows quantized ahead of the call (a block every few steps), and with no
    residual window a step whose new row would be quantized at once takes two calls instead."""
    model = tiny(kind, opts).to(DTYPES[dtype])
    ids = torch.randint(0, 61, (1, 60))
    with torch.no_grad():
        module_logits, module_cache = decode(model, ids, 12, one_call=False, storage=storage)
        calls = []
        original = block_step.__globals__["native_block_step"]
        block_step.__globals__["native_block_step"] = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            fused_logits, fused_cache = decode(model, ids, 12, one_call=True, storage=storage)
        finally:
            block_step.__globals__["native_block_step"] = original
    whole = 10 if storage and "residual=0," in storage else 12  # with no residual, 2 of the 12 new rows leave the window at once
    assert len(calls) == whole * len(blocks(model)), "the one-call step did not take every decode step it can"
    assert torch.equal(fused_logits, module_logits)
    assert all(torch.equal(a, b) for a, b in zip(_states(fused_cache), _states(module_cache), strict=True))
    assert all(a.seq_len == b.seq_len for a, b in zip(fused_cache.layers, module_cache.layers))
    assert fused_cache.nbytes() == module_cache.nbytes()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "opts", "storage"), [
    ("swa", {"n_kv_heads": 2, "window": 8}, None),
    ("gqa", None, "int8:group=16,residual=0,block=1"),
], ids=["swa", "gqa-int8-no-window"])
def test_two_calls_around_the_attention_equal_the_module_path_to_the_bit(dtype, kind, opts, storage):
    """Attention that keeps its own kind of cache (a sliding window; rows quantized as they come,
    with no full-precision window): the native calls before and after its ``attend_rows``, the
    rows it caches and quantizes, windows that drop rows, all as the module path."""
    model = tiny(kind, opts).to(DTYPES[dtype])
    ids = torch.randint(0, 61, (1, 30))
    with torch.no_grad():
        module_logits, module_cache = decode(model, ids, 12, one_call=False, storage=storage)
        calls = []
        original = block_step.__globals__["native_block_input"]
        block_step.__globals__["native_block_input"] = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            fused_logits, fused_cache = decode(model, ids, 12, one_call=True, storage=storage)
        finally:
            block_step.__globals__["native_block_input"] = original
    assert len(calls) == 12 * len(blocks(model)), "the two-call step did not take every decode step"
    assert torch.equal(fused_logits, module_logits)
    assert all(torch.equal(a, b) for a, b in zip(_states(fused_cache), _states(module_cache), strict=True))
    assert fused_cache.nbytes() == module_cache.nbytes()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [
    {"kv_rank": 24, "rope_dim": 8, "latent_norm": False},
    {"kv_rank": 13, "latent_norm": False, "rope_frequencies": [0.9, 0.05, 0.9], "v_head_dim": 12},
], ids=["mla", "mla-converted-shape"])
def test_an_mla_block_takes_two_calls_around_its_attention_and_equals_the_module_path_to_the_bit(dtype, opts):
    """MLA as a conversion makes it (no latent norm; an odd rank, its own rotary frequencies, a
    value width of its own): the norm, q, the cache row and RoPE in one native call, the module
    path's absorbed attention, then Wo and the SwiGLU half in one: the same logits and cache rows
    as the module path, from a 1-token prompt (an empty cache's first step) and after a prefill."""
    model = tiny("mla", opts).to(DTYPES[dtype])
    assert block_step_counts(model) == {"one_call": 0, "two_calls": 2, "module_path": 0}
    ids = torch.randint(0, 61, (1, 30))
    calls = []
    original = block_step.__globals__["native_latent_input"]
    with torch.no_grad():
        module_logits, module_cache = decode(model, ids, 12, one_call=False)
        block_step.__globals__["native_latent_input"] = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            fused_logits, fused_cache = decode(model, ids, 12, one_call=True)
            assert len(calls) == 12 * len(blocks(model)), "the two-call step did not take every decode step"
            outputs = {}
            for one_call in (False, True):
                for block in blocks(model):
                    block.native_step = one_call
                outputs[one_call] = model.generate(ids[:, :1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        finally:
            block_step.__globals__["native_latent_input"] = original
    assert torch.equal(fused_logits, module_logits)
    assert all(torch.equal(a, b) for a, b in zip(_states(fused_cache), _states(module_cache), strict=True))
    assert torch.equal(outputs[True], outputs[False])


@needs_kernel
def test_the_first_token_and_generate_agree():
    """A 1-token prompt (the first step reads an empty cache: two calls around the prefill's attention) and generate()."""
    model = tiny()
    prompt = torch.randint(1, 61, (1, 1))
    outputs = {}
    for one_call in (False, True):
        for block in blocks(model):
            block.native_step = one_call
        with torch.no_grad():
            outputs[one_call] = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(outputs[True], outputs[False])


@needs_kernel
def test_a_weight_replaced_between_steps_is_read_anew():
    """The plan keeps weight addresses: after .to(bfloat16) or a load_state_dict the step must read the new weights."""
    model = tiny()
    ids = torch.randint(0, 61, (1, 20))
    with torch.no_grad():
        decode(model, ids, 3, one_call=True)  # plans built for float32
        model.to(torch.bfloat16)
        fused, _ = decode(model, ids, 5, one_call=True)
        module, _ = decode(model, ids, 5, one_call=False)
        assert torch.equal(fused, module)
        other = tiny()
        torch.manual_seed(1)
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in other.state_dict().items()})
        fused, _ = decode(model, ids, 5, one_call=True)
        module, _ = decode(model, ids, 5, one_call=False)
        assert torch.equal(fused, module)
        attn = blocks(model)[1].attn
        swapped = type(attn.q_proj)(64, 64, bias=False).to(torch.bfloat16)  # a module swapped in: its weights, not the old ones
        attn.q_proj = swapped
        fused, _ = decode(model, ids, 5, one_call=True)
        module, _ = decode(model, ids, 5, one_call=False)
    assert torch.equal(fused, module)
    assert blocks(model)[1].__dict__["_step_plan"].weights.wq is swapped.weight


def _first_block_and_cache(model, tokens=5):
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 61, (1, tokens)), cache=cache)
    return blocks(model)[0], cache.layers[0]


@pytest.mark.parametrize(("kind", "opts", "extra", "storage"), [
    ("streaming", {"n_kv_heads": 2, "window": 8, "sink_len": 2}, {}, None),
    ("gqa", {"n_kv_heads": 2, "qk_norm": True}, {}, None),
    ("gqa", {"n_kv_heads": 2, "bias": True}, {}, None),
    ("gqa", None, {"mlp": "relu2"}, None),
    ("mla", {"kv_rank": 16, "rope_dim": 8}, {}, None),
    ("mla", {"kv_rank": 16, "rope_dim": 8, "latent_norm": False, "q_rank": 8}, {}, None),
    ("mla-kvm", {"kv_rank": 16, "rope_dim": 8, "latent_norm": False}, {}, None),
], ids=["streaming", "qk-norm", "bias", "relu2-mlp", "mla-latent-norm", "mla-query-latent", "mla-kvm"])
def test_blocks_the_entry_does_not_compute_take_the_module_path(kind, opts, extra, storage):
    model = tiny(kind, opts, **extra)
    cache = model.new_cache(1, storage=storage) if storage else model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 5)), cache=cache)
        assert block_step(blocks(model)[0], torch.randn(1, 1, 64), cache.layers[0]) is None


def test_a_kind_that_projects_its_own_way_takes_the_module_path():
    """A subclass overriding project_qkv computes something the native input half does not."""
    model = tiny("swa", {"n_kv_heads": 2, "window": 8})
    block, cache = _first_block_and_cache(model)
    base = type(block.attn)
    block.attn.__class__ = type("ScaledProjection", (base,), {"project_qkv": lambda self, x, start: base.project_qkv(self, 2 * x, start)})
    with torch.no_grad():
        assert block_step(block, torch.randn(1, 1, 64), cache) is None


def test_calls_the_entry_does_not_take_go_to_the_module_path():
    model = tiny()
    block, cache = _first_block_and_cache(model)
    x = torch.randn(1, 1, 64)
    assert block_step(block, torch.randn(1, 2, 64), cache) is None  # two tokens
    assert block_step(block, x.double(), cache) is None  # another dtype than the weights'
    with torch.enable_grad():
        assert block_step(block, x, cache) is None  # autograd: the weights need grad

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Watch():
        assert block_step(block, x, cache) is None  # a FLOP counter must see the module path's operations
    handle = block.attn.q_proj.register_forward_hook(lambda *a: None)
    with torch.no_grad():
        assert block_step(block, x, cache) is None  # a hook must see its module's call
    handle.remove()
    block.attn.set_runtime_options(backend="reference")
    with torch.no_grad():
        assert block_step(block, x, cache) is None  # the reference backend is a request for the plain path
    block.attn.set_runtime_options(backend="sdpa")
    block.native_step = False
    with torch.no_grad():
        assert block_step(block, x, cache) is None
    assert cache.seq_len == 5
    if native.decode_kernel() is not None:  # and the same call, every condition met, takes it
        block.native_step = True
        with torch.no_grad():
            assert block_step(block, x, cache) is not None
        assert cache.seq_len == 6


@needs_kernel
def test_a_failed_step_leaves_a_quantized_cache_as_it_was(monkeypatch):
    """Rows quantized ahead of the call are put back when the call fails, as the module path leaves a cache."""
    model = tiny("hybrid", {"n_kv_heads": 2, "full_heads": [1], "window": 6, "sink_len": 2})
    cache = model.new_cache(1, storage="int4:group=16,residual=2,block=2")
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 21)), cache=cache)  # 21 rows: the next one pushes a block of the exact heads' rows out of the window
        layer = cache.layers[0]
        before, codes = [t.clone() for t in _states(cache)], layer.full_k.quantized_len()

        def fail(*args, **kwargs):
            assert layer.full_k.quantized_len() > codes  # the block was quantized ahead of the call
            raise RuntimeError("native block step failed (status 1: out of memory or threads)")
        monkeypatch.setitem(block_step.__globals__, "native_block_step", fail)
        with pytest.raises(RuntimeError, match="status 1"):
            model(torch.tensor([[3]]), cache=cache)
    assert layer.seq_len == 21 and layer.full_k.quantized_len() == codes
    assert all(torch.equal(a, b) for a, b in zip(_states(cache), before, strict=True))


@needs_kernel
def test_a_cache_of_another_block_is_refused_before_anything_is_written():
    model = tiny()
    other = tiny("gqa", {"n_kv_heads": 4})
    block = blocks(model)[0]
    _, foreign = _first_block_and_cache(other)
    before = foreign.k.view().clone()
    with torch.no_grad(), pytest.raises(ValueError, match="cache was made by a module"):
        block_step(block, torch.randn(1, 1, 64), foreign)
    assert foreign.seq_len == 5 and torch.equal(foreign.k.view(), before)
