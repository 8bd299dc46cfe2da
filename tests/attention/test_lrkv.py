"""LRKV beyond the shared contract: reductions, factored == materialised decode, cache size,
initialisation, options (docs/lrkv.md)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import slimkv.attention.lrkv_decode as lrkv_decode
from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.attention import build_attention
from slimkv.attention.lrkv import LowRankKVAttention
from slimkv.convert.lrkv import lrkv_from_mha
from slimkv.ops.attention import reference_attention
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, SEQ_LEN, rel_rmse, run_in_calls

ROPE_PLACEMENTS = ["decoupled", "full", "none"]
SPLITS = [11, 1, 1, 5, 1, 13, 1, 4]  # prefill, single steps and multi-token calls after it
assert sum(SPLITS) == SEQ_LEN


def lrkv(dtype=torch.float64, seed=0, **options) -> LowRankKVAttention:
    """An lrkv layer of the test shape with every parameter perturbed (norm gains, biases) so
    each path is exercised."""
    torch.manual_seed(seed)
    attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, **options).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


def inputs(batch=2, seed=1) -> torch.Tensor:
    return torch.randn(batch, SEQ_LEN, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def naive_lrkv(attn: LowRankKVAttention, x: torch.Tensor) -> torch.Tensor:
    """Plain reference: a Python loop over heads forming each head's key/value map
    W_shared + U_h B_h^T explicitly, then RMSNorm, RoPE and softmax attention as MHA would."""
    b, t, _ = x.shape
    hd, rot = attn.head_dim, attn.rotary.rot_dim
    outs = []
    for h in range(attn.n_heads):
        q = F.linear(x, attn.q_proj.weight[h * hd : (h + 1) * hd], None if attn.q_proj.bias is None else attn.q_proj.bias[h * hd : (h + 1) * hd])
        per_head = []
        for name, start in (("k", attn.key_residual_start), ("v", 0)):
            shared, latent, up = getattr(attn, f"{name}_shared"), getattr(attn, f"{name}_latent"), getattr(attn, f"{name}_up")
            weight, bias = shared.weight.clone(), None if shared.bias is None else shared.bias.clone()
            if latent is not None:
                r = up.shape[-1]
                u_t = latent.weight[h * r : (h + 1) * r]  # U_h^T (r, d)
                weight[start:] += up[h] @ u_t
                if bias is not None:
                    bias[start:] += up[h] @ latent.bias[h * r : (h + 1) * r]
            per_head.append(F.linear(x, weight, bias))
        k, v = per_head
        if attn.use_qk_norm:
            q = F.rms_norm(q, (hd,), attn.q_norm.weight, attn.q_norm.eps)
            k = F.rms_norm(k, (hd,), attn.k_norm.weight, attn.k_norm.eps)
        if rot:
            q, k = attn.rotary(q[:, :, None], 0)[:, :, 0], attn.rotary(k[:, :, None], 0)[:, :, 0]
        outs.append(reference_attention(q[:, None], k[:, None], v[:, None])[:, 0])
    return attn.o_proj(torch.cat(outs, dim=-1))


def run_path(attn: LowRankKVAttention, x: torch.Tensor, path: str, sizes=SPLITS) -> torch.Tensor:
    attn.decode_path = path
    try:
        with torch.no_grad():
            return run_in_calls(attn, x, sizes)
    finally:
        attn.decode_path = "factored"


# ---------------------------------------------------------------- the module against a plain loop


@pytest.mark.parametrize("rope_placement", ROPE_PLACEMENTS)
@pytest.mark.parametrize("common", [{}, {"qk_norm": True, "bias": True, "rope": "partial", "rope_fraction": 0.25}])
def test_module_equals_plain_per_head_loop(rope_placement, common):
    attn = lrkv(rank_k=3, rank_v=2, rope_placement=rope_placement, **common)
    x = inputs()
    with torch.no_grad():
        ref = naive_lrkv(attn, x)
        assert rel_rmse(attn(x), ref) < 1e-10
        assert rel_rmse(run_in_calls(attn, x, SPLITS), ref) < 1e-10


# ---------------------------------------------------------------- factored == materialised


@pytest.mark.parametrize("rope_placement", ROPE_PLACEMENTS)
@pytest.mark.parametrize("common", [{}, {"qk_norm": True}, {"qk_norm": True, "bias": True, "rope": "partial"}])
def test_factored_decode_equals_materialised(rope_placement, common, monkeypatch):
    """Compact-cache decode (factored logits/values; block rebuild for full rope) equals
    materialising every per-head K/V, over prefill, single-token and multi-token calls. Small
    logits and rebuild blocks force the query blocking and the online-softmax merge."""
    attn = lrkv(rank_k=3, rank_v=2, rope_placement=rope_placement, **common)
    attn.rebuild_block_tokens = 4
    x = inputs()
    with torch.no_grad():
        full = attn(x)
    expanded = run_path(attn, x, "expanded")
    factored = run_path(attn, x, "factored")
    assert rel_rmse(factored, expanded) < 1e-10
    assert rel_rmse(factored, full) < 1e-10
    monkeypatch.setattr(lrkv_decode, "LOGITS_BLOCK_ELEMENTS", 2 * N_HEADS * 8)  # a few queries per block
    assert rel_rmse(run_path(attn, x, "factored", [5, 25, 7]), full) < 1e-10


@pytest.mark.parametrize("rope_placement", ["decoupled", "none"])
def test_factored_decode_never_forms_per_head_keys_or_values(rope_placement, monkeypatch):
    attn = lrkv(rank=2, rope_placement=rope_placement, qk_norm=True)
    x = inputs()
    with torch.no_grad():
        cache = attn.new_cache(2, dtype=torch.float64)
        attn(x[:, :20], cache=cache)

        def forbidden(*args, **kwargs):
            raise AssertionError("per-head keys/values were materialised")

        monkeypatch.setattr(attn, "_expand_keys", forbidden)
        monkeypatch.setattr(attn, "_expand_values", forbidden)
        attn(x[:, 20:21], cache=cache)
        attn(x[:, 21:30], cache=cache)


def test_full_rope_decode_rebuilds_keys_in_bounded_blocks(monkeypatch):
    attn = lrkv(rank=2, rope_placement="full")
    attn.rebuild_block_tokens = 8
    x = inputs()
    rebuilt = []
    expand = attn._expand_keys

    def counting(entries, start):
        rebuilt.append(entries.shared_k.shape[2])
        return expand(entries, start)

    with torch.no_grad():
        cache = attn.new_cache(2, dtype=torch.float64)
        attn(x[:, :30], cache=cache)
        monkeypatch.setattr(attn, "_expand_keys", counting)
        attn(x[:, 30:31], cache=cache)
    assert rebuilt == [8, 8, 8, 7]


# ---------------------------------------------------------------- reductions


def copy_mqa_weights(mqa, attn: LowRankKVAttention) -> None:
    names = {"k_proj": "k_shared", "v_proj": "v_shared"}
    state = {names.get(k.split(".")[0], k.split(".")[0]) + "." + k.split(".", 1)[1]: v for k, v in mqa.state_dict().items()}
    attn.load_state_dict(state)


@pytest.mark.parametrize("rope_placement, mqa_rope", [("decoupled", "partial"), ("full", "full"), ("full", "partial"), ("none", "none")])
@pytest.mark.parametrize("common", [{}, {"qk_norm": True, "bias": True}])
def test_rank_zero_is_shared_kv_attention(rope_placement, mqa_rope, common):
    """rank 0 leaves only the shared key/value: MQA with the same weights, for every rope_placement
    (decoupled rotates rope_fraction of the channels, like MQA with partial rope)."""
    torch.manual_seed(0)
    mqa = build_attention("mqa", D_MODEL, N_HEADS, HEAD_DIM, rope=mqa_rope, **common).double()
    attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=0, rope_placement=rope_placement, rope=mqa_rope, **common).double()
    copy_mqa_weights(mqa, attn)
    x = inputs()
    with torch.no_grad():
        ref = mqa(x)
        assert rel_rmse(attn(x), ref) < 1e-10
        assert rel_rmse(run_in_calls(attn, x, SPLITS), ref) < 1e-10


def mha_with_shared_rotary_keys(rot: int, **common):
    """An mha layer whose heads share their rotary key channels (weights and biases): the only
    MHA layers a decoupled lrkv layer can represent."""
    torch.manual_seed(0)
    mha = build_attention("mha", D_MODEL, N_HEADS, HEAD_DIM, **common).double()
    with torch.no_grad():
        mha.k_proj.weight.view(N_HEADS, HEAD_DIM, D_MODEL)[:, :rot] = mha.k_proj.weight[:rot].clone()
        if mha.k_proj.bias is not None:
            mha.k_proj.bias.view(N_HEADS, HEAD_DIM)[:, :rot] = mha.k_proj.bias[:rot].clone()
    return mha


@pytest.mark.parametrize(
    "rope_placement, rope",
    [("full", "full"), ("full", "partial"), ("none", "none"), ("decoupled", "partial")],
)
@pytest.mark.parametrize("common", [{}, {"qk_norm": True, "bias": True}])
def test_full_rank_with_mha_weights_is_mha(rope_placement, rope, common):
    """U_h = W_h - W_shared, B_h = I reproduces MHA exactly when the positions agree:

    * ``full`` rotates the materialised per-head key, exactly as MHA does: holds for any MHA.
    * ``none``: no rotation on either side.
    * ``decoupled`` takes the rotary key channels from the shared key alone, so it equals only
      MHA layers whose heads share their rotary key channels (same rot_dim, i.e. MHA with partial
      rope); ``lrkv_from_mha`` refuses the others (tested below).
    Checked through the full forward and the factored cached path."""
    rot = HEAD_DIM // 2 if rope == "partial" else 0
    mha = mha_with_shared_rotary_keys(rot, rope=rope, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full rank: the cache is at least MHA's (tested elsewhere)
        attn = lrkv_from_mha(mha, rope_placement=rope_placement)
    assert attn.rank_v == HEAD_DIM and attn.rank_k == HEAD_DIM - attn.key_residual_start
    x = inputs()
    with torch.no_grad():
        ref = mha(x)
        assert rel_rmse(attn(x), ref) < 1e-10
        assert rel_rmse(run_in_calls(attn, x, SPLITS), ref) < 1e-10


def test_full_rank_reproduces_gqa():
    torch.manual_seed(0)
    gqa = build_attention("gqa", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, qk_norm=True).double()
    with pytest.warns(UserWarning):
        attn = lrkv_from_mha(gqa, rope_placement="full")
    x = inputs()
    with torch.no_grad():
        assert rel_rmse(run_in_calls(attn, x, SPLITS), gqa(x)) < 1e-10


def test_from_mha_refuses_what_it_cannot_represent():
    torch.manual_seed(0)
    mha = build_attention("mha", D_MODEL, N_HEADS, HEAD_DIM, rope="partial").double()
    with pytest.raises(ValueError, match="rotary key"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lrkv_from_mha(mha, rope_placement="decoupled")  # its heads' rotary channels differ
    with pytest.raises(ValueError, match="rotates"):
        lrkv_from_mha(mha, rope_placement="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{"rank_k": 3, "rank_v": 2, "n_kv_heads": 2}, {"rank_k": 0, "rank_v": 4},
                                     {"rank_k": 4, "rank_v": 0, "rope_placement": "none", "n_kv_heads": 2}])
def test_a_decode_step_reads_the_cache_rows_as_one_key_value_head(dtype, options):
    """The decode step over the cache rows (queries widened with their latent query in their
    group's slot; the native kernel where it is built) equals the general factored path and the
    expanded reference, and the rows are a call the native kernel takes."""
    from slimkv.ops import native

    attn = lrkv(dtype=dtype, **options)
    cache = attn.new_cache(2)
    x = inputs().to(dtype)
    with torch.no_grad():
        attn(x[:, :-1], cache=cache)
        q, new = attn._project(x[:, -1:], SEQ_LEN - 1)
        entries, rows = cache.extend(new)
        fast = attn._decode_rows(q, rows, cache.key_width)
        general = attn._attend_factored(q, entries)
        expanded = attn._attend_expanded(q, entries)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_rmse(fast, general) < tolerance and rel_rmse(fast, expanded) < tolerance
    kw = cache.key_width
    assert native.supports([torch.zeros(2, N_HEADS, 1, kw, dtype=dtype)], [(rows[..., :kw], rows[..., kw:])])


# ---------------------------------------------------------------- cache size


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_formula(qk_norm, dtype):
    attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank_k=2, rank_v=3, qk_norm=qk_norm).to(dtype)
    elements = 2 * HEAD_DIM + N_HEADS * (2 + 3) + (N_HEADS if qk_norm else 0)
    cache = attn.new_cache(3)
    with torch.no_grad():
        for n in (7, 1, 4):
            attn(torch.randn(3, n, D_MODEL, dtype=dtype), cache=cache)
    bytes_per = torch.empty((), dtype=dtype).element_size()
    assert cache.seq_len == 12
    assert cache.nbytes() == attn.cache_bytes(12, dtype, batch_size=3) == 3 * 12 * elements * bytes_per
    assert cache.rows.view().shape == (3, 1, 12, 2 * HEAD_DIM + N_HEADS * (2 + 3))  # one row per token: keys then values


def test_cache_ratio_matches_paper_configuration():
    """H=18, d_h=128, r=55: 1/18 + 55/128 = 48.5% of MHA's cache."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn = build_attention("lrkv", 64, 18, 128, rank=55)
    mha = build_attention("mha", 64, 18, 128)
    ratio = attn.cache_bytes(100) / mha.cache_bytes(100)
    assert ratio == pytest.approx(1 / 18 + 55 / 128) and round(100 * ratio, 1) == 48.5


# ---------------------------------------------------------------- initialisation


def residual_ratios(attn: LowRankKVAttention, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """||U_h B_h^T||_F / ||W_shared||_F per head (formed explicitly) and ||U_h||_F / ||B_h||_F."""
    shared, latent, up = getattr(attn, f"{name}_shared"), getattr(attn, f"{name}_latent"), getattr(attn, f"{name}_up")
    u = latent.weight.view(attn.n_heads, up.shape[-1], -1)  # U_h^T
    products = torch.stack([(up[h] @ u[h]).norm() for h in range(attn.n_heads)])
    balance = u.flatten(1).norm(dim=1) / up.flatten(1).norm(dim=1)
    return products / shared.weight.norm(), balance


@pytest.mark.parametrize("residual_init", [0.1, 0.3])
def test_residual_init_ratio(residual_init):
    torch.manual_seed(0)
    attn = build_attention("lrkv", 64, 4, 16, rank_k=4, rank_v=6, residual_init=residual_init)
    for name in ("k", "v"):
        ratios, balance = residual_ratios(attn, name)
        assert torch.allclose(ratios, torch.full_like(ratios, residual_init), rtol=1e-4)
        assert torch.allclose(balance, torch.ones_like(balance), rtol=1e-4)


def test_model_initialisation_keeps_the_residual_ratio():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, attention="lrkv", attention_options={"rank": 2})
    model = SlimKVForCausalLM(cfg)
    for attn in model.attention_layers:
        assert attn.k_shared.weight.std().item() == pytest.approx(cfg.init_std, rel=0.2)
        for name in ("k", "v"):
            ratios, _ = residual_ratios(attn, name)
            assert torch.allclose(ratios, torch.full_like(ratios, 0.1), rtol=1e-4)


def test_zero_residual_init_starts_at_shared_attention_and_still_learns():
    torch.manual_seed(0)
    attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=2, residual_init=0.0)
    assert attn.k_up.abs().sum() == 0 and attn.v_up.abs().sum() == 0
    attn(torch.randn(2, 9, D_MODEL)).square().mean().backward()
    assert attn.k_up.grad.abs().sum() > 0 and attn.v_up.grad.abs().sum() > 0


