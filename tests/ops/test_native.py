"""The native decode kernel (slimkv/ops/csrc/decode_attention.c) against the plain reference, and
its build, cache and fallback behaviour."""

import concurrent.futures
import math
import time

import pytest
import torch

from slimkv.common.paths import cache_dir
from slimkv.ops import native, native_build
from slimkv.ops.attention import decode_attention, matmul_decode_attention, reference_attention
from tests.ops.kernel_markers import (
    FLOAT32_PATH,
    ISAS,
    LIBRARY,
    RULE_SIDES,
    needs_amx,
    needs_avx512,
    needs_avx512_bf16,
    needs_compiler,
    needs_kernel,
    rule_kernel,
)


def _cache(batch, kv_heads, keys, dim, v_dim, *, spare=0, seed=0):
    """Keys and values as a decode cache holds them: the live part of a larger buffer when ``spare``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, keys + spare, dim, generator=gen)[:, :, :keys]
    v = torch.randn(batch, kv_heads, keys + spare, v_dim, generator=gen)[:, :, :keys]
    return k, v


@needs_kernel
@pytest.mark.parametrize("kv_heads,groups", [(4, 1), (2, 4), (1, 8), (3, 2)])
@pytest.mark.parametrize("dim,v_dim", [(64, 64), (32, 32), (128, 128), (40, 24), (16, 48)])
@pytest.mark.parametrize("keys", [1, 63, 64, 65, 300])
def test_native_matches_the_reference(kv_heads, groups, dim, v_dim, keys):
    k, v = _cache(2, kv_heads, keys, dim, v_dim, spare=7)
    q = torch.randn(2, kv_heads * groups, 1, dim)
    assert native.supports([q], [(k, v)])
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(dim), LIBRARY)
    torch.testing.assert_close(out, reference_attention(q, k, v), rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("groups", [1, 3, 8, 9])
@pytest.mark.parametrize("dim,v_dim", [(192, 160), (288, 256), (100, 36), (17, 5)])
@pytest.mark.parametrize("keys", [1, 66, 257])
def test_wide_rows_and_many_query_heads_match_the_reference(groups, dim, v_dim, keys):
    """Widths other than 32/64/128 (MLA's latent rows, odd widths) and MLA's 8-9 query heads per key head."""
    k, v = _cache(2, 1, keys, dim, v_dim, spare=3, seed=groups)
    q = torch.randn(2, groups, 1, dim)
    assert native.supports([q], [(k, v)])
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(dim), LIBRARY)
    torch.testing.assert_close(out, reference_attention(q, k, v), rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("rope,rank", [(32, 160), (64, 64), (16, 48), (8, 20)])
def test_values_read_in_place_from_the_key_rows(rope, rank):
    """MLA's absorbed decode: the cached rows [k_pe | c] are the keys and their c part the values,
    a strided view of the same memory that the kernel reads without a copy."""
    gen = torch.Generator().manual_seed(rope)
    rows = torch.randn(2, 1, 300 + 5, rope + rank, generator=gen)[:, :, :300]
    q = torch.randn(2, 9, 1, rope + rank, generator=gen)
    keys, values = rows, rows[..., rope:]
    assert values.stride(2) == rope + rank and native.supports([q], [(keys, values)])
    out = native.native_decode_attention([q], [(keys, values)], 0.07, LIBRARY)
    torch.testing.assert_close(out, reference_attention(q, keys.contiguous(), values.contiguous(), scale=0.07), rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("kv_heads,groups", [(4, 1), (2, 4), (1, 9)])
@pytest.mark.parametrize("dim,v_dim", [(64, 64), (32, 32), (128, 128), (192, 152), (40, 24)])
@pytest.mark.parametrize("keys", [1, 65, 300])
def test_bfloat16_caches_match_the_float32_reference_to_one_rounding(kv_heads, groups, dim, v_dim, keys):
    """The bfloat16 build reads bfloat16 rows and computes in float32, so its only error against
    the float32 reference on the same (bfloat16-representable) values is the output's one rounding."""
    k, v = (x.to(torch.bfloat16) for x in _cache(2, kv_heads, keys, dim, v_dim, spare=5, seed=keys))
    q = torch.randn(2, kv_heads * groups, 1, dim).to(torch.bfloat16)
    library = native.decode_kernel(torch.bfloat16)
    assert native.supports([q], [(k, v)]) and library is not None
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(dim), library)
    assert out.dtype == torch.bfloat16
    expected = reference_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-6)


