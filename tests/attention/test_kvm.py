"""The ``kvm`` attention layer: options, ablation switches, boundaries, row counts, the cache and
the KVM/SWA hybrid model. (The contract's oracles run on the registered example options in
``test_contract.py``; the functional core is tested in ``tests/ops/test_kvm_ops.py``.)"""

from __future__ import annotations

import pytest
import torch

from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.attention import attention_options, build_attention
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, rel_rmse, run_in_calls

SMALL = {
    "fixed": {"chunk_size": 4, "schedule": "fixed", "min_rows": 6},
    "sqrt": {"chunk_size": 4, "schedule": "sqrt", "sqrt_coef": 2.0, "min_rows": 1, "n_kv_heads": 2},
    "saturating": {"chunk_size": 4, "schedule": "saturating", "saturating_rows": 8},
}


def make(dtype=torch.float64, seed=0, **options):
    torch.manual_seed(seed)
    attn = build_attention("kvm", D_MODEL, N_HEADS, HEAD_DIM, **options).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


def test_defaults_follow_the_paper():
    attn = build_attention("kvm", 64, 4, 16)
    s = attn.settings
    assert (s.chunk_size, s.window_chunks, s.schedule, s.sink_len, s.value_norm) == (256, 2, "fixed", 1, "radius")
    assert attn.settings.budget(10**6) == 256
    assert attn.rope == "partial" and attn.rotary.rot_dim == 8 == s.rot_dim  # the first half of each head rotates
    names = {n for n, _ in attn.named_parameters()}
    assert {"ln_s.weight", "ln_s.bias", "gate_proj.weight", "tau_state", "tau_window"} <= names
    assert attn.gate_proj.weight.shape == (4, 64) and attn.tau_state.shape == (4,)
    for option in ("chunk_size", "window_chunks", "schedule", "min_rows", "sqrt_coef", "saturating_rows", "max_rows", "sink_len", "n_kv_heads", "use_temperatures", "value_norm", "merge_gate", "routing_dtype", "gate_appends"):
        assert option in attention_options("kvm")


def test_gqa_keeps_rows_and_gates_per_kv_head_and_temperatures_per_query_head():
    attn = build_attention("kvm", D_MODEL, N_HEADS, HEAD_DIM, n_kv_heads=2, chunk_size=4)
    assert attn.gate_proj.weight.shape[0] == 2 and attn.tau_window.shape == (N_HEADS,)
    cache = attn.new_cache(1)
    with torch.no_grad():
        attn(torch.randn(1, 9, D_MODEL), cache=cache)
    assert cache.state.rows.s_k.shape[:2] == (1, 2) and cache.state.window_gate.view().shape[:2] == (1, 2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"rope": "full"}, "rope"),
        ({"rope": "partial", "rope_fraction": 1.0}, "rope"),
        ({"rope_fraction": 2.0}, "rope_fraction"),
        ({"merge_gate": False, "gate_appends": True}, "gate_appends"),
        ({"schedule": "linear"}, "schedule"),
        ({"sink_len": -1}, "sink_len"),
        ({"chunk_size": 4, "sink_len": 4}, "sink_len"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"use_temperatures": "yes"}, "use_temperatures"),
        ({"value_norm": "length"}, "value_norm"),
        ({"routing_dtype": "float8"}, "routing_dtype"),
        ({"sqrt_coef": 16.0}, "sqrt_coef"),
        ({"window": 8}, "window"),
    ],
)
def test_bad_options_raise_before_building(options, match):
    with pytest.raises(ValueError, match=match):
        build_attention("kvm", D_MODEL, N_HEADS, HEAD_DIM, **options)


def test_no_temperatures_removes_exactly_the_temperatures():
    x = torch.randn(2, 30, D_MODEL, dtype=torch.float64)
    full = make(**SMALL["fixed"])
    plain = make(**SMALL["fixed"], use_temperatures=False)
    missing = plain.load_state_dict(full.state_dict(), strict=False)
    assert set(missing.unexpected_keys) == {"tau_state", "tau_window"} and not missing.missing_keys
    with torch.no_grad():
        assert not torch.allclose(full(x), plain(x))
        full.tau_state.fill_(1.0)
        full.tau_window.fill_(1.0)
        assert torch.equal(full(x), plain(x))


def test_no_merge_gate_removes_exactly_the_gate():
    x = torch.randn(2, 30, D_MODEL, dtype=torch.float64)
    gated = make(**SMALL["sqrt"])
    plain = make(**SMALL["sqrt"], merge_gate=False)
    missing = plain.load_state_dict(gated.state_dict(), strict=False)
    assert set(missing.unexpected_keys) == {"gate_proj.weight"} and not missing.missing_keys
    with torch.no_grad():
        assert not torch.allclose(gated(x), plain(x))
        gated.gate_proj.weight.zero_()  # g = 1 + ELU(0) = 1
        assert torch.equal(gated(x), plain(x))


