"""Numerics of the factorizations on random matrices (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from slimkv.compress.cost import factor_params, rank_for_budget
from slimkv.compress.factored import build_factored
from slimkv.compress.linalg import (
    FactorizationError,
    Factors,
    StatsAccumulator,
    asvd_factors,
    explicit_rootcov_product,
    identity_block,
    pivoted_qr_columns,
    pivoted_qr_columns_reference,
    psd_sqrt,
    rootcov_factors,
    svd_factors,
)

D64 = torch.float64


def random_problem(d_out: int, d_in: int, seed: int = 0, tokens: int = 400):
    """W and an anisotropic covariance C = X X^T / n of correlated inputs (full rank)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=D64)
    mix = torch.randn(d_in, d_in, generator=g, dtype=D64) * torch.logspace(0, -2, d_in, dtype=D64)
    X = torch.randn(tokens, d_in, generator=g, dtype=D64) @ mix.T
    return W, X, X.T @ X / tokens


def weighted_error(W: torch.Tensor, product: torch.Tensor, cov: torch.Tensor) -> float:
    """||(W - BA) C^{1/2}||_F^2 = tr((W - BA) C (W - BA)^T)."""
    diff = W - product
    return float(torch.trace(diff @ cov @ diff.T))


@pytest.mark.parametrize("shape", [(30, 12), (12, 30)])  # d_out > d_in uses a root; d_out <= d_in does not
def test_inversion_free_rootcov_equals_explicit_form(shape):
    W, _, cov = random_problem(*shape)
    r = 5
    product = rootcov_factors(W, cov, r).product()
    assert torch.allclose(product, explicit_rootcov_product(W, cov, r), atol=1e-9, rtol=1e-7)


def test_any_square_root_of_C_gives_the_same_truncation():
    W, _, cov = random_problem(30, 12, seed=1)
    cholesky = torch.linalg.cholesky(cov)  # C = L L^T, a non-symmetric root
    symmetric = psd_sqrt(cov)
    assert torch.allclose(symmetric @ symmetric, cov, atol=1e-12)
    a = rootcov_factors(W, cov, 4, root=cholesky).product()
    b = rootcov_factors(W, cov, 4, root=symmetric).product()
    assert torch.allclose(a, b, atol=1e-9)


def test_rootcov_minimizes_the_activation_weighted_error():
    W, _, cov = random_problem(20, 16, seed=2)
    r = 6
    best = weighted_error(W, rootcov_factors(W, cov, r).product(), cov)
    assert best < weighted_error(W, svd_factors(W, r).product(), cov)
    # no other rank-r matrix does better: perturb the optimum along random rank-r directions
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        f = rootcov_factors(W, cov, r)
        other = (f.B + 1e-2 * torch.randn(f.B.shape, generator=g, dtype=D64)) @ (f.A + 1e-2 * torch.randn(f.A.shape, generator=g, dtype=D64))
        assert weighted_error(W, other, cov) > best


def test_rootcov_stays_finite_and_optimal_when_C_is_singular():
    W, X, _ = random_problem(10, 16, seed=3)
    X = X[:5]  # 5 tokens: rank(C) = 5 < 16
    cov = X.T @ X / 5
    product = rootcov_factors(W, cov, 5).product()
    assert torch.isfinite(product).all()
    # it reproduces W on the data exactly (the data span has dimension 5)
    assert torch.allclose(product @ X.T, W @ X.T, atol=1e-8)


def test_asvd_and_svd_are_exact_at_full_rank():
    W, X, _ = random_problem(9, 7, seed=4)
    assert torch.allclose(svd_factors(W, 7).product(), W, atol=1e-10)
    assert torch.allclose(asvd_factors(W, X.abs().mean(0), 7).product(), W, atol=1e-10)


def test_identity_block_reconstructs_exactly_and_saves_r_squared():
    W, _, cov = random_problem(24, 18, seed=5)
    r = 7
    factors = rootcov_factors(W, cov, r)
    block = identity_block(factors)
    assert torch.allclose(block.product(), factors.product(), atol=1e-10)
    A = block.dense_A()
    assert torch.equal(A[:, block.perm[:r]], torch.eye(r, dtype=D64))
    module = build_factored(block, None, torch.float64, "cpu")
    dense_module = build_factored(factors, None, torch.float64, "cpu")
    assert dense_module.num_weights() - module.num_weights() == r * r
    assert module.num_weights() == factor_params(18, 24, r, identity=True)
    x = torch.randn(3, 5, 18, dtype=D64)
    assert torch.allclose(module(x), x @ factors.product().T, atol=1e-10)