@needs_kernel
def test_bfloat16_latent_rows_are_read_in_place():
    rows = torch.randn(1, 1, 200, 192).to(torch.bfloat16)
    q = torch.randn(1, 9, 1, 192).to(torch.bfloat16)
    out = native.native_decode_attention([q], [(rows, rows[..., 40:])], 0.1, native.decode_kernel(torch.bfloat16))
    expected = reference_attention(q.float(), rows.float(), rows[..., 40:].float(), scale=0.1)
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-6)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = {  # name -> (kv_heads, groups, dim, v_dim, values in the key rows from this offset, "shared", or None)
    "mha32": (4, 1, 32, 32, None), "mha64": (3, 1, 64, 64, None), "mha128": (2, 1, 128, 128, None), "mha-odd": (3, 1, 40, 24, None),
    "gqa64": (2, 4, 64, 64, None), "gqa64x3": (3, 3, 64, 64, None), "gqa64x5": (1, 5, 64, 64, None), "mqa64": (1, 8, 64, 64, None), "gqa128x3": (2, 3, 128, 128, None), "gqa32x9": (1, 9, 32, 32, None),
    "mla288": (1, 8, 288, 256, 32), "mla-odd": (1, 9, 100, 68, 32), "latent": (2, 1, 64, 512, None),
    "latent-shared": (8, 1, 64, 512, "shared"), "latent-shared-odd": (3, 2, 40, 72, "shared"),
    "lrkv192": (1, 8, 192, 192, None), "odd17x5": (1, 3, 17, 5, None), "odd40x24": (3, 2, 40, 24, None),
    "mla288x17": (1, 17, 288, 256, 32), "wide96x3": (2, 3, 96, 48, None), "mqa64x17": (1, 17, 64, 64, None),
    "mha-odd-wide": (2, 1, 40, 76, None),  # one query row, values past one 8-chunk tile with a partial last chunk
}


def _isa_cache(layout, keys, dtype, seed):
    kv_heads, groups, dim, v_dim, offset = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    if offset == "shared":  # the latent kind's cache: per-head keys sliced from one row per token, one value row every head reads
        rows = torch.randn(2, keys + 3, kv_heads * dim, generator=gen).to(dtype)[:, :keys]
        k = rows.view(2, keys, kv_heads, dim).transpose(1, 2)
        v = torch.randn(2, 1, keys + 4, v_dim, generator=gen).to(dtype)[:, :, :keys].expand(2, kv_heads, keys, v_dim)
        assert v.stride(1) == 0
    elif offset is not None:  # MLA's latent rows: the values are the rows past ``offset``, read in place
        rows = torch.randn(2, kv_heads, keys + 3, dim, generator=gen).to(dtype)[:, :, :keys]
        k, v = rows, rows[..., offset:offset + v_dim]
    else:  # one row [k | v] per key (LRKV's cache rows), the live part of a longer buffer
        rows = torch.randn(2, kv_heads, keys + 5, dim + v_dim, generator=gen).to(dtype)[:, :, :keys]
        k, v = rows[..., :dim], rows[..., dim:]
    return torch.randn(2, kv_heads * groups, 1, dim, generator=gen).to(dtype), k, v


def _tolerance(dtype):
    """float32: the reference's own rounding; bfloat16 (same bfloat16 inputs): the output's one rounding."""
    return {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-6}


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_isa_build_reports_its_own_path(isa, dtype):
    """A float32 build of "avx512-bf16" or "amx-bf16" is the avx512 path (their instructions serve bfloat16 rows only) and says so."""
    assert native.library_isa(native.isa_kernel(DTYPES[dtype], isa)) == (isa if dtype == "bfloat16" else FLOAT32_PATH.get(isa, isa))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keys", [1, 23, 67, 300])
