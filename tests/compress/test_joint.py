"""Joint QK (Tucker) and joint MLP numerics on random matrices."""

from __future__ import annotations

import pytest
import torch

from slimkv.compress.joint_mlp import SensitivityAccumulator, relu_ud, weighted_shared_factors
from slimkv.compress.joint_qk import RopeAverage, joint_qk
from slimkv.compress.linalg import FactorizationError, rootcov_factors

D64 = torch.float64


def qk_problem(heads=4, kv_heads=2, head_dim=5, d=16, tokens=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    Wq = torch.randn(heads * head_dim, d, generator=g, dtype=D64)
    Wk = torch.randn(kv_heads * head_dim, d, generator=g, dtype=D64)
    X = torch.randn(tokens, d, generator=g, dtype=D64) * torch.logspace(0, -1.5, d, dtype=D64)
    return Wq, Wk, X


def score_loss(Wq, Wk, q_product, k_product, X, heads, kv_heads):
    """sum_i ||X Wq_i^T Wk_g(i) X^T - X Wq^_i^T Wk^_g(i) X^T||^2 / sum_i ||X Wq_i^T Wk_g(i) X^T||^2, explicitly."""
    head_dim = Wq.shape[0] // heads
    err = total = 0.0
    for i in range(heads):
        g = i // (heads // kv_heads)
        rows_q, rows_k = slice(i * head_dim, (i + 1) * head_dim), slice(g * head_dim, (g + 1) * head_dim)
        exact = (X @ Wq[rows_q].T) @ (X @ Wk[rows_k].T).T
        approx = (X @ q_product[rows_q].T) @ (X @ k_product[rows_k].T).T
        err += float(((exact - approx) ** 2).sum())
        total += float((exact**2).sum())
    return err / total


def test_objective_is_monotone_and_matches_the_explicit_score_error():
    Wq, Wk, X = qk_problem()
    cov = X.T @ X / X.shape[0]
    result = joint_qk(Wq, Wk, cov, 4, 2, rank_q=6, rank_k=4, iterations=8)
    history = result.objective
    assert 3 <= len(history) <= 17 and len(history) % 2 == 1
    assert all(b <= a + 1e-12 for a, b in zip(history, history[1:]))
    assert history[-1] < history[0] or history[0] < 1e-12
    # the reduced-coordinate objective is the relative score error on the calibration tokens
    explicit = score_loss(Wq, Wk, result.q.product(), result.k.product(), X, 4, 2)
    assert abs(explicit - history[-1]) < 1e-9


def test_joint_qk_preserves_scores_better_than_separate_rootcov():
    Wq, Wk, X = qk_problem(seed=1)
    cov = X.T @ X / X.shape[0]
    joint = joint_qk(Wq, Wk, cov, 4, 2, rank_q=5, rank_k=4)
    separate = score_loss(Wq, Wk, rootcov_factors(Wq, cov, 5).product(), rootcov_factors(Wk, cov, 4).product(), X, 4, 2)
    assert joint.objective[-1] < separate


def test_full_rank_joint_qk_is_exact_and_keeps_each_heads_basis():
    Wq, Wk, X = qk_problem(d=24, seed=2)  # rank(W_q C W_q^T) = 20, rank(W_k ...) = 10
    cov = X.T @ X / X.shape[0]
    result = joint_qk(Wq, Wk, cov, 4, 2, rank_q=20, rank_k=10)
    assert result.numerical_ranks == (20, 10)
    assert torch.allclose(result.q.product(), Wq, atol=1e-8)
    assert torch.allclose(result.k.product(), Wk, atol=1e-8)


def test_mha_pairing_and_bad_head_counts():
    Wq, Wk, X = qk_problem(heads=3, kv_heads=3, seed=3)
    cov = X.T @ X / X.shape[0]
    result = joint_qk(Wq, Wk, cov, 3, 3, rank_q=6, rank_k=6)
    assert abs(score_loss(Wq, Wk, result.q.product(), result.k.product(), X, 3, 3) - result.objective[-1]) < 1e-9
    with pytest.raises(ValueError, match="multiple"):
        joint_qk(Wq, Wk, cov, 3, 2, 4, 4)
    with pytest.raises(FactorizationError):
        joint_qk(Wq * float("nan"), Wk, cov, 3, 3, 4, 4)


def test_relu_alternation_objective_does_not_increase():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(400, 10, generator=g, dtype=D64)
    W_u, b_u = torch.randn(24, 10, generator=g, dtype=D64), torch.randn(24, generator=g, dtype=D64)
    W_d = torch.randn(10, 24, generator=g, dtype=D64)
    result = relu_ud(X, W_u, b_u, W_d, rank_up=5, rank_down=5, iterations=6)
    history = result.objective
    assert all(b <= a * (1 + 1e-6) + 1e-9 for a, b in zip(history, history[1:]))
    assert result.up.rank == 5 and result.down.rank == 5


def test_relu_alternation_is_exact_at_full_rank():
    g = torch.Generator().manual_seed(5)
    X = torch.randn(300, 6, generator=g, dtype=D64)
    W_u, W_d = torch.randn(9, 6, generator=g, dtype=D64), torch.randn(6, 9, generator=g, dtype=D64)
    result = relu_ud(X, W_u, None, W_d, rank_up=6, rank_down=6, iterations=2)
    assert torch.allclose(result.up.product(), W_u, atol=1e-6)
    assert result.objective[-1] < 1e-8  # zero up to the 1e-6 relative damping


def test_shared_input_factor_is_exact_at_full_rank_and_uses_one_A():
    g = torch.Generator().manual_seed(6)
    W_g, W_u = torch.randn(20, 8, generator=g, dtype=D64), torch.randn(20, 8, generator=g, dtype=D64)
    X = torch.randn(200, 8, generator=g, dtype=D64)
    cov = X.T @ X / 200
    weights = [torch.rand(20, generator=g, dtype=D64) + 0.1, torch.rand(20, generator=g, dtype=D64) + 0.1]
    stacked, rows = weighted_shared_factors([W_g, W_u], weights, cov, rank=8)
    assert rows == [20, 20]
    assert torch.allclose(stacked.product(), torch.cat([W_g, W_u]), atol=1e-9)
    # at lower rank, the weighted objective beats the unweighted stack's
    def weighted_err(product):
        diff = (torch.cat(weights)[:, None]) * (torch.cat([W_g, W_u]) - product)
        return float(torch.trace(diff @ cov @ diff.T))
    low, _ = weighted_shared_factors([W_g, W_u], weights, cov, rank=3)
    plain, _ = weighted_shared_factors([W_g, W_u], [torch.ones(20, dtype=D64)] * 2, cov, rank=3)
    assert weighted_err(low.product()) < weighted_err(plain.product())


def test_sensitivity_weights_follow_the_gated_product():
    act = torch.nn.SiLU()
    acc = SensitivityAccumulator(3, gated=True)
    gate = torch.tensor([[0.0, 1.0, -2.0]], dtype=D64)
    up = torch.tensor([[1.0, 2.0, 3.0]], dtype=D64)
    acc.add(act, gate, up)
    silu = gate * torch.sigmoid(gate)
    dsilu = torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate)))
    assert torch.allclose(acc.gate_sq, ((dsilu * up) ** 2)[0])
    assert torch.allclose(acc.up_sq, (silu**2)[0])
    weights = acc.row_weights(torch.ones(4, 3, dtype=D64) * 2)
    assert torch.allclose(weights[1], (silu[0] ** 2 * 16).sqrt().clamp_min(1e-6 * float(weights[0].max())))