def test_pivoted_qr_avoids_a_singular_leading_block():
    g = torch.Generator().manual_seed(6)
    A = torch.randn(4, 10, generator=g, dtype=D64)
    A[:, 1] = A[:, 0]  # the first r columns are singular
    A[:, 2] = 2 * A[:, 0]
    perm, diag = pivoted_qr_columns(A)
    J = A[:, perm[:4]]
    assert torch.linalg.matrix_rank(J) == 4
    assert sorted(perm.tolist()) == list(range(10))
    assert torch.all(diag[:-1] >= diag[1:] - 1e-12)  # pivoting orders |R_kk| decreasingly
    block = identity_block(Factors(B=torch.randn(6, 4, generator=g, dtype=D64), A=A))
    assert block.pivot_ratio > 1e-3


def test_identity_block_of_a_rank_deficient_factor_raises():
    A = torch.zeros(3, 8, dtype=D64)
    A[0, 0] = A[1, 1] = 1.0  # third row is zero
    with pytest.raises(FactorizationError, match="rank deficient"):
        identity_block(Factors(B=torch.ones(5, 3, dtype=D64), A=A))


def test_non_finite_inputs_raise_instead_of_producing_a_layer():
    W, _, cov = random_problem(8, 6, seed=7)
    W[2, 3] = float("nan")
    with pytest.raises(FactorizationError, match="non-finite"):
        rootcov_factors(W, cov, 3)
    with pytest.raises(FactorizationError, match="non-finite"):
        svd_factors(W, 3)


def test_statistics_are_exact_float64_sums_in_chunks():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 333, 7, generator=g)
    acc = StatsAccumulator(7, chunk=50)
    acc.add(x[0])
    acc.add(x[1])
    stats = acc.finish()
    rows = x.reshape(-1, 7).double()
    assert stats.count == 666
    assert torch.allclose(stats.cov, rows.T @ rows / 666, atol=1e-13)
    assert torch.allclose(stats.mean, rows.mean(0), atol=1e-13)
    assert torch.allclose(stats.centered(), torch.cov(rows.T, correction=0), atol=1e-12)


@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("d_in,d_out,ratio", [(576, 576, 0.2), (576, 1536, 0.3), (1536, 576, 0.5), (64, 16, 0.1)])
def test_rank_for_budget_is_the_largest_rank_that_fits(d_in, d_out, ratio, identity):
    keep = (1 - ratio) * d_in * d_out
    r = rank_for_budget(d_in, d_out, keep, identity)
    assert 1 <= r <= min(d_in, d_out)
    assert factor_params(d_in, d_out, r, identity) <= keep
    assert r == min(d_in, d_out) or factor_params(d_in, d_out, r + 1, identity) > keep


def test_identity_blocks_buy_rank_at_equal_budget():
    keep = 0.8 * 576 * 576
    dense, ident = rank_for_budget(576, 576, keep, False), rank_for_budget(576, 576, keep, True)
    assert dense == 230 and ident == 318  # r 1152 <= keep vs r 1152 - r^2 <= keep
    assert math.isclose(rank_for_budget(576, 576, 576 * 576, True), 576)  # ratio 0: full rank, same count


@pytest.mark.parametrize("shape,seed", [((5, 9), 0), ((12, 12), 1), ((30, 70), 2)])
def test_fast_pivoted_qr_picks_the_same_columns_as_the_reference(shape, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(*shape, generator=g, dtype=D64) * torch.logspace(0, -3, shape[1], dtype=D64)
    fast_perm, fast_diag = pivoted_qr_columns(A)
    ref_perm, ref_diag = pivoted_qr_columns_reference(A)
    r = shape[0]
    assert torch.equal(fast_perm[:r], ref_perm[:r])
    assert sorted(fast_perm.tolist()) == list(range(shape[1]))
    assert torch.allclose(fast_diag, ref_diag, rtol=1e-8)


def test_projected_statistics_equal_the_weighted_covariance():
    """out_weight accumulates W C W^T directly (what RootCov needs when d_out < d_in)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(700, 12, generator=g) + 0.5
    W = torch.randn(5, 12, generator=g, dtype=torch.float64)
    full = StatsAccumulator(12, chunk=64)
    projected = StatsAccumulator(12, chunk=64, cov=False, mean_abs=False, out_weight=W)
    full.add(x)
    projected.add(x)
    a, b = full.finish(), projected.finish()
    assert b.cov is None and b.mean_abs is None
    for centered in (False, True):
        assert torch.allclose(b.weighted_gram(W, centered), a.weighted_gram(W, centered), atol=1e-12)
        reference = W @ (a.centered() if centered else a.cov) @ W.T
        assert torch.allclose(b.weighted_gram(W, centered), reference, atol=1e-12)
    assert torch.allclose(rootcov_factors(W, None, 3, gram=b.weighted_gram(W, False)).product(), rootcov_factors(W, a.cov, 3).product(), atol=1e-10)
    with pytest.raises(ValueError, match="without 'cov'"):
        b.centered()