def test_every_isa_path_matches_the_reference(isa, dtype, layout, keys):
    """Every path this CPU can run (avx512-bf16, avx512, avx2, portable) x float32/bfloat16 x the
    cache layouts: MHA/GQA/MQA rows of 32/64/128 (one query row per head: the keys-in-lanes
    tiles), MLA's wide latent rows read in place, the latent kind's per-head keys over one value
    row shared by every head (value head stride 0, read once for all heads), LRKV's [k | v] rows,
    odd widths; key counts below, across and past a block of 64 and a 16-key lane tile."""
    dtype = DTYPES[dtype]
    q, k, v = _isa_cache(layout, keys, dtype, seed=keys)
    assert native.supports([q], [(k, v)])
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(q.shape[-1]), native.isa_kernel(dtype, isa))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float()), **_tolerance(dtype))


@needs_kernel
@needs_avx512
@pytest.mark.parametrize("side", RULE_SIDES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["mha64", "gqa64x3", "mqa64", "gqa128x3"])
def test_avx512_row_tiles_match_the_reference_with_either_prefetch_rule(side, dtype, layout):
    """The 32/64/128-wide row tiles prefetch by a rule chosen per CPU at build time
    (ROW_PREFETCH_ALWAYS in csrc/decode_avx512.h: 1 every tile into L1, 0 only items of several tiles
    into L2); this CPU's rule and the other one (``rule_kernel``) run here, on rows long enough to
    prefetch (2700 keys), SmolLM2's 3 query rows per head (one tile of 3) and 128-wide rows (tiles of 2 and 1)."""
    dtype = DTYPES[dtype]
    q, k, v = _isa_cache(layout, 2700, dtype, seed=5)
    library = rule_kernel(dtype, side)
    rules = {native.library_row_prefetch_rule(rule_kernel(dtype, s)) for s in RULE_SIDES}
    assert rules == {"always", "several-tiles"}
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(q.shape[-1]), library)
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float()), **_tolerance(dtype))


@needs_kernel
@needs_avx512_bf16
@pytest.mark.parametrize("side", RULE_SIDES)
@pytest.mark.parametrize("layout", ["mha64", "gqa64x3", "mqa64", "gqa128x3", "gqa32x9", "mla288", "mla-odd", "lrkv192", "latent-shared", "odd40x24"])
def test_avx512_bf16_tiles_match_the_reference_with_either_logits_rule(side, layout):
    """A bfloat16 cache's logits in the AVX-512 tiles are vdpbf16ps dot products or widened keys
    and fused multiply-adds, chosen per CPU at build time (TILE_DOT_BF16 in csrc/decode_avx512.h:
    1 on AMD Zen, 0 elsewhere); this CPU's rule and the other one run here, on the row tiles
    (32/64/128 wide, 1 to 9 query rows per head) and the wide tiles (MLA, LRKV, latent, odd
    widths), each saying which rule it took, and a float32 build has no such choice."""
    q, k, v = _isa_cache(layout, 2700, torch.bfloat16, seed=7)
    library = rule_kernel(torch.bfloat16, side)
    assert {native.library_tile_logits(rule_kernel(torch.bfloat16, s)) for s in RULE_SIDES} == {"vdpbf16ps", "widened fma"}
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(q.shape[-1]), library)
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float()), **_tolerance(torch.bfloat16))
    assert native.library_tile_logits(rule_kernel(torch.float32, side)) is None