def rotation(offset: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """R_offset of rotate-half RoPE (pairs k, k + d_h/2)."""
    angle = offset * inv_freq.double()
    c, s = torch.diag(angle.cos()), torch.diag(angle.sin())
    return torch.cat([torch.cat([c, -s], 1), torch.cat([s, c], 1)], 0)


def test_rope_average_equals_the_explicit_offset_sum():
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    seq_len = 9
    rope = RopeAverage(inv_freq, seq_len)
    M = torch.randn(6, 6, generator=torch.Generator().manual_seed(8), dtype=D64)
    weights = torch.arange(seq_len, 0, -1, dtype=D64)
    weights /= weights.sum()
    explicit = sum(w * rotation(-m, inv_freq) @ M @ rotation(-m, inv_freq).T for m, w in enumerate(weights))
    explicit_t = sum(w * rotation(-m, inv_freq).T @ M @ rotation(-m, inv_freq) for m, w in enumerate(weights))
    assert torch.allclose(rope.average(M), explicit, atol=1e-12)
    assert torch.allclose(rope.average(M, transpose=True), explicit_t, atol=1e-12)


def test_rope_convention_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    positions = torch.tensor([5.0, 2.0], dtype=D64)
    freqs = positions[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    q, k = torch.randn(1, 1, 2, 8, dtype=D64), torch.randn(1, 1, 2, 8, dtype=D64)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    # query at t = 5, key at s = 2: score = q^T R_{s - t} k
    assert torch.allclose(q_rot[0, 0, 0] @ k_rot[0, 0, 1], q[0, 0, 0] @ rotation(-3, inv_freq) @ k[0, 0, 1])


def test_rope_aware_objective_is_monotone_and_matches_explicit_rotated_scores():
    Wq, Wk, X = qk_problem(head_dim=6, d=20, seed=9)
    cov = X.T @ X / X.shape[0]
    inv_freq = 1.0 / (50.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    seq_len = 7
    result = joint_qk(Wq, Wk, cov, 4, 2, rank_q=7, rank_k=5, rope=RopeAverage(inv_freq, seq_len))
    history = result.objective
    assert all(b <= a + 1e-12 for a, b in zip(history, history[1:]))
    # explicit: sum_m w_m sum_i ||C^1/2 (Wq_i^T R Wk_g - Wq^_i^T R Wk^_g) C^1/2||^2 / (same for the originals)
    root = torch.linalg.cholesky(cov)
    weights = torch.arange(seq_len, 0, -1, dtype=D64)
    err = total = 0.0
    for m, w in enumerate(weights):
        R = rotation(-m, inv_freq)
        for i in range(4):
            g = i // 2
            exact = root.T @ Wq[i * 6:(i + 1) * 6].T @ R @ Wk[g * 6:(g + 1) * 6] @ root
            approx = root.T @ result.q.product()[i * 6:(i + 1) * 6].T @ R @ result.k.product()[g * 6:(g + 1) * 6] @ root
            err += float(w * ((exact - approx) ** 2).sum())
            total += float(w * (exact**2).sum())
    assert abs(err / total - history[-1]) < 1e-9