# ---------------------------------------------------------------- options


def test_positions_follow_rope_placement_and_common_rope():
    def placed(**options):
        attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=2, **options)
        return attn.rope_placement, attn.rotary.rot_dim, attn.k_up.shape[1]

    assert placed() == ("decoupled", HEAD_DIM // 2, HEAD_DIM // 2)  # default rope="full": half the channels rotate
    assert placed(rope="partial", rope_fraction=0.25) == ("decoupled", 2, HEAD_DIM - 2)
    assert placed(rope_placement="full") == ("full", HEAD_DIM, HEAD_DIM)
    assert placed(rope_placement="full", rope="partial", rope_fraction=0.25) == ("full", 2, HEAD_DIM)
    assert placed(rope="none") == ("none", 0, HEAD_DIM)
    assert placed(rope_placement="none") == ("none", 0, HEAD_DIM)


def test_decoupled_residual_never_writes_rotary_key_channels():
    attn = lrkv(rank=3)
    _, wk = attn.head_qk_maps()
    rot = attn.rotary.rot_dim
    shared = attn.k_shared.weight.t()[:, :rot]
    assert all(torch.equal(wk[h, :, :rot], shared) for h in range(N_HEADS))
    assert not torch.allclose(wk[0, :, rot:], wk[1, :, rot:])


def test_head_qk_maps_give_the_logits():
    attn = lrkv(rank_k=3, rank_v=1, rope_placement="none", qk_norm=False)
    x = inputs(batch=1)
    wq, wk = attn.head_qk_maps()
    with torch.no_grad():
        q, entries = attn._project(x, 0)
        keys = attn._expand_keys(entries, 0)
    assert torch.allclose(q, torch.einsum("btd,hdc->bhtc", x, wq), atol=1e-12)
    assert torch.allclose(keys, torch.einsum("btd,hdc->bhtc", x, wk), atol=1e-12)


def test_rank_above_the_break_even_point_warns_but_works():
    threshold = HEAD_DIM * (1 - 1 / N_HEADS)  # 6 for the test shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=int(threshold), rope_placement="full")
    with pytest.warns(UserWarning, match="more than MHA"):
        attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=int(threshold) + 1, rope_placement="full")
    with pytest.warns(UserWarning, match="more than MHA"):  # the per-head qk-norm scale counts too
        build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=int(threshold), rope_placement="full", qk_norm=True)
    with torch.no_grad():
        assert torch.isfinite(attn(torch.randn(1, 5, D_MODEL))).all()