@needs_kernel
@needs_amx
@pytest.mark.parametrize(
    "layout", ["mla288", "lrkv192", "mla288x17", "wide96x3", "mla-odd", "odd17x5", "odd40x24", "gqa64x3", "gqa64x5", "mqa64", "mqa64x17", "gqa32x9", "gqa128x3"]
)
@pytest.mark.parametrize("keys", [1, 16, 17, 64, 65, 300, 2700])
@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
def test_amx_logits_match_the_reference(layout, keys, query_dtype, monkeypatch):
    """The amx-bf16 build's AMX logits (csrc/decode_amx.h) on wide rows shared by 3 to 17 query rows
    (two tiles of rows past 16), 16-key tiles whole and cut short, odd widths (a last chunk of fewer
    than 32 channels: an even count read by a tile of its width, an odd one through zeroed
    scratch), MLA's values inside the key rows, key splits over threads at 2700 keys; on the
    32/64/128-wide rows of heads with more query rows than one row tile holds (5 to 17: whole blocks
    of 64 keys by amx_logits_block's resident query tiles where the queries are bfloat16 and 16 rows
    or fewer, the rest by amx_logits), and 3 rows of 64 that the row tiles keep. float32 queries that
    bfloat16 cannot hold take all three bfloat16 parts of the split, and the float32 output is held to
    float32's tolerance."""
    q, k, v = _isa_cache(layout, keys, torch.bfloat16, seed=keys)
    if query_dtype == "float32":
        q = q.float() * (1 + 1e-3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(keys)))
    library = native.isa_kernel(torch.bfloat16, "amx-bf16")
    assert native.library_isa(library) == "amx-bf16"
    scale = 1 / math.sqrt(q.shape[-1])
    expected = reference_attention(q.float(), k.float(), v.float(), scale=scale)
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    with_threads = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            out = native.native_decode_attention([q], [(k, v)], scale, library)
        finally:
            torch.set_num_threads(with_threads)
        torch.testing.assert_close(out.float(), expected, **_tolerance(q.dtype))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["mla288", "lrkv192", "latent-shared", "gqa64", "mla-odd"])
def test_every_isa_path_matches_the_reference_on_segments_long_enough_to_prefetch(isa, dtype, layout):
    """Segments of over 1 MiB per work item with rows of over 256 bytes per key take the tiled
    paths' prefetch of the next block (``Ahead`` in csrc/decode_attention.c: the block's key and
    value rows as byte ranges, a share per unit of work): 2700 keys (42 blocks and a partial one),
    MLA's rows with the values inside, LRKV's [k | v] rows, the latent kind's 8 key heads per row
    over shared values, GQA's 64-wide rows, odd widths. Prefetching never changes a result; these
    make sure the addresses it walks and the shares it counts stay in the rows (a prefetch never
    faults, so the reference comparison plus a clean run is the check)."""
    dtype = DTYPES[dtype]
    q, k, v = _isa_cache(layout, 2700, dtype, seed=11)
    assert native.supports([q], [(k, v)])
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(q.shape[-1]), native.isa_kernel(dtype, isa))
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float()), **_tolerance(dtype))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,groups", [(64, 1), (64, 4), (128, 2), (288, 8)])
def test_every_isa_path_attends_kvm_segments_under_one_softmax(isa, dtype, dim, groups):
    """KVM's regions: up to four segments, each with its own (temperature-scaled) queries."""
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(dim + groups)
    lengths = (37, 130, 1, 64)
    segments = [(torch.randn(1, 2, n, dim, generator=gen).to(dtype), torch.randn(1, 2, n, dim, generator=gen).to(dtype)) for n in lengths]
    q = torch.randn(1, 2 * groups, 1, dim, generator=gen).to(dtype)
    queries = [(q.float() * (0.5 + torch.rand(2 * groups, generator=gen)).view(1, -1, 1, 1)).to(dtype) for _ in lengths]
    out = native.native_decode_attention(queries, segments, 0.125, native.isa_kernel(dtype, isa))
    rep = lambda x: x.float().repeat_interleave(groups, dim=1)  # noqa: E731
    logits = torch.cat([qi.float() @ rep(k).transpose(-1, -2) for qi, (k, _) in zip(queries, segments)], dim=-1) * 0.125
    expected = logits.softmax(-1) @ torch.cat([rep(v) for _, v in segments], dim=2)
    torch.testing.assert_close(out.float(), expected, **_tolerance(dtype))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_values_split_over_threads_give_the_same_result(isa, dtype, monkeypatch):
    """Heads that read one value row (the latent kind) are one work item, or shares of the heads
    when there are more threads than batch rows: the same sums either way."""
    dtype = DTYPES[dtype]
    q, k, v = _isa_cache("latent-shared", 300, dtype, seed=5)
    library = native.isa_kernel(dtype, isa)
    one = native.native_decode_attention([q], [(k, v)], 0.125, library)
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        three = native.native_decode_attention([q], [(k, v)], 0.125, library)
    finally:
        torch.set_num_threads(with_threads)
    assert torch.equal(one, three)
    torch.testing.assert_close(one.float(), reference_attention(q.float(), k.float(), v.float(), scale=0.125), **_tolerance(dtype))


