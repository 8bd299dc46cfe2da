"""MLA: the absorbed decode path, the spec written out by hand, the latent-only cache, bad options.

The contract's oracles run for ``mla`` in test_contract.py (registered example options); this file
checks what is specific to MLA.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.attention.mla import absorbed_is_cheaper
from slimkv.ops.attention import attend, reference_attention
from tests.helpers import assert_paths_agree, rel_rmse, run_in_calls

D_MODEL, N_HEADS, HEAD_DIM, SEQ_LEN = 24, 3, 4, 19

CONFIGS = {
    "full-q": {"kv_rank": 5},
    "low-rank-q": {"kv_rank": 7, "q_rank": 6},
    "no-rope": {"kv_rank": 5, "rope": "none"},
    "rope_dim-2-v6": {"kv_rank": 6, "rope_dim": 2, "v_head_dim": 6},
    "low-rank-q-partial-norm-bias": {"kv_rank": 6, "q_rank": 5, "rope": "partial", "qk_norm": True, "bias": True},
    "converted-no-latent-norm-frequencies": {"kv_rank": 6, "latent_norm": False, "rope_frequencies": [0.7, 0.01, 0.7], "bias": True},
    "frequencies-with-rope_dim-and-qk-norm": {"kv_rank": 5, "rope_dim": 4, "rope_frequencies": [2.0, 0.3], "qk_norm": True},
}


def make(dtype=torch.float64, seed: int = 0, **options):
    torch.manual_seed(seed)
    attn = build_attention("mla", D_MODEL, N_HEADS, HEAD_DIM, **options).to(dtype)
    with torch.no_grad():  # non-trivial gains and biases
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * gain


def rotate_pairs(x: torch.Tensor, theta: float, frequencies: list[float] | None = None) -> torch.Tensor:
    """RoPE on all channels of x (batch, time, ..., dim), adjacent pairs, token t at position t;
    pair i turns at frequencies[i], or theta^(-2i/dim)."""
    t_len, dim = x.shape[1], x.shape[-1]
    out = x.clone()
    for t in range(t_len):
        for i in range(dim // 2):
            angle = t * (frequencies[i] if frequencies is not None else theta ** (-2 * i / dim))
            a, b = x[:, t, ..., 2 * i], x[:, t, ..., 2 * i + 1]
            out[:, t, ..., 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            out[:, t, ..., 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def spec_mla(attn, x: torch.Tensor) -> torch.Tensor:
    """MLA exactly as docs/mla.md states it, one head at a time, from the module's weights."""
    b, t_len, _ = x.shape
    h, n, p, v = attn.n_heads, attn.head_dim, attn.rope_dim, attn.v_head_dim
    if attn.q_rank is None:
        q = linear(x, attn.q_proj)
    else:
        c_q = rms_norm(linear(x, attn.q_down), attn.q_latent_norm.weight, attn.q_latent_norm.eps)
        q = linear(c_q, attn.q_up)
    q = q.view(b, t_len, h, p + n)
    if attn.use_qk_norm:
        q = rms_norm(q, attn.q_norm.weight, attn.q_norm.eps)
    down = linear(x, attn.kv_down)
    k_pe, c = down[..., :p], down[..., p:]
    if attn.latent_norm:
        c = rms_norm(c, attn.kv_norm.weight, attn.kv_norm.eps)
    if attn.use_qk_norm and p:
        k_pe = rms_norm(k_pe, attn.k_norm.weight, attn.k_norm.eps)
    q_pe, q_nope = rotate_pairs(q[..., :p], attn.rope_theta, attn.rope_frequencies), q[..., p:]
    k_pe = rotate_pairs(k_pe, attn.rope_theta, attn.rope_frequencies)
    causal = torch.ones(t_len, t_len, dtype=torch.bool).tril()
    heads = []
    for i in range(h):
        w_uk = attn.k_up.weight[i * n : (i + 1) * n]  # (head_dim, kv_rank)
        w_uv = attn.v_up.weight[i * v : (i + 1) * v]
        logits = q_nope[:, :, i] @ (c @ w_uk.T).transpose(1, 2) + q_pe[:, :, i] @ k_pe.transpose(1, 2)
        logits = (logits / math.sqrt(n + p)).masked_fill(~causal, float("-inf"))
        heads.append(logits.softmax(-1) @ (c @ w_uv.T))
    return linear(torch.cat(heads, dim=-1), attn.o_proj)


@pytest.mark.parametrize("name", CONFIGS)
def test_module_equals_the_spec_written_out(name):
    attn = make(**CONFIGS[name])
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        expected = spec_mla(attn, x)
    assert_paths_agree(attn, x, expected)


