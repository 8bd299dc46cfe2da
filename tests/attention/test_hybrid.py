"""``hybrid``'s reductions: every KV head exact is GQA, none exact is streaming, and a mix computes
each head as its role says; the cache grows only by the exact heads' rows."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.ops import attention as attention_ops
from slimkv.ops import native
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, SEQ_LEN, rel_rmse, run_in_calls


def pair(kind: str, full_heads: list[int], **options):
    """A hybrid layer with ``full_heads`` and a ``kind`` layer with the same weights and ``options``."""
    torch.manual_seed(0)
    window = options.get("window", SEQ_LEN)
    hybrid = build_attention("hybrid", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, full_heads=full_heads, **{"window": window, **options}).double()
    other = build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, **options).double()
    other.load_state_dict(hybrid.state_dict())
    return hybrid, other


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_every_head_exact_is_gqa_and_none_is_streaming(backend):
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    hybrid, gqa = pair("gqa", [0, 1])
    streaming_hybrid, streaming = pair("streaming", [], window=5, sink_len=2)
    hybrid.backend = streaming_hybrid.backend = backend
    with torch.no_grad():
        assert rel_rmse(hybrid(x), gqa(x)) < 1e-12
        assert rel_rmse(run_in_calls(hybrid, x, [7, 1, 29]), gqa(x)) < 1e-12
        assert rel_rmse(streaming_hybrid(x), streaming(x)) < 1e-12
        assert rel_rmse(run_in_calls(streaming_hybrid, x, [1] * SEQ_LEN), streaming(x)) < 1e-12


@pytest.mark.parametrize(("kind", "options"), [("hybrid", {"full_heads": [1], "window": 5, "sink_len": 2}),
                                               ("hybrid", {"full_heads": [], "window": 3, "sink_len": 0}),
                                               ("streaming", {"window": 4, "sink_len": 1})])
def test_a_bounded_decode_step_reads_its_rows_as_stored(kind, options, monkeypatch):
    """A float32 decode step over sinks + a window of full-precision rows reads the stored segments
    (sinks, window, the new token) through the native kernel's plain entry, no concatenation or mask
    (counted), and gives the reference backend's whole-sequence output, before and after the window fills."""
    torch.manual_seed(0)
    layer = build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, **options).eval()
    x = torch.randn(1, SEQ_LEN, D_MODEL)
    calls = []
    original = attention_ops.native_decode_attention
    monkeypatch.setattr(attention_ops, "native_decode_attention", lambda queries, segments, *a: calls.append(len(segments)) or original(queries, segments, *a))
    with torch.no_grad():
        stepped = run_in_calls(layer, x, [3] + [1] * (SEQ_LEN - 3))
        layer.backend = "reference"
        expected = layer(x)
    assert rel_rmse(stepped, expected) < 1e-5
    segments = 3 if options["sink_len"] else 2  # the sinks, the window and the new token
    assert native.decode_kernel() is None or max(calls) == segments


def test_each_head_follows_its_role():
    """Query heads of the exact KV head compute GQA's output, those of the streaming one StreamingLLM's."""
    x = torch.randn(1, SEQ_LEN, D_MODEL, dtype=torch.float64)
    torch.manual_seed(0)
    hybrid = build_attention("hybrid", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, full_heads=[1], window=4, sink_len=1).double()
    gqa = build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2).double()
    streaming = build_attention("streaming", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, window=4, sink_len=1).double()
    for other in (gqa, streaming):
        other.load_state_dict(hybrid.state_dict())
    outputs = {}
    for name, module in (("hybrid", hybrid), ("gqa", gqa), ("streaming", streaming)):
        captured = []
        handle = module.o_proj.register_forward_hook(lambda _m, args, _out, store=captured: store.append(args[0]))
        with torch.no_grad():
            module(x)
        handle.remove()
        outputs[name] = captured[0].view(1, SEQ_LEN, N_HEADS, HEAD_DIM)
    group = N_HEADS // 2  # query heads 0-1 read KV head 0 (streaming), 2-3 KV head 1 (exact)
    assert rel_rmse(outputs["hybrid"][:, :, group:], outputs["gqa"][:, :, group:]) < 1e-12
    assert rel_rmse(outputs["hybrid"][:, :, :group], outputs["streaming"][:, :, :group]) < 1e-12
    assert rel_rmse(outputs["hybrid"][:, :, :group], outputs["gqa"][:, :, :group]) > 1e-3


def test_only_the_exact_heads_grow():
    hybrid = build_attention("hybrid", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=4, full_heads=[2], window=3, sink_len=1)
    cache = hybrid.new_cache(1)
    with torch.no_grad():
        hybrid(torch.randn(1, 30, D_MODEL), cache=cache)
        at_30 = cache.nbytes()
        hybrid(torch.randn(1, 10, D_MODEL), cache=cache)
    row = 2 * HEAD_DIM * 4  # one token's key and value of one head, float32
    assert cache.nbytes() - at_30 == 10 * row  # one exact head: 10 more rows; three streaming heads: full already
    assert at_30 == (30 + 3 * 3) * row and cache.nbytes() == hybrid.cache_bytes(40)


@pytest.mark.parametrize("heads", [[2], [0, 0], [-1], ["0"], 1, [True]])
def test_full_heads_must_name_distinct_kv_heads(heads):
    with pytest.raises(ValueError, match="full_heads=.* must be a list of distinct KV head indices from 0 to 1"):
        build_attention("hybrid", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, full_heads=heads, window=4)