@pytest.mark.parametrize(
    "options, name",
    [
        ({}, "rank"),
        ({"rank": -1}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"rank": 2, "rank_k": 2}, "rank"),
        ({"rank_k": 2}, "rank_v"),
        ({"rank_k": -1, "rank_v": 2}, "rank_k"),
        ({"rank_k": 1, "rank_v": True}, "rank_v"),
        ({"rank": 2, "rope_placement": "spiral"}, "rope_placement"),
        ({"rank": 2, "residual_init": -0.1}, "residual_init"),
        ({"rank": 2, "residual_init": math.nan}, "residual_init"),
        ({"rank": 2, "rope": "partial", "rope_fraction": 1.0}, "rope_fraction"),
    ],
)
def test_invalid_options_name_the_option(options, name):
    with pytest.raises(ValueError, match=name):
        build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, **options)


def test_unknown_decode_path_is_refused_before_work():
    attn = build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=2)
    cache = attn.new_cache(1)
    with pytest.raises(ValueError, match="decode_path"):
        attn.decode_path = "fast"
    with pytest.raises(ValueError, match="decode_path='fast' is not allowed"):
        build_attention("lrkv", D_MODEL, N_HEADS, HEAD_DIM, rank=2, decode_path="fast")
    attn(torch.randn(1, 3, D_MODEL), cache=cache)  # the layer still works on its valid path
    assert cache.seq_len == 3