@pytest.mark.parametrize("name", CONFIGS)
def test_absorbed_equals_expanded(name):
    attn = make(**CONFIGS[name])
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    outputs = {}
    with torch.no_grad():
        for path in ("absorbed", "expanded"):
            attn.decode_path = path
            outputs[path] = [attn(x), run_in_calls(attn, x, [7, 1, 4, 1, 6]), run_in_calls(attn, x, [1] * SEQ_LEN)]
    for absorbed, expanded in zip(outputs["absorbed"], outputs["expanded"]):
        assert rel_rmse(absorbed, expanded) < 1e-10
    for kind in ("absorbed", "expanded"):  # and each path is split invariant on its own
        assert rel_rmse(outputs[kind][1], outputs[kind][0]) < 1e-10
        assert rel_rmse(outputs[kind][2], outputs[kind][0]) < 1e-10


def test_absorbed_matches_expanded_in_float32_decode():
    attn = make(torch.float32, kv_rank=6, q_rank=5)
    x = torch.randn(1, SEQ_LEN, D_MODEL)
    with torch.no_grad():
        attn.decode_path = "absorbed"
        absorbed = run_in_calls(attn, x, [10] + [1] * 9)
        attn.decode_path = "expanded"
        expanded = run_in_calls(attn, x, [10] + [1] * 9)
    assert rel_rmse(absorbed, expanded) < 1e-5


def test_auto_path_absorbs_decode_steps_and_expands_long_calls():
    attn = build_attention("mla", 512, 8, 64, kv_rank=256, rope_dim=32)
    assert attn.decode_path == "auto"
    assert attn.uses_absorbed(1, 32768) and attn.uses_absorbed(8, 4096)
    assert not attn.uses_absorbed(2048, 2048) and not attn.uses_absorbed(2048, 32768)
    # the rule is the multiply-add count of the two paths
    assert absorbed_is_cheaper(1, 10, 64, 32, 256, 64)
    assert not absorbed_is_cheaper(1000, 1000, 64, 32, 256, 64)
    attn.decode_path = "expanded"
    assert not attn.uses_absorbed(1, 32768)
    attn.decode_path = "absorbed"
    assert attn.uses_absorbed(2048, 2048)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("options", [{"kv_rank": 5, "rope_dim": 2}, {"kv_rank": 7, "rope": "none"}], ids=["rope", "no-rope"])