def test_runnable_isas_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(native_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: {"avx2", "fma", "sse2"})
    assert native.runnable_isas() == ["avx2", "portable"]
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw"})
    assert native.runnable_isas() == ["avx512", "avx2", "portable"]
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
    assert native.runnable_isas() == ["avx512-bf16", "avx512", "avx2", "portable"]
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"})
    monkeypatch.setattr(native_build, "amx_permitted", lambda: True)
    assert native.runnable_isas() == ["amx-bf16", "avx512-bf16", "avx512", "avx2", "portable"]
    monkeypatch.setattr(native_build, "amx_permitted", lambda: False)  # the CPU has AMX, the OS does not hand it out
    assert native.runnable_isas() == ["avx512-bf16", "avx512", "avx2", "portable"]
    monkeypatch.setattr(native_build.platform, "machine", lambda: "aarch64")
    assert native.runnable_isas() == ["portable"]


def test_an_unknown_isa_is_refused(tmp_path):
    with pytest.raises(ValueError, match="isa 'sse9' is not allowed; allowed values: amx-bf16, avx512-bf16, avx512, avx2, portable"):
        native.build("cc", tmp_path, isa="sse9")


@needs_kernel
def test_kernel_isa_is_what_the_loaded_library_says():
    """The default build is the CPU's best path; for float32 caches "amx-bf16" and "avx512-bf16" are the avx512 path."""
    best = native.runnable_isas()[0]
    assert native.kernel_isa() == native.library_isa(LIBRARY) == FLOAT32_PATH.get(best, best)
    assert native.kernel_isa(torch.bfloat16) == native.runnable_isas()[0]
    assert native.kernel_tile_logits(torch.float32) is None
    expected = {"amx-bf16": {"vdpbf16ps", "widened fma"}, "avx512-bf16": {"vdpbf16ps", "widened fma"}, "avx512": {"widened fma"}}.get(native.runnable_isas()[0], {None})
    assert native.kernel_tile_logits(torch.bfloat16) in expected


def test_kernel_isa_says_why_there_is_no_kernel(monkeypatch, tmp_path):
    assert native.kernel_isa(torch.float16) == "torch (no native build for float16)"
    monkeypatch.setenv("SLIMKV_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    native.decode_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C compiler"):
            assert native.kernel_isa() == "torch (no compiler)"
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        native.decode_kernel.cache_clear()
        assert native.kernel_isa() == "torch (SLIMKV_NATIVE=0)"
    finally:
        native.decode_kernel.cache_clear()


def test_dtypes_without_a_build_have_no_kernel():
    assert native.decode_kernel(torch.float16) is None and native.kernel_path(torch.float64) is None


def test_mixed_dtypes_are_refused():
    k, v = _cache(1, 2, 10, 16, 16)
    q = torch.randn(1, 2, 1, 16)
    assert not native.supports([q], [(k.to(torch.bfloat16), v.to(torch.bfloat16))])
    assert not native.supports([q.half()], [(k.half(), v.half())])


