"""The contract's oracles, run for every registered attention kind and its example options.

A kind added to the registry is tested here without new code (see ``register_attention``).
"""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import build_attention
from tests.helpers import (
    D_MODEL,
    HEAD_DIM,
    N_HEADS,
    SEQ_LEN,
    TOL,
    attention_cases,
    case_id,
    random_splits,
    rel_rmse,
    run_in_calls,
)

CASES = attention_cases()
COMMON_VARIANTS = [
    {},
    {"rope": "partial", "rope_fraction": 0.5, "qk_norm": True, "bias": True},
    {"rope": "none"},
]


def make(kind: str, opts: dict, dtype=torch.float64, seed: int = 0, **extra):
    torch.manual_seed(seed)
    attn = build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, **opts, **extra).to(dtype)
    # Make every parameter non-trivial (zero-initialised gates, unit norms, ...) so that each
    # oracle sees every path of the mechanism.
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("variant", range(len(COMMON_VARIANTS)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_invariance_and_cache_accounting(case, variant, dtype):
    kind, opts = case
    attn = make(kind, opts, dtype, **COMMON_VARIANTS[variant])
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=dtype)
    with torch.no_grad():
        full = attn(x)

        def honest(cache):
            assert cache.nbytes() == attn.cache_bytes(cache.seq_len, dtype, batch_size=2)

        for seed in range(3):
            split = run_in_calls(attn, x, random_splits(SEQ_LEN, seed), check=honest)
            assert rel_rmse(split, full) < TOL[dtype], f"split {random_splits(SEQ_LEN, seed)}"
        one_by_one = run_in_calls(attn, x, [1] * SEQ_LEN, check=honest)
        assert rel_rmse(one_by_one, full) < TOL[dtype]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fast_path_matches_reference(case):
    kind, opts = case
    attn = make(kind, opts, torch.float64, qk_norm=True)
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    sizes = random_splits(SEQ_LEN, 7)
    with torch.no_grad():
        fast, fast_split = attn(x), run_in_calls(attn, x, sizes)
        attn.set_runtime_options(backend="reference")
        ref, ref_split = attn(x), run_in_calls(attn, x, sizes)
    assert rel_rmse(fast, ref) < 1e-10
    assert rel_rmse(fast_split, ref_split) < 1e-10


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_batch_independence(case):
    kind, opts = case
    attn = make(kind, opts)
    x = torch.randn(2, SEQ_LEN, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        both = attn(x)
        alone = torch.cat([attn(x[i : i + 1]) for i in range(2)])
        both_cached = run_in_calls(attn, x, random_splits(SEQ_LEN, 3))
        alone_cached = torch.cat([run_in_calls(attn, x[i : i + 1], random_splits(SEQ_LEN, 3)) for i in range(2)])
    assert rel_rmse(both, alone) < 1e-10
    assert rel_rmse(both_cached, alone_cached) < 1e-10


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradients_reach_every_parameter(case):
    kind, opts = case
    attn = make(kind, opts, torch.float32, qk_norm=True, bias=True)
    x = torch.randn(2, SEQ_LEN, D_MODEL, requires_grad=True)
    attn(x).square().mean().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dtypes(case):
    kind, opts = case
    attn32 = make(kind, opts, torch.float32)
    attn16 = make(kind, opts, torch.bfloat16)
    attn16.load_state_dict({k: v.to(torch.bfloat16) for k, v in attn32.state_dict().items()})
    x = torch.randn(2, SEQ_LEN, D_MODEL)
    with torch.no_grad():
        ref = attn32(x)
        low = attn16(x.to(torch.bfloat16))
        low_split = run_in_calls(attn16, x.to(torch.bfloat16), random_splits(SEQ_LEN, 1))
    assert low.dtype == torch.bfloat16
    assert rel_rmse(low, ref) < 5e-2
    assert rel_rmse(low_split, ref) < 5e-2


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cache_refuses_mismatches(case):
    kind, opts = case
    attn = make(kind, opts, torch.float32)
    cache = attn.new_cache(2)
    with pytest.raises(ValueError, match="batch"):
        attn(torch.randn(3, 4, D_MODEL), cache=cache)
    with pytest.raises(ValueError, match="dtype"):
        attn(torch.randn(2, 4, D_MODEL, dtype=torch.float64), cache=cache)
    other = build_attention(kind, D_MODEL * 2, N_HEADS, HEAD_DIM, **opts)
    with pytest.raises(ValueError, match="cache"):
        other(torch.randn(2, 4, D_MODEL * 2), cache=cache)
    with pytest.raises(ValueError, match="shape"):
        attn(torch.randn(2, 4, D_MODEL + 1))
    assert cache.seq_len == 0 and cache.nbytes() == 0


@pytest.mark.parametrize("kind", sorted({kind for kind, _ in CASES}))
def test_runtime_options_change_paths_not_weights(kind):
    """Runtime options (kernel, decode path) are build options too, and the only options a built layer may change."""
    opts = dict(next(o for k, o in CASES if k == kind))
    attn = make(kind, opts, torch.float64)
    with pytest.raises(ValueError, match="is not a runtime option"):
        attn.set_runtime_options(qk_norm=True)
    with pytest.raises(ValueError, match="backend='fast' is not allowed"):
        attn.set_runtime_options(backend="fast")
    reference = make(kind, opts, torch.float64, backend="reference")
    x = torch.randn(1, SEQ_LEN, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        assert rel_rmse(reference(x), attn(x)) < 1e-10
