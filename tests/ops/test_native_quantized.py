"""The native kernel's quantized entry (slimkv/ops/csrc/decode_quantized.h), which reads int8 / int4
cache codes in place, against the plain reference over the rows the codes encode; and the caches
that decode through it (mha/gqa, streaming, hybrid) against their torch path."""

import math

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.ops import attention as attention_ops
from slimkv.ops import native
from slimkv.ops.attention import buffer_segments, reference_attention, stored_decode_attention
from slimkv.ops.codes import QuantizedRows
from slimkv.ops.quantize import parse_storage
from tests.ops.kernel_markers import ISAS, LIBRARY, RULE_SIDES, needs_avx512_bf16, needs_kernel, rule_kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = {  # name -> (kv_heads, query rows per kv head, head width)
    "mha64": (3, 1, 64), "gqa64x3": (3, 3, 64), "gqa128x2": (2, 2, 128), "mqa32x8": (1, 8, 32), "odd48": (2, 3, 48), "odd40": (1, 2, 40),
}
STORAGES = ["int4", "int8", "int4:group=16,residual=5", "int8:group=8,residual=0", "int4:group=64,residual=3", "int4:group=16,residual=2,block=1"]
KEY_COUNTS = [9, 140, 333]
# (storage, keys) with codes to read: rows leave the full-precision window a block at a time, so at least residual + block keys
WITH_CODES = [(storage, keys) for storage in STORAGES for keys in KEY_COUNTS
              if keys >= parse_storage(storage).residual + parse_storage(storage).block]


def _filled(layout, storage, keys, dtype, seed, batch=2):
    """A query and key/value buffers holding ``keys`` tokens (half in one call, the rest one at a time, as prefill then decode)."""
    kv_heads, groups, dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    st = parse_storage(storage)
    kb, vb = (st.buffer(batch, kv_heads, dim, dtype=dtype, device="cpu") for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=gen).to(dtype) for _ in range(2))
    half = keys // 2
    kb.store(k[:, :, :half])
    vb.store(v[:, :, :half])
    for i in range(half, keys):
        kb.store(k[:, :, i:i + 1])
        vb.store(v[:, :, i:i + 1])
    return torch.randn(batch, kv_heads * groups, 1, dim, generator=gen).to(dtype), kb, vb


def _encoded(part):
    """A segment's rows as the cache's own dequantization gives them (in the cache dtype), in float32."""
    return (part.dequantize(part.scale.dtype) if isinstance(part, QuantizedRows) else part).float()


def _expected(q, segments):
    keys = torch.cat([_encoded(k) for k, _ in segments], dim=2)
    values = torch.cat([_encoded(v) for _, v in segments], dim=2)
    return reference_attention(q.float(), keys, values)


def _tolerance(dtype):
    """float32: the reference's own rounding; bfloat16: the output's one rounding (and a dequantized
    value now and then one bfloat16 step away: the kernel's fused multiply-add rounds once, torch's
    multiply and add twice, before the rounding to bfloat16)."""
    return {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-3}


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("storage", "keys"), WITH_CODES)
def test_every_isa_path_reads_codes_as_the_reference_reads_their_rows(isa, dtype, layout, storage, keys):
    """Every path this CPU can run x float32/bfloat16 x head layouts (widths 32-128, widths that are
    not a multiple of the group: padded last groups) x int8/int4 with several groups and residual
    windows x key counts below, across and past a block: codes and the residual window under one softmax."""
    dtype = DTYPES[dtype]
    q, kb, vb = _filled(layout, storage, keys, dtype, seed=keys)
    segments = buffer_segments(kb, vb)
    assert any(isinstance(k, QuantizedRows) for k, _ in segments), "the case has no codes to read (WITH_CODES is wrong)"
    assert native.supports_stored(q, segments)
    out = native.native_stored_attention(q, segments, 1 / math.sqrt(q.shape[-1]), native.isa_kernel(dtype, isa))
    assert out.dtype == dtype and out.shape == (2, q.shape[1], 1, q.shape[-1])
    torch.testing.assert_close(out.float(), _expected(q, segments), **_tolerance(dtype))


