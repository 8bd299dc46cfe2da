"""``latent``: the module equals its definition written out (keys rebuilt from the latent, then
rotated; values rebuilt), and the absorbed path (values kept latent) equals the expanded one in
every split of the sequence into calls."""

from __future__ import annotations

import math

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.ops.rope import Rotary
from tests.helpers import assert_paths_agree

D_MODEL, N_HEADS, HEAD_DIM, SEQ_LEN = 24, 4, 6, 19
CONFIGS = {
    "mha-groups": {"kv_rank": 7},
    "gqa": {"kv_rank": 5, "n_kv_heads": 2},
    "qk-norm-bias": {"kv_rank": 9, "n_kv_heads": 2, "qk_norm": True, "bias": True},
}


def make(dtype=torch.float64, **options):
    torch.manual_seed(0)
    attn = build_attention("latent", D_MODEL, N_HEADS, HEAD_DIM, **options).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    return attn


def spec_latent(attn, x: torch.Tensor) -> torch.Tensor:
    """softmax(rotate(q_h) . rotate(k_g(h))) v_g(h), one head at a time, with k_g, v_g rebuilt from c = x W_down."""
    b, t, _ = x.shape
    c = attn.kv_down(x)
    rotary = Rotary(HEAD_DIM, "full", 0.5, attn.rope_theta)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    group = N_HEADS // attn.n_kv_heads
    q = rotary(attn.q_norm(attn.q_proj(x).view(b, t, N_HEADS, HEAD_DIM)), 0)
    heads = []
    for h in range(N_HEADS):
        g = h // group
        k = c @ attn.k_up.weight[g * HEAD_DIM:(g + 1) * HEAD_DIM].T
        k = rotary(attn.k_norm(k.view(b, t, 1, HEAD_DIM)), 0)[:, :, 0]
        v = c @ attn.v_up.weight[g * HEAD_DIM:(g + 1) * HEAD_DIM].T
        logits = (q[:, :, h] @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)).masked_fill(~causal, float("-inf"))
        heads.append(logits.softmax(-1) @ v)
    return attn.o_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("name", CONFIGS)
def test_both_paths_equal_the_spec_written_out_in_every_split(name):
    attn = make(**CONFIGS[name])
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        expected = spec_latent(attn, x)
    assert_paths_agree(attn, x, expected, splits=([7, 1, 4, 1, 6], [1] * SEQ_LEN))


def test_auto_absorbs_decode_steps_and_expands_prefill():
    attn = build_attention("latent", 576, 9, 64, kv_rank=192, n_kv_heads=3)
    assert attn.decode_path == "auto" and attn.uses_absorbed(1) and attn.uses_absorbed(16)
    assert not attn.uses_absorbed(1024)
    with pytest.raises(ValueError, match="decode_path"):
        attn.set_runtime_options(decode_path="fast")
