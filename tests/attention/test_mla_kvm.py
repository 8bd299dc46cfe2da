"""The ``mla-kvm`` attention layer (KVM over an MLA latent cache): before any chunk leaves the
window it is MLA, logit for logit; its state holds latents (one set of rows for every head), and
with rows to spare each folded token's row is exactly its latent; the cache stops growing.
(The contract's oracles run on the registered example options in ``test_contract.py``.)"""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import attention_options, build_attention
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS

LATENT = {"kv_rank": 10, "rope_dim": 4}


def make(seed: int = 0, **options):
    torch.manual_seed(seed)
    attn = build_attention("mla-kvm", D_MODEL, N_HEADS, HEAD_DIM, **LATENT, **options).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


def test_options_are_mla_and_kvm_without_a_decode_path():
    names = attention_options("mla-kvm")
    assert {"kv_rank", "rope_dim", "latent_norm", "chunk_size", "window_chunks", "schedule", "min_rows", "sink_len", "merge_gate"} <= set(names)
    assert "decode_path" not in names and "n_kv_heads" not in names
    attn = make()
    assert attn.ln_s.weight.shape == (14,) and attn.gate_proj.weight.shape == (1, D_MODEL) and attn.settings.rot_dim == 4
    with pytest.raises(ValueError, match="decode_path"):
        attn.set_runtime_options(decode_path="expanded")


def test_a_window_covering_the_sequence_is_mla():
    attn = make(chunk_size=16, window_chunks=2)
    with torch.no_grad():
        attn.tau_window.fill_(1.0)  # MLA has no temperature
    plain = build_attention("mla", D_MODEL, N_HEADS, HEAD_DIM, **LATENT).double()
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if k in plain.state_dict()})
    x = torch.randn(2, 32, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(attn(x), plain(x), atol=1e-10)
        assert not torch.allclose(make(chunk_size=4, window_chunks=2, min_rows=4, sink_len=1)(x)[:, 12:], plain(x)[:, 12:], atol=1e-3)


def test_with_rows_to_spare_each_folded_token_is_a_row_holding_its_latent():
    attn = make(chunk_size=4, window_chunks=2, min_rows=64, sink_len=1)
    x = torch.randn(1, 26, D_MODEL, dtype=torch.float64)
    cache = attn.new_cache(1)
    with torch.no_grad():
        attn(x, cache)
        latents = attn.latent_rows(x, 0)[..., 4:]  # (1, 1, 26, kv_rank)
    rows = cache.state.rows
    folded = 26 - len(cache.state.window_k)  # tokens that left the window: positions 0..19 (the window: 20..25)
    assert folded == 20 and rows.count == folded and rows.s_v.shape == (1, 1, folded, 10)
    assert torch.allclose(rows.s_v, latents[:, :, :folded], atol=1e-12)


def test_the_cache_stops_growing():
    attn = make(chunk_size=4, window_chunks=2, min_rows=6, sink_len=1)
    assert attn.cache_bytes(1000) == attn.cache_bytes(64) < attn.cache_bytes(8) * 1000 / 8
    cache = attn.new_cache(1)
    sizes = []
    with torch.no_grad():
        for _ in range(5):
            attn(torch.randn(1, 16, D_MODEL, dtype=torch.float64), cache)
            sizes.append(cache.nbytes())
    assert sizes[-1] == sizes[-2] == sizes[-3] and cache.state_rows == 6
