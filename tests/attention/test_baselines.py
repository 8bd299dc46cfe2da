"""Reductions between the baseline kinds and option validation."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import ATTENTION_KINDS, build_attention
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, SEQ_LEN, rel_rmse, run_in_calls


def copy_weights(src, dst):
    dst.load_state_dict(src.state_dict())
    return dst


@pytest.mark.parametrize("common", [{}, {"qk_norm": True, "bias": True, "rope": "partial"}])
def test_gqa_reductions(common):
    torch.manual_seed(0)
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    mha = build_attention("mha", D_MODEL, N_HEADS, HEAD_DIM, **common).double()
    gqa_full = copy_weights(mha, build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=N_HEADS, **common).double())
    mqa = build_attention("mqa", D_MODEL, N_HEADS, HEAD_DIM, **common).double()
    gqa_one = copy_weights(mqa, build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=1, **common).double())
    with torch.no_grad():
        assert rel_rmse(gqa_full(x), mha(x)) < 1e-12
        assert rel_rmse(gqa_one(x), mqa(x)) < 1e-12


def test_swa_with_long_window_is_mha():
    torch.manual_seed(0)
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    mha = build_attention("mha", D_MODEL, N_HEADS, HEAD_DIM).double()
    swa = copy_weights(mha, build_attention("swa", D_MODEL, N_HEADS, HEAD_DIM, window=SEQ_LEN).double())
    with torch.no_grad():
        assert rel_rmse(swa(x), mha(x)) < 1e-12
        assert rel_rmse(run_in_calls(swa, x, [5, 1, 31]), mha(x)) < 1e-12


def test_swa_is_local():
    """Changing a token outside every later query's window leaves those outputs unchanged."""
    torch.manual_seed(0)
    swa = build_attention("swa", D_MODEL, N_HEADS, HEAD_DIM, window=4).double()
    x = torch.randn(1, 12, D_MODEL, dtype=torch.float64)
    y = x.clone()
    y[:, 2] += 1.0
    with torch.no_grad():
        a, b = swa(x), swa(y)
    assert torch.allclose(a[:, 6:], b[:, 6:]) and not torch.allclose(a[:, 2:6], b[:, 2:6])


def test_swa_cache_stops_growing():
    swa = build_attention("swa", D_MODEL, N_HEADS, HEAD_DIM, window=8)
    cache = swa.new_cache(1)
    with torch.no_grad():
        for _ in range(50):
            swa(torch.randn(1, 3, D_MODEL), cache=cache)
    assert cache.seq_len == 150
    assert cache.nbytes() == 7 * 2 * N_HEADS * HEAD_DIM * 4
    assert cache.k.capacity <= 64  # storage is reused, not grown without bound


@pytest.mark.parametrize(
    "kind, options, name",
    [
        ("nope", {}, "kind"),
        ("mha", {"windw": 3}, "windw"),
        ("gqa", {"n_kv_heads": 3}, "n_kv_heads"),
        ("gqa", {"n_kv_heads": 0}, "n_kv_heads"),
        ("swa", {"window": 0}, "window"),
        ("mha", {"rope": "spiral"}, "rope"),
        ("mha", {"rope_theta": -1.0}, "rope_theta"),
        ("mha", {"rope": "partial", "rope_fraction": 0.0}, "rope_fraction"),
        ("mha", {"qk_norm": "yes"}, "qk_norm"),
        ("mha", {"bias": 1}, "bias"),
        ("mha", {"rope_frequencies": [0.5, -1.0]}, "rope_frequencies"),
        ("gqa", {"n_kv_heads": 2, "rope": "partial", "rope_frequencies": [0.5]}, "rope_frequencies has 1 values but .* rotates 2 pairs"),
    ],
)
def test_invalid_options_name_the_option(kind, options, name):
    with pytest.raises(ValueError, match=name):
        build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, **options)