@needs_kernel
@needs_avx512_bf16
@pytest.mark.parametrize("side", RULE_SIDES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("storage", ["int4", "int8", "int4:group=64,residual=3"])
def test_avx512_bf16_codes_match_the_reference_with_either_logits_rule(side, layout, storage):
    """The AVX-512 tiles read a bfloat16 cache's codes with the logits by vdpbf16ps or by widened
    keys (TILE_DOT_BF16, chosen per CPU at build time): this CPU's rule and the other one
    (``rule_kernel``) run here."""
    q, kb, vb = _filled(layout, storage, 333, torch.bfloat16, seed=3)
    segments = buffer_segments(kb, vb)
    library = rule_kernel(torch.bfloat16, side)
    out = native.native_stored_attention(q, segments, 1 / math.sqrt(q.shape[-1]), library)
    torch.testing.assert_close(out.float(), _expected(q, segments), **_tolerance(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_codes_window_and_the_new_token_are_one_softmax(dtype):
    """The four segments a quantized streaming cache's decode step reads."""
    dtype = DTYPES[dtype]
    q, kb, vb = _filled("gqa64x3", "int4:group=32,residual=16", 100, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    sinks = tuple(torch.randn(2, 3, 4, 64, generator=gen).to(dtype) for _ in range(2))
    new = tuple(torch.randn(2, 3, 1, 64, generator=gen).to(dtype) for _ in range(2))
    segments = [sinks, *buffer_segments(kb, vb), new]
    assert len(segments) == native.MAX_SEGMENTS
    out = stored_decode_attention(q, segments)
    torch.testing.assert_close(out.float(), _expected(q, segments), **_tolerance(dtype))


@needs_kernel
def test_threads_split_the_heads_without_changing_the_result(monkeypatch):
    q, kb, vb = _filled("gqa64x3", "int4", 400, torch.float32, seed=3)
    segments = buffer_segments(kb, vb)
    one = native.native_stored_attention(q, segments, 0.125, LIBRARY)
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    torch.set_num_threads(2)
    try:
        two = native.native_stored_attention(q, segments, 0.125, LIBRARY)
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_calls_the_quantized_entry_cannot_take_are_refused():
    q, kb, vb = _filled("gqa64x3", "int4:group=32,residual=4", 40, torch.float32, seed=4)
    codes, recent = buffer_segments(kb, vb)
    assert native.supports_stored(q, [codes, recent])
    assert not native.supports_stored(q, [recent])  # nothing quantized: the plain entry's call
    assert not native.supports_stored(q, [(codes[0], recent[1])])  # keys codes, values rows
    assert not native.supports_stored(q, [codes] * (native.MAX_SEGMENTS + 1))
    assert not native.supports_stored(q.double(), [codes, recent])
    assert not native.supports_stored(q.repeat(1, 1, 2, 1), [codes, recent])  # two queries per head
    q8, kb8, vb8 = _filled("gqa64x3", "int8:group=32,residual=4", 40, torch.float32, seed=4)
    assert not native.supports_stored(q, [codes, buffer_segments(kb8, vb8)[0]])  # two storages in one call
    with torch.enable_grad():
        assert not native.supports_stored(q.clone().requires_grad_(), [codes, recent])


def test_without_the_kernel_the_codes_are_dequantized_and_attended(monkeypatch):
    """The torch path (no kernel: SLIMKV_NATIVE=0, no compiler) gives the same answer from the same codes."""
    q, kb, vb = _filled("odd48", "int4:group=32,residual=7", 90, torch.float32, seed=5)
    segments = buffer_segments(kb, vb)
    monkeypatch.setattr(attention_ops, "decode_kernel", lambda dtype: None)
    torch.testing.assert_close(stored_decode_attention(q, segments), _expected(q, segments), rtol=1e-5, atol=2e-6)


CACHED_KINDS = {  # kind -> options, for a small layer whose cache stores its rows quantized
    "gqa": {"n_kv_heads": 2},
    "streaming": {"n_kv_heads": 2, "window": 24, "sink_len": 3},
    "hybrid": {"n_kv_heads": 2, "full_heads": [1], "window": 24, "sink_len": 3},
}


@pytest.mark.parametrize("kind", CACHED_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_through_the_codes_matches_the_dequantizing_path(kind, dtype, monkeypatch):
    """A layer with int4 storage decodes the same tokens whether its steps read the codes in place
    (counted: the quantized entry ran) or dequantize the history (``reads_codes`` turned off)."""
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    layer = build_attention(kind, d_model=64, n_heads=4, **CACHED_KINDS[kind]).to(dtype).eval()
    x = torch.randn(1, 60, 64).to(dtype)
    calls = []
    original = native.native_stored_attention
    monkeypatch.setattr(attention_ops, "native_stored_attention", lambda *a: calls.append(1) or original(*a))

    def run(read_codes: bool) -> torch.Tensor:
        cache = layer.new_cache(1, storage="int4:group=16,residual=8")
        if not read_codes:
            cache.reads_codes = lambda new_tokens, backend: False
        with torch.no_grad():
            outs = [layer(x[:, :40], cache)] + [layer(x[:, i:i + 1], cache) for i in range(40, 60)]
        return torch.cat(outs, dim=1).float()

    in_place, dequantized = run(True), run(False)
    assert calls or LIBRARY is None
    torch.testing.assert_close(in_place, dequantized, **({"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.02}))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,dim", [(32, 64), (32, 130), (64, 5), (8, 48), (2, 3)])
def test_the_native_quantizer_gives_quantize_groups_codes(isa, dtype, bits, group, dim):
    """Ordinary, constant, one-signed, huge and subnormal rows, padded last groups: the codes are
    ``quantize_groups``' exactly, the scales and minima equal in value."""
    from slimkv.ops.codes import quantize_groups

    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(bits * 1000 + group + dim)
    base = torch.randn(2, 3, 5, dim, generator=gen)
    for x in (base, base * 0 + 1.5, base.abs() + 1e-3, -base.abs(), base * 1e30, base * 1e-40):
        x = x.to(dtype)
        expected = quantize_groups(x, bits, group, dtype)
        got = native.native_quantize_groups(x, bits, group, native.isa_kernel(dtype, isa))
        assert torch.equal(got[0], expected[0])
        for g, e in zip(got[1:], expected[1:]):
            assert g.dtype == e.dtype and torch.equal(g, e)