@needs_kernel
def test_decode_attention_takes_the_native_path_and_agrees_with_the_matmul_path(monkeypatch):
    k, v = _cache(1, 2, 500, 64, 64)
    q = torch.randn(1, 8, 1, 64)
    calls = []
    real = native.native_decode_attention
    monkeypatch.setattr("slimkv.ops.attention.native_decode_attention", lambda *a: calls.append(1) or real(*a))
    out = decode_attention(q, k, v, scale=0.3)
    assert calls == [1]
    torch.testing.assert_close(out, matmul_decode_attention(q, k, v, scale=0.3), rtol=1e-5, atol=2e-6)


@needs_kernel
def test_segments_are_one_softmax_with_a_query_each():
    """Two segments with their own queries equal one attention over the concatenated keys with
    per-region scaled logits (KVM's rows and window with temperatures)."""
    (k1, v1), (k2, v2) = _cache(1, 2, 37, 64, 64, seed=1), _cache(1, 2, 90, 64, 64, seed=2)
    q = torch.randn(1, 4, 1, 64)
    tau1, tau2 = torch.rand(4) + 0.5, torch.rand(4) + 0.5
    q1, q2 = q * tau1.view(1, 4, 1, 1), q * tau2.view(1, 4, 1, 1)
    out = native.native_decode_attention([q1, q2], [(k1, v1), (k2, v2)], 0.125, LIBRARY)
    rep = lambda x: x.repeat_interleave(2, dim=1)  # noqa: E731
    logits = torch.cat((q1 @ rep(k1).transpose(-1, -2), q2 @ rep(k2).transpose(-1, -2)), dim=-1) * 0.125
    expected = logits.softmax(-1) @ torch.cat((rep(v1), rep(v2)), dim=2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_query_tensor_for_several_segments_and_strided_queries(dtype):
    """The wrapper widens each distinct query tensor once (a tensor passed for several segments is
    read from one float32 copy), takes float32 queries as they are when contiguous and copies
    strided ones, and returns float32 outputs without another copy."""
    dtype = DTYPES[dtype]
    (k1, v1), (k2, v2) = (tuple(x.to(dtype) for x in _cache(1, 2, n, 40, 24, seed=n)) for n in (70, 130))
    q = torch.randn(1, 6, 1, 80).to(dtype)[..., ::2]  # every other channel: rows not contiguous
    assert not q.is_contiguous() and native.supports([q, q], [(k1, v1), (k2, v2)])
    out = native.native_decode_attention([q, q], [(k1, v1), (k2, v2)], 0.2, native.decode_kernel(dtype))
    keys, values = torch.cat((k1, k2), dim=2).float(), torch.cat((v1, v2), dim=2).float()
    expected = reference_attention(q.float(), keys.repeat_interleave(3, dim=1), values.repeat_interleave(3, dim=1), scale=0.2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **_tolerance(dtype))


@needs_kernel
def test_threads_split_the_heads_without_changing_the_result(monkeypatch):
    k, v = _cache(2, 4, 3000, 64, 64)
    q = torch.randn(2, 8, 1, 64)
    one = native.native_decode_attention([q], [(k, v)], 0.125, LIBRARY)
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        three = native.native_decode_attention([q], [(k, v)], 0.125, LIBRARY)
    finally:
        torch.set_num_threads(with_threads)
    assert torch.equal(one, three)


@needs_kernel
def test_large_logits_do_not_overflow():
    k, v = _cache(1, 1, 200, 64, 64)
    q = torch.randn(1, 1, 1, 64) * 200
    out = native.native_decode_attention([q], [(k, v)], 1.0, LIBRARY)
    torch.testing.assert_close(out, reference_attention(q, k, v, scale=1.0), rtol=1e-5, atol=1e-5)


def test_calls_the_kernel_cannot_take_are_refused():
    k, v = _cache(1, 2, 10, 8, 8)
    q = torch.randn(1, 2, 1, 8)
    assert not native.supports([q.double()], [(k.double(), v.double())])
    assert not native.supports([torch.randn(1, 2, 3, 8)], [(k, v)])
    assert not native.supports([q], [(k.transpose(-1, -2).contiguous().transpose(-1, -2), v)])  # columns strided
    assert not native.supports([q] * 5, [(k, v)] * 5)
    assert not native.supports([torch.randn(1, 3, 1, 8)], [(k, v)])  # 3 query heads over 2 kv heads
    assert not native.supports([torch.randn(1, 2, 1, 16)], [(k, v)])  # query wider than the keys
    assert not native.supports([q], [(k, v[:, :, :5])])  # fewer values than keys
    assert not native.supports([q, q], [(k, v), (k[:, :1], v[:, :1])])  # segments with other kv heads
    assert native.supports([q], [(k, v)])
    assert not native.supports([q.requires_grad_()], [(k, v)])


def test_a_flop_counter_sees_the_decode_step():
    """Under a dispatch mode the torch path runs, so the FLOP count is the same either way."""
    from torch.utils.flop_counter import FlopCounterMode

    k, v = _cache(1, 2, 100, 16, 16)
    q = torch.randn(1, 4, 1, 16)
    with FlopCounterMode(display=False) as counter:
        decode_attention(q, k, v)
    assert counter.get_total_flops() == 2 * 4 * 100 * (16 + 16)


def test_without_a_compiler_decode_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKV_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    native.decode_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C compiler"):
            assert native.decode_kernel() is None
        k, v = _cache(1, 2, 50, 16, 16)
        q = torch.randn(1, 4, 1, 16)
        torch.testing.assert_close(decode_attention(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=2e-6)
        assert not (tmp_path / "kernels").exists()
    finally:
        native.decode_kernel.cache_clear()


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.decode_kernel.cache_clear()
    try:
        assert native.decode_kernel() is None
    finally:
        native.decode_kernel.cache_clear()


def test_a_switch_value_other_than_0_or_1_is_refused(monkeypatch):
    """``SLIMKV_NATIVE=off`` must not silently mean "on"."""
    monkeypatch.setenv(native.ENV_SWITCH, "off")
    native.decode_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"SLIMKV_NATIVE='off' is not allowed; allowed values: 1 .*, 0"):
            native.decode_kernel()
    finally:
        native.decode_kernel.cache_clear()


@needs_kernel
def test_a_damaged_cached_build_is_built_again(monkeypatch, tmp_path):
    name = native.build(native.compiler(), cache_dir() / "kernels").name  # the session's build (cached): its file name, keyed by source and flags
    monkeypatch.setenv("SLIMKV_CACHE", str(tmp_path))
    first = tmp_path / "kernels" / name
    first.parent.mkdir()
    first.write_bytes(b"not a shared library")
    native.decode_kernel.cache_clear()
    try:
        assert native.decode_kernel() is not None  # rebuilt, no fallback
        assert first.read_bytes()[:4] == b"\x7fELF"
    finally:
        native.decode_kernel.cache_clear()


@needs_compiler
def test_a_failing_build_says_why_and_leaves_no_file(monkeypatch, tmp_path):
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native_build, "SOURCE", bad)
    cc = native.compiler()
    with pytest.raises(RuntimeError, match="broken.c|error"):
        native.build(cc, tmp_path / "kernels")
    assert list((tmp_path / "kernels").glob("*.so")) == []  # no library and no temporary file (the build's lock file stays)


