"""Row-weighted low-rank fits of stacked projections (float64), shared by the conversion methods.

A target T (n, d') maps x' to n outputs whose errors cost differently: an error e in the outputs
costs ||L e||^2 for a row weight L (n, n) (a key error in logit units, a value error after the
output projection). ``weighted_factors`` finds T ~= B A with A (r, d') (what is computed from x'
and, for a latent, cached) minimising E||L (T - B A) x'||^2 under E[x' x'^T] = C.
"""

from __future__ import annotations

import torch

from slimkv.compress.linalg import psd_sqrt, top_eigh


def damped_sqrt(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    """The symmetric square root of PSD ``matrix`` + damping * (its mean eigenvalue) I: a row
    weight that stays invertible where ``matrix`` has (almost) no energy."""
    n = matrix.shape[0]
    scale = float(torch.trace(matrix).clamp_min(0)) / n
    return psd_sqrt(matrix + damping * scale * torch.eye(n, dtype=matrix.dtype))


def least_squares_up(target: torch.Tensor, down: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """B minimising E||(target - B down) x'||^2: target C down^T (down C down^T)^-1 (n, r). It is
    the minimiser for any row weight, so a weight never needs inverting."""
    gram = down @ cov @ down.T
    gram = gram + 1e-10 * float(gram.diagonal().mean().clamp_min(1e-300)) * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram, (target @ cov @ down.T).T).T


def weighted_factors(target: torch.Tensor, cov: torch.Tensor, weight: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T ~= B A (module docstring): A = U^T L T with U the top-``rank`` eigenvectors of L T C T^T L^T
    (the best rank-r subspace of the weighted outputs), then B by least squares given A.
    ``weight`` None: L = I (RootCov). Returns A (rank, d'), B (n, rank).

    A C A^T is then diagonal (the eigenvalues); A's rows are scaled to unit second moment, so the
    latent A x' has unit variance per channel and B A loses no precision in float32 however
    unevenly L weighs the rows (a product of a large B and a small A would)."""
    if rank == 0:
        return target.new_zeros(0, target.shape[1]), target.new_zeros(target.shape[0], 0)
    weighted = target if weight is None else weight @ target
    values, basis = top_eigh(weighted @ cov @ weighted.T, rank, "weighted low-rank fit")
    down = basis.T @ weighted / values.clamp_min(1e-12 * float(values[0].clamp_min(1e-300))).sqrt()[:, None]
    return down, least_squares_up(target, down, cov)


def weighted_error(target: torch.Tensor, fitted: torch.Tensor, cov: torch.Tensor, weight: torch.Tensor | None) -> float:
    """E||L (T - T_fit) x'||^2 / E||L T x'||^2: the relative error of a fit in its own units."""
    diff = target - fitted
    if weight is not None:
        diff, target = weight @ diff, weight @ target
    return float(torch.trace(diff @ cov @ diff.T) / torch.trace(target @ cov @ target.T).clamp_min(1e-300))