def test_streaming_reduces_to_swa_without_sinks_and_to_gqa_with_a_long_window():
    torch.manual_seed(0)
    x = torch.randn(2, SEQ_LEN, D_MODEL)
    gqa = build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2)
    swa = build_attention("swa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, window=5)
    no_sinks = build_attention("streaming", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, window=5, sink_len=0)
    long = build_attention("streaming", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, window=SEQ_LEN, sink_len=3)
    sinks = build_attention("streaming", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, window=5, sink_len=3)
    for module in (swa, no_sinks, long, sinks):
        module.load_state_dict(gqa.state_dict())
    with torch.no_grad():
        assert rel_rmse(no_sinks(x), swa(x)) < 1e-6 and rel_rmse(long(x), gqa(x)) < 1e-6
        assert rel_rmse(sinks(x)[:, 5:], swa(x)[:, 5:]) > 1e-3  # the sinks are read past the window


def test_explicit_rope_frequencies_turn_the_leading_pairs_at_those_rates():
    """A converted layer keeps the original frequencies its fit chose: pair i turns at frequencies[i]."""
    torch.manual_seed(0)
    ladder = build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, rope="partial")
    chosen = build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, rope="partial", rope_frequencies=[0.3, 0.002])
    same = build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, rope="partial",
                           rope_frequencies=ladder.rotary.inverse_frequencies("cpu").tolist())
    with torch.no_grad():
        for p in ladder.parameters():
            p.normal_()  # sharp attention, so that positions matter
    chosen.load_state_dict(ladder.state_dict())
    same.load_state_dict(ladder.state_dict())
    x = torch.randn(1, 12, D_MODEL)
    assert torch.allclose(same(x), ladder(x), atol=1e-6)
    assert not torch.allclose(chosen(x), ladder(x), atol=1e-3)


def test_shape_errors():
    with pytest.raises(ValueError, match="n_heads"):
        build_attention("mha", 30, 4)
    with pytest.raises(ValueError, match="d_model"):
        build_attention("mha", 0, 4, 8)
    with pytest.raises(ValueError, match="allowed values|registered kinds"):
        build_attention("mhaa", D_MODEL, N_HEADS)


def test_unknown_option_lists_allowed():
    with pytest.raises(ValueError) as err:
        build_attention("swa", D_MODEL, N_HEADS, HEAD_DIM, windo=3)
    assert "window" in str(err.value)


def test_registry_lists_baselines():
    assert {"mha", "gqa", "mqa", "swa"} <= set(ATTENTION_KINDS)


@pytest.mark.parametrize("order", ["prefill", "cache", "shuffled"])
def test_streaming_attention_in_blocks_reads_only_the_window_and_matches_the_reference(order, monkeypatch):
    """The fast path slices each query block's keys to the sinks and its window when the keys are in position order
    (a prefill; a cache's sinks + recent + new tokens) and reads them whole otherwise; both equal the explicit reference."""
    from slimkv.attention.streaming import streaming_attention, streaming_attention_reference
    from slimkv.ops import attention as ops_attention
    monkeypatch.setattr(ops_attention, "SCORE_BLOCK_ELEMENTS", 1)  # the smallest blocks: many of them
    torch.manual_seed(0)
    sink_len, window, t = 3, 50, 300
    if order == "prefill":
        k_pos = q_pos = torch.arange(t)
    else:  # 3 sinks, a window of 49 cached tokens, then the new ones
        q_pos = torch.arange(400, 400 + t)
        k_pos = torch.cat((torch.arange(sink_len), torch.arange(400 - window + 1, 400), q_pos))
    if order == "shuffled":
        k_pos = k_pos[torch.randperm(k_pos.numel())]
    q = torch.randn(1, 4, t, 16)
    k, v = torch.randn(1, 2, k_pos.numel(), 16), torch.randn(1, 2, k_pos.numel(), 16)
    fast = streaming_attention(q, k, v, q_pos, k_pos, sink_len, window)
    torch.testing.assert_close(fast, streaming_attention_reference(q, k, v, q_pos, k_pos, sink_len, window), rtol=1e-5, atol=1e-5)