@needs_compiler
def test_builds_are_cached_by_source(monkeypatch, tmp_path):
    cc = native.compiler()
    source = tmp_path / "src" / "kernel.c"  # a one-line source: the cache's rule, not the kernel, is under test
    source.parent.mkdir()
    source.write_text("int answer(void) { return 1; }\n")
    monkeypatch.setattr(native_build, "SOURCE", source)
    folder = tmp_path / "kernels"
    first = native.build(cc, folder)
    assert native.build(cc, folder) == first
    assert [p.name for p in folder.glob("*.so")] == [first.name]
    source.write_text("int answer(void) { return 2; }\n")
    second = native.build(cc, folder)
    (source.parent / "rows.h").write_text("/* a header beside the source */\n")
    third = native.build(cc, folder)
    assert len({first, second, third}) == 3 and sorted(p.name for p in folder.glob("*.so")) == sorted(p.name for p in (first, second, third))


@needs_compiler
def test_concurrent_builds_of_one_kernel_compile_it_once(monkeypatch, tmp_path):
    """Two builders of the same kernel at once (test workers, concurrent runs): one compiles, the
    other waits on the build's lock and finds the library."""
    cc = native.compiler()
    source = tmp_path / "kernel.c"
    source.write_text("int answer(void) { return 1; }\n")
    monkeypatch.setattr(native_build, "SOURCE", source)
    compiles, run = [], native_build.subprocess.run

    def slow_compile(argv, **kwargs):
        if "-o" in argv:
            compiles.append(argv)
            time.sleep(0.5)  # long enough for the other builder to arrive while this one compiles
        return run(argv, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", slow_compile)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: native.build(cc, tmp_path / "kernels"), range(2)))
    assert paths[0] == paths[1] and paths[0].is_file() and len(compiles) == 1


def test_slimkv_eval_cache_prints_the_kernel_path():
    from slimkv.eval.cache import format_report

    row = {"name": "m", "cache_type": "SlimKVCache", "dtype": "float32", "tokens_cached": 4, "bytes_total": 64, "bytes_per_token": 16.0,
           "bytes_per_token_per_layer": [16.0]}
    text = format_report({"context": 4, "new_tokens": 1, "text": "t", "model": row, "kernel_isa": native.kernel_isa()})
    assert text.endswith(f"native decode kernel path: {native.kernel_isa()}")
    text = format_report({"context": 4, "new_tokens": 1, "text": "t", "model": row, "kernel_isa": "avx2", "kernel_threading": "torch's OpenMP team"})
    assert text.endswith("native decode kernel path: avx2; threads: torch's OpenMP team")
    text = format_report({"context": 4, "new_tokens": 1, "text": "t", "model": row, "kernel_isa": "avx512", "kernel_row_prefetch": "several-tiles"})
    assert text.endswith("native decode kernel path: avx512; row-tile prefetch: several-tiles")
    text = format_report({"context": 4, "new_tokens": 1, "text": "t", "model": row, "kernel_isa": "avx512-bf16", "kernel_row_prefetch": "always",
                          "kernel_tile_logits": "widened fma"})
    assert text.endswith("native decode kernel path: avx512-bf16; row-tile prefetch: always; tile logits: widened fma")
    text = format_report({"context": 4, "new_tokens": 1, "text": "t", "model": row, "kernel_isa": "avx2", "kernel_linear_prefetch": "2048 bytes ahead"})
    assert text.endswith("native decode kernel path: avx2; linear-row prefetch: 2048 bytes ahead")
    text = format_report({"context": 4, "new_tokens": 1, "text": "t", "model": row, "kernel_isa": "avx512",
                          "block_steps": {"one_call": 28, "two_calls": 2, "module_path": 0}})
    assert text.endswith("decode steps of the model's blocks: 28 in one native call, 2 in two around the attention, 0 on the module path "
                         "(slimkv.model.block_step)")


@needs_kernel
def test_the_isa_switch_builds_the_named_path_and_refuses_others(monkeypatch):
    """SLIMKV_KERNEL_ISA picks a path the CPU can run (what an AVX2 user gets, on an AVX-512 machine); kernel_isa says which ran."""
    try:
        monkeypatch.setenv(native.ISA_SWITCH, "portable")
        native.decode_kernel.cache_clear()
        assert native.kernel_isa(torch.float32) == "portable"
        monkeypatch.setenv(native.ISA_SWITCH, "sse9")
        native.decode_kernel.cache_clear()
        with pytest.raises(ValueError, match="SLIMKV_KERNEL_ISA='sse9' is not allowed on this CPU; allowed values: .*portable"):
            native.decode_kernel(torch.float32)
    finally:
        monkeypatch.delenv(native.ISA_SWITCH)
        native.decode_kernel.cache_clear()
    assert native.kernel_isa(torch.float32) == FLOAT32_PATH.get(native.runnable_isas()[0], native.runnable_isas()[0])