def test_cache_holds_only_the_latent_and_rope_key(dtype, options):
    attn = make(dtype, **options)
    width = attn.kv_rank + attn.rope_dim
    cache = attn.new_cache(2)
    with torch.no_grad():
        for n in (5, 1, 3):
            attn(torch.randn(2, n, D_MODEL, dtype=dtype), cache=cache)
            assert cache.nbytes() == 2 * cache.seq_len * width * torch.tensor([], dtype=dtype).element_size()
            assert cache.nbytes() == attn.cache_bytes(cache.seq_len, dtype, batch_size=2)
    buffers = list(cache.tensors())
    assert len(buffers) == 1
    rows = buffers[0].view()
    assert rows.shape == (2, 1, 9, width)  # one shared row per token, no head axis of size n_heads
    # the latent part is RMS-normalised (its rms is set by the norm gains alone)
    c = rows[..., attn.rope_dim :].double() / attn.kv_norm.weight.double()
    assert torch.allclose(c.pow(2).mean(-1), torch.ones((), dtype=torch.float64), atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


def test_without_latent_norm_the_cache_holds_the_linear_latent():
    attn = make(kv_rank=5, latent_norm=False, rope_frequencies=[0.5, 0.5])
    assert isinstance(attn.kv_norm, torch.nn.Identity) and attn.rope_dim == 4
    x = torch.randn(1, 6, D_MODEL, dtype=torch.float64)
    cache = attn.new_cache(1)
    with torch.no_grad():
        attn(x, cache=cache)
    rows = next(iter(cache.tensors())).view()
    assert torch.allclose(rows[0, 0, :, 4:], attn.kv_down(x)[0, :, 4:], atol=1e-12)
    _, wk = attn.head_qk_maps()  # the content keys are linear in x: no rms scale to leave out
    with torch.no_grad():
        k_content = attn.k_up(attn.kv_down(x)[..., 4:]).view(1, 6, N_HEADS, HEAD_DIM)
    for h in range(N_HEADS):
        assert torch.allclose(x @ wk[h, :, 4:], k_content[:, :, h], atol=1e-12)


def test_explicit_frequencies_equal_to_the_ladder_change_nothing():
    ladder = [10000.0 ** (-2 * i / 4) for i in range(2)]
    plain, explicit = make(kv_rank=5, rope_dim=4), make(kv_rank=5, rope_frequencies=ladder)
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        assert rel_rmse(explicit(x), plain(x)) < 1e-12
    assert make(kv_rank=5, rope="none", rope_frequencies=ladder).rope_dim == 0  # like rope_theta: no part without rotation


def test_cache_bytes_formula_and_ratio_to_mha():
    mla = build_attention("mla", 512, 8, 64, kv_rank=256, rope_dim=32)
    mha = build_attention("mha", 512, 8, 64)
    assert mla.cache_bytes(1000, torch.bfloat16, batch_size=3) == 3 * 1000 * 288 * 2
    assert mla.cache_bytes(100) / mha.cache_bytes(100) == pytest.approx(288 / 1024)


@pytest.mark.parametrize("options", [{"kv_rank": 5}, {"kv_rank": 7, "q_rank": 6, "qk_norm": True}, {"kv_rank": 5, "rope": "none"}])
def test_head_qk_maps_reproduce_the_projections(options):
    attn = make(**options)
    x = torch.randn(1, 6, D_MODEL, dtype=torch.float64)
    wq, wk = attn.head_qk_maps()
    p = attn.rope_dim
    assert wq.shape == wk.shape == (N_HEADS, D_MODEL, p + HEAD_DIM)

    def rms(t):
        return (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()

    with torch.no_grad():
        q = attn.q_proj(x) if attn.q_rank is None else attn.q_up(attn.q_latent_norm(attn.q_down(x)))
        q_scale = rms(attn.q_down(x)) if attn.q_rank is not None else 1.0
        q = q.view(1, 6, N_HEADS, -1)
        if attn.use_qk_norm:  # the maps fold the gain in, not the per-token rms
            q = q * attn.q_norm.weight
        down = attn.kv_down(x)
        k_content = attn.k_up(attn.kv_norm(down[..., p:])).view(1, 6, N_HEADS, -1) * rms(down[..., p:]).unsqueeze(-1)
        for h in range(N_HEADS):
            assert torch.allclose(x @ wq[h], q[:, :, h] * q_scale, atol=1e-12)
            assert torch.allclose(x @ wk[h, :, p:], k_content[:, :, h], atol=1e-12)
            k_gain = attn.k_norm.weight if attn.use_qk_norm else 1.0
            assert torch.allclose(x @ wk[h, :, :p], down[..., :p] * k_gain, atol=1e-12)


BAD_OPTIONS = [
    ({}, "kv_rank"),
    ({"kv_rank": 0}, "kv_rank"),
    ({"kv_rank": 2.5}, "kv_rank"),
    ({"kv_rank": 4, "q_rank": 0}, "q_rank"),
    ({"kv_rank": 4, "rope_dim": 3}, "rope_dim"),
    ({"kv_rank": 4, "rope_dim": -2}, "rope_dim"),
    ({"kv_rank": 4, "rope_dim": 4, "rope": "none"}, "rope_dim"),
    ({"kv_rank": 4, "rope_dim": 0}, "rope_dim"),
    ({"kv_rank": 4, "v_head_dim": 0}, "v_head_dim"),
    ({"kv_rank": 4, "rank": 4}, "rank"),
    ({"kv_rank": 4, "rope": "half"}, "rope"),
    ({"kv_rank": 4, "latent_norm": 1}, "latent_norm"),
    ({"kv_rank": 4, "rope_frequencies": []}, "rope_frequencies"),
    ({"kv_rank": 4, "rope_frequencies": [1.0, -0.5]}, "rope_frequencies"),
    ({"kv_rank": 4, "rope_frequencies": [1.0, float("nan")]}, "rope_frequencies"),
    ({"kv_rank": 4, "rope_frequencies": [True]}, "rope_frequencies"),
    ({"kv_rank": 4, "rope_frequencies": "0.5"}, "rope_frequencies"),
    ({"kv_rank": 4, "rope_dim": 4, "rope_frequencies": [1.0]}, "rope_frequencies"),
]


@pytest.mark.parametrize("options,name", BAD_OPTIONS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_OPTIONS)])
def test_bad_options_raise_value_error_naming_the_option(options, name):
    with pytest.raises(ValueError, match=name):
        build_attention("mla", D_MODEL, N_HEADS, HEAD_DIM, **options)


def test_unknown_decode_path_is_refused():
    attn = make(kv_rank=4)
    with pytest.raises(ValueError, match="decode_path"):
        attn.decode_path = "fast"
    with pytest.raises(ValueError, match="decode_path='fast' is not allowed"):
        make(kv_rank=4, decode_path="fast")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_shared_latent_kernel_matches_reference(dtype, q_len):
    """The kernel the absorbed path runs: every query head against one shared key/value head whose
    values are a strided view of the keys (MLA's cache rows), queries at the end of the keys."""
    torch.manual_seed(q_len)
    rows = torch.randn(2, 1, 11, 9, dtype=dtype)
    q = torch.randn(2, 4, q_len, 9, dtype=dtype)
    fast = attend(q, rows, rows[..., 2:], scale=0.4)
    ref = reference_attention(q, rows, rows[..., 2:], scale=0.4)
    assert fast.shape == ref.shape == (2, 4, q_len, 7)
    assert rel_rmse(fast, ref) < {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