@pytest.mark.parametrize("switch", [{"sink_len": 0}, {"value_norm": "count"}, {"routing_dtype": "bfloat16"}])
def test_state_switches_keep_the_parameters_and_change_the_state(switch):
    x = torch.randn(2, 61, D_MODEL, dtype=torch.float64)
    base = make(**SMALL["fixed"])
    other = make(**SMALL["fixed"], **switch)
    other.load_state_dict(base.state_dict())  # same parameters, strict
    with torch.no_grad():
        a, b = base(x), other(x)
    first_state = 2 * 4  # before the state is visible the two are the same model
    assert torch.equal(a[:, :first_state], b[:, :first_state])
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("schedule", SMALL)
def test_split_invariance_at_chunk_and_window_boundaries(schedule):
    attn = make(**SMALL[schedule], qk_norm=True)
    x = torch.randn(2, 61, D_MODEL, dtype=torch.float64)
    s = attn.settings

    def check(cache):
        assert cache.state_rows == s.rows_after(cache.seq_len)
        assert cache.nbytes() == attn.cache_bytes(cache.seq_len, torch.float64, batch_size=2)

    with torch.no_grad():
        full = attn(x)
        splits = [[4] * 15 + [1], [8, 1, 3, 4, 4, 1, 7, 12, 21], [3, 5, 4, 4, 9, 36], [12, 13, 36], [1] * 61]
        for sizes in splits:
            assert rel_rmse(run_in_calls(attn, x, sizes, check=check), full) < 1e-10, sizes


def test_state_rows_follow_the_spec_table_end_to_end():
    """A real run at the paper's chunk size: the cache's rows after each update match the table."""
    table = {"fixed": [256, 256, 256, 256], "sqrt": [443, 512, 724, 1024], "saturating": [438, 512, 682, 819]}
    x = torch.randn(1, 4097, 16)
    for schedule, expected in table.items():
        torch.manual_seed(0)
        attn = build_attention("kvm", 16, 2, 8, n_kv_heads=1, schedule=schedule)
        cache, rows = attn.new_cache(1), []
        with torch.no_grad():
            for start, end in [(0, 769), (769, 1025), (1025, 2049), (2049, 4097)]:  # each call ends just after an update
                attn(x[:, start:end], cache=cache)
                rows.append(cache.state_rows)
        assert rows == expected, schedule


def test_cache_is_flat_for_fixed_and_grows_as_sqrt():
    fixed = build_attention("kvm", 64, 4, 16)
    sqrt = build_attention("kvm", 64, 4, 16, schedule="sqrt")
    sizes = [fixed.cache_bytes(n) for n in (1024, 4096, 32768)]
    assert len(set(sizes)) == 1
    rows = [sqrt.settings.rows_after(n + 1) for n in (4096, 16384)]
    assert rows == [1024, 2048]  # 16 sqrt(N)
    assert sqrt.cache_bytes(16385) > sqrt.cache_bytes(4097) > fixed.cache_bytes(4097)


def test_gradients_reach_ln_s_gate_temperatures_and_projections():
    attn = make(torch.float32, **SMALL["sqrt"], qk_norm=True)
    x = torch.randn(2, 37, D_MODEL, requires_grad=True)
    attn(x).square().mean().backward()
    for name in ("ln_s.weight", "ln_s.bias", "gate_proj.weight", "tau_state", "tau_window", "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
        grad = attn.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_bfloat16_cache_keeps_the_rows_in_float32():
    attn = make(torch.bfloat16, **SMALL["fixed"])
    cache = attn.new_cache(1)
    with torch.no_grad():
        attn(torch.randn(1, 20, D_MODEL, dtype=torch.bfloat16), cache=cache)
    assert cache.state.rows.s_k.dtype == torch.float32 and cache.state.window_k.dtype == torch.bfloat16
    assert cache.nbytes() == attn.cache_bytes(20, torch.bfloat16)


def test_kvm_swa_hybrid_prefill_then_decode_equals_full_forward(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        d_model=32,
        n_layers=4,
        n_heads=4,
        attention=["swa", "kvm"],
        kind_options={"swa": {"window": 8, "rope": "full"}, "kvm": SMALL["sqrt"]},
    )
    model = SlimKVForCausalLM(cfg).eval().double()
    assert [a.kind for a in model.attention_layers] == ["swa", "kvm", "swa", "kvm"]
    assert [a.rope for a in model.attention_layers] == ["full", "partial", "full", "partial"]
    ids = torch.randint(0, 61, (2, 40))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        pieces = [model(ids[:, :11], cache=cache).logits]
        for t in range(11, 40):
            pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert rel_rmse(torch.cat(pieces, 1), full) < 1e-10
    assert cache.nbytes() == model.cache_bytes(40, torch.float64, batch_size=2)
    model.save_pretrained(tmp_path)
    loaded = SlimKVForCausalLM.from_pretrained(tmp_path).eval().double()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, full)
    # the paper's hybrid builds from the defaults (window 256 SWA, KVM chunk 256)
    paper = ModelConfig(d_model=64, n_layers=2, n_heads=4, attention=["swa", "kvm"], kind_options={"swa": {"window": 256, "rope": "full"}})
    assert [a.kind for a in SlimKVForCausalLM(paper).attention_layers] == ["swa", "kvm"]
