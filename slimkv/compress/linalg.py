"""Numerics of low-rank compression: activation statistics, factorizations, identity blocks
(what a factorization costs, and the rank a budget allows: ``slimkv.compress.cost``).

Conventions: a weight ``W`` is (d_out, d_in) and acts as ``y = W x``; a rank-r factorization is
``W ~ B A`` with ``B`` (d_out, r) and ``A`` (r, d_in). Statistics are accumulated and every
factorization is computed in float64 with exact ``torch.linalg`` routines (no randomized SVD).

RootCov (the local activation-aware optimum of ||(W - BA) C^{1/2}||_F, C = E[x x^T]) is computed
in its inversion-free form: U_r = top-r left singular vectors of W C^{1/2} (the top eigenvectors of
W C W^T), B = U_r, A = U_r^T W. It needs no C^{-1/2} and stays correct when C is singular; any
square root of C gives the same truncation (the tests check the Cholesky root against the
symmetric one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


class FactorizationError(RuntimeError):
    """A factorization produced NaN/inf, hit a singular block, or broke an invariant."""


def check_finite(name: str, *tensors: torch.Tensor) -> None:
    """Raise FactorizationError naming ``name`` if any tensor holds NaN/inf."""
    for tensor in tensors:
        if not bool(torch.isfinite(tensor).all()):
            raise FactorizationError(f"{name}: non-finite values (NaN/inf) in the factorization inputs or result")


# ----------------------------------------------------------------------------------------------
# Activation statistics
# ----------------------------------------------------------------------------------------------


@dataclass
class Stats:
    """Statistics of a layer input x over ``count`` tokens (float64).

    ``cov`` is the uncentered E[x x^T] (d, d); ``mean`` E[x]; ``mean_abs`` E[|x|] per channel
    (ASVD's scale). ``out_gram`` is W E[x x^T] W^T for the one weight ``out_weight`` the
    statistics were projected through (d_out, d_out): all RootCov needs when d_out < d_in, at a
    fraction of the cost of the d x d covariance. Fields that were not accumulated are None.
    """

    cov: torch.Tensor | None
    mean: torch.Tensor
    mean_abs: torch.Tensor | None
    count: int
    out_gram: torch.Tensor | None = None
    out_weight: torch.Tensor | None = field(default=None, repr=False)
    energy: float = 0.0  # E[|x|^2] / d = tr(C) / d: the scale of C, known even when only ``out_gram`` was kept
    shrinkage: float = 0.0  # s of ``shrunk``: C was replaced by (1 - s) C + s (tr C / d) I
    cross: torch.Tensor | None = None  # E[x_dense x^T] (d, d): the dense model's input to the same layer beside this one (upstream correction)
    dense_mean: torch.Tensor | None = None  # E[x_dense]

    _roots: dict = field(default_factory=dict, repr=False)

    def shrunk(self, s: float) -> Stats:
        """These statistics with C replaced by (1 - s) C + s (tr C / d) I (and ``out_gram`` by W of that W^T).

        Shrinkage towards the scaled identity keeps some of W's energy in the input directions the
        calibration text barely excites: s = 0 is RootCov's fit to the calibration text alone, s = 1
        plain SVD. Means are unchanged."""
        if not 0.0 <= s < 1.0:
            raise ValueError(f"cov_shrinkage must be in [0, 1); got {s}")
        if s == 0.0:
            return self
        cov = None if self.cov is None else (1 - s) * self.cov + s * self.energy * torch.eye(self.cov.shape[0], dtype=self.cov.dtype, device=self.cov.device)
        out_gram = None
        if self.out_gram is not None:
            W = self.out_weight
            out_gram = (1 - s) * self.out_gram + s * self.energy * (W @ W.T)
        return Stats(cov=cov, mean=self.mean, mean_abs=self.mean_abs, count=self.count, out_gram=out_gram, out_weight=self.out_weight,
                     energy=self.energy, shrinkage=s, cross=self.cross, dense_mean=self.dense_mean)

    def corrected_weight(self, W: torch.Tensor, damping: float, centered: bool = False) -> torch.Tensor:
        """W* = W C_dx (C + lambda I)^{-1}: the map from this (compressed-upstream) input x to the
        output the dense model computes from its own input, W x_dense, in the least-squares sense
        (centered: the fluctuations; the bias restores the mean). lambda = damping * tr(C) / d.
        Without ``cross`` statistics, W itself."""
        if self.cross is None:
            return W
        cov, cross = self._need("cov"), self.cross
        if centered:
            cov, cross = self.centered(), cross - torch.outer(self.dense_mean, self.mean)
        return solve_damped(W @ cross, cov, damping * self.energy, "upstream correction (least-squares target)")

    def centered(self) -> torch.Tensor:
        """E[(x - mu)(x - mu)^T]: the statistic to use when the layer has a bias (see ``bias_correction``)."""
        return self._need("cov") - torch.outer(self.mean, self.mean)

    def root(self, centered: bool) -> torch.Tensor:
        """Symmetric square root of the (centered) covariance, computed once and shared by the
        projections that read this input."""
        if centered not in self._roots:
            self._roots[centered] = psd_sqrt(self.centered() if centered else self._need("cov"))
        return self._roots[centered]

    def weighted_gram(self, W: torch.Tensor, centered: bool) -> torch.Tensor:
        """W C W^T (C centered or not): from ``out_gram`` when W is the projected weight, else from ``cov``."""
        if self.out_gram is not None and W is self.out_weight:
            gram = self.out_gram
            if centered:
                projected_mean = W @ self.mean
                gram = gram - torch.outer(projected_mean, projected_mean)
            return gram
        cov = self.centered() if centered else self._need("cov")
        return W @ cov @ W.T

    def _need(self, name: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"these statistics were accumulated without {name!r}")
        return value


class StatsAccumulator:
    """Accumulates ``Stats`` of vectors of size ``dim`` with chunked float64 ``addmm``.

    Activations are cast to float64 before the product (not after), chunk by chunk, so the sums
    are exact to float64 round-off and the float64 copy never exceeds ``chunk`` rows. Only what
    the caller asks for is accumulated: ``cov`` (d x d, the costly part), ``mean_abs`` and/or
    ``out_weight`` W (d_out, d): the Gram (X W^T)^T (X W^T) of the projected inputs, which equals
    W (X^T X) W^T and costs d_out (d + d_out) instead of d^2 per token. The projection X W^T runs in
    the activations' dtype, as the layer itself computes it (float32 round-off, relative ~1e-7);
    its Gram is summed in float64.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu", chunk: int = 2048, *, cov: bool = True, mean_abs: bool = True,
                 out_weight: torch.Tensor | None = None, cross: bool = False):
        self.dim = dim
        self.chunk = chunk
        self.xtx = torch.zeros(dim, dim, dtype=torch.float64, device=device) if cov else None
        self.total = torch.zeros(dim, dtype=torch.float64, device=device)
        self.total_abs = torch.zeros(dim, dtype=torch.float64, device=device) if mean_abs else None
        self.total_sq = torch.zeros((), dtype=torch.float64, device=device)
        # a float64 weight on ``device`` (what the pipeline passes) is kept as is: ``Stats.weighted_gram`` recognises it by identity
        self.out_weight = out_weight.to(dtype=torch.float64, device=device) if out_weight is not None else None
        self.out_gram = torch.zeros(out_weight.shape[0], out_weight.shape[0], dtype=torch.float64, device=device) if out_weight is not None else None
        self.out_weight_native: torch.Tensor | None = None  # out_weight in the activations' dtype and device, made on the first add
        self.cross = torch.zeros(dim, dim, dtype=torch.float64, device=device) if cross else None
        self.dense_total = torch.zeros(dim, dtype=torch.float64, device=device) if cross else None
        self.count = 0

    def add(self, x: torch.Tensor, dense: torch.Tensor | None = None) -> None:
        """Add the vectors of ``x`` (..., dim); with ``cross`` statistics also ``dense`` (same shape):
        the dense model's input to the same layer for the same tokens."""
        rows = x.reshape(-1, self.dim)
        if self.out_weight is not None and (self.out_weight_native is None or self.out_weight_native.dtype != rows.dtype):
            self.out_weight_native = self.out_weight.to(dtype=rows.dtype, device=rows.device)
        if (dense is not None) != (self.cross is not None):
            raise ValueError("dense inputs must be given exactly when cross statistics are accumulated")
        dense_rows = dense.reshape(-1, self.dim) if dense is not None else None
        for start in range(0, rows.shape[0], self.chunk):
            block = rows[start:start + self.chunk].to(dtype=torch.float64, device=self.total.device)
            if dense_rows is not None:
                dense_block = dense_rows[start:start + self.chunk].to(dtype=torch.float64, device=self.total.device)
                self.cross.addmm_(dense_block.T, block)
                self.dense_total += dense_block.sum(0)
            if self.xtx is not None:
                self.xtx.addmm_(block.T, block)
            if self.out_gram is not None:
                # the projection in the activations' own precision (what the layer computes), the Gram of its result in float64
                projected = (rows[start:start + self.chunk] @ self.out_weight_native.T).to(torch.float64)
                self.out_gram.addmm_(projected.T, projected)
            self.total += block.sum(0)
            self.total_sq += block.square().sum()
            if self.total_abs is not None:
                self.total_abs += block.abs().sum(0)
        self.count += rows.shape[0]

    def finish(self, name: str = "activation statistics") -> Stats:
        if self.count == 0:
            raise FactorizationError(f"{name}: no calibration tokens reached this layer")

        def symmetrised(total: torch.Tensor | None) -> torch.Tensor | None:
            return None if total is None else 0.5 * (total + total.T) / self.count

        stats = Stats(cov=symmetrised(self.xtx), mean=self.total / self.count,
                      mean_abs=self.total_abs / self.count if self.total_abs is not None else None, count=self.count,
                      out_gram=symmetrised(self.out_gram), out_weight=self.out_weight, energy=float(self.total_sq) / (self.count * self.dim),
                      cross=None if self.cross is None else self.cross / self.count,
                      dense_mean=None if self.dense_total is None else self.dense_total / self.count)
        check_finite(name, *(t for t in (stats.cov, stats.out_gram, stats.mean) if t is not None))
        return stats


def damping_for(cov: torch.Tensor, eps: float) -> float:
    """lambda = eps * mean(diag C): damping relative to the scale of C (0 for an all-zero C)."""
    return float(eps * cov.diagonal().mean().clamp_min(0))


# ----------------------------------------------------------------------------------------------
# Eigen helpers
# ----------------------------------------------------------------------------------------------


def top_eigh(sym: torch.Tensor, r: int, name: str = "eigh") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``r`` eigenpairs of a symmetric matrix: (values descending (r,), vectors as columns (n, r))."""
    check_finite(name, sym)
    try:
        values, vectors = torch.linalg.eigh(0.5 * (sym + sym.T))
    except RuntimeError as err:  # torch raises LinAlgError (a RuntimeError) on non-convergence
        raise FactorizationError(f"{name}: eigendecomposition failed ({err})") from err
    return values.flip(0)[:r], vectors.flip(1)[:, :r]


def psd_sqrt(cov: torch.Tensor) -> torch.Tensor:
    """The symmetric square root of a PSD matrix (negative round-off eigenvalues clamped to 0)."""
    values, vectors = top_eigh(cov, cov.shape[0], "square root of C")
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.T


def top_left_subspace(W: torch.Tensor, cov: torch.Tensor | None, r: int, root: torch.Tensor | None = None, name: str = "rootcov",
                      gram: torch.Tensor | None = None) -> torch.Tensor:
    """Orthonormal basis (d_out, r) of the top-r left singular subspace of W C^{1/2}.

    For d_out <= d_in it is the top eigenvectors of W C W^T (no root needed; pass that matrix as
    ``gram`` if it is already known). Otherwise it is QR(W S V_r) with V_r the top eigenvectors of
    S^T W^T W S, for any root S S^T = C (``root``, or the symmetric root); the smaller Gram is
    always the one decomposed. Non-finite inputs surface in the decomposed matrix (FactorizationError).
    """
    d_out, d_in = W.shape
    if d_out <= d_in:
        _, basis = top_eigh(W @ cov @ W.T if gram is None else gram, r, name)
        return basis
    if cov is None and root is None:
        raise ValueError(f"{name}: d_out > d_in needs the input covariance or its root")
    S = psd_sqrt(cov) if root is None else root
    M = W @ S
    _, V = top_eigh(M.T @ M, r, name)
    basis, _ = torch.linalg.qr(M @ V)
    check_finite(name, basis)
    return basis


# ----------------------------------------------------------------------------------------------
# Factorizations
# ----------------------------------------------------------------------------------------------


@dataclass
class Factors:
    """W ~ B @ A with B (d_out, r), A (r, d_in), float64."""

    B: torch.Tensor
    A: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def product(self) -> torch.Tensor:
        return self.B @ self.A


def svd_factors(W: torch.Tensor, r: int) -> Factors:
    """Plain truncated SVD of W (no activation statistics); singular values split evenly."""
    check_finite("svd", W)
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    root = s[:r].sqrt()
    return Factors(B=U[:, :r] * root, A=root[:, None] * Vh[:r])


def asvd_factors(W: torch.Tensor, mean_abs: torch.Tensor, r: int, alpha: float = 0.5) -> Factors:
    """ASVD: SVD of W diag(s) with s = mean(|x|)^alpha per input channel, then unscale A."""
    scale = mean_abs.clamp_min(0) ** alpha
    scale = scale.clamp_min(1e-8 * float(scale.max().clamp_min(1e-300)))
    factors = svd_factors(W * scale, r)
    return Factors(B=factors.B, A=factors.A / scale)


def rootcov_factors(W: torch.Tensor, cov: torch.Tensor | None, r: int, root: torch.Tensor | None = None, name: str = "rootcov",
                    gram: torch.Tensor | None = None) -> Factors:
    """Inversion-free RootCov: B = U_r, A = U_r^T W (U_r from ``top_left_subspace``; ``gram`` = W C W^T if known)."""
    basis = top_left_subspace(W, cov, r, root=root, name=name, gram=gram)
    factors = Factors(B=basis, A=basis.T @ W)
    check_finite(name, factors.B, factors.A)
    return factors


def explicit_rootcov_product(W: torch.Tensor, cov: torch.Tensor, r: int) -> torch.Tensor:
    """Reference form svd_r(W C^{1/2}) C^{-1/2} (needs a non-singular C); used by the tests."""
    values, vectors = torch.linalg.eigh(cov)
    root = (vectors * values.sqrt()) @ vectors.T
    inv_root = (vectors / values.sqrt()) @ vectors.T
    U, s, Vh = torch.linalg.svd(W @ root, full_matrices=False)
    return (U[:, :r] * s[:r]) @ Vh[:r] @ inv_root


def refit_output_factor(factors: Factors | IdentityBlockFactors, target_cross: torch.Tensor, cov: torch.Tensor, damping: float,
                        name: str = "refit") -> Factors | IdentityBlockFactors:
    """Keep the input factor A, set B = argmin E||t - B A x||^2 = T A^T (A C A^T + lambda I)^{-1},
    where ``target_cross`` T = E[t x^T] (d_out, d_in) and C = E[x x^T]; identity-block factors keep
    their permutation and A_rest (B is the factor after the identity block)."""
    A = factors.dense_A() if isinstance(factors, IdentityBlockFactors) else factors.A
    B = solve_damped(target_cross @ A.T, A @ cov @ A.T, damping, name)
    check_finite(name, B)
    if isinstance(factors, IdentityBlockFactors):
        return IdentityBlockFactors(B=B, perm=factors.perm, A_rest=factors.A_rest, pivot_ratio=factors.pivot_ratio)
    return Factors(B=B, A=A)


def bias_correction(W: torch.Tensor, product: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """b' = b + (W - BA) mu: the bias that keeps the mean output exact once W is replaced by BA."""
    return bias + (W - product) @ mean


def solve_damped(rhs: torch.Tensor, cov: torch.Tensor, damping: float, name: str = "least squares") -> torch.Tensor:
    """rhs (C + lambda I)^{-1} for a PSD C (Cholesky, float64); FactorizationError if it fails."""
    system = cov + damping * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    check_finite(name, rhs, system)
    try:
        chol = torch.linalg.cholesky(system)
    except RuntimeError as err:
        raise FactorizationError(f"{name}: the damped input covariance is not positive definite (lambda={damping:g}): {err}") from err
    return torch.cholesky_solve(rhs.T, chol).T


# ----------------------------------------------------------------------------------------------
# Identity-block factors
# ----------------------------------------------------------------------------------------------


@dataclass
class IdentityBlockFactors:
    """W ~ B' [I | A_rest] P^T: z = x[perm[:r]] + A_rest x[perm[r:]], y = B' z.

    B' (d_out, r), ``perm`` (d_in,) a permutation, A_rest (r, d_in - r). Parameters
    r (d_in + d_out) - r^2: the r x r identity is never stored.
    """

    B: torch.Tensor
    perm: torch.Tensor
    A_rest: torch.Tensor
    pivot_ratio: float  # min |R_kk| / max |R_kk| of the pivoted QR: how well-conditioned the block was

    @property
    def rank(self) -> int:
        return self.B.shape[1]

    def dense_A(self) -> torch.Tensor:
        """The (r, d_in) input factor with its identity block written out (for checks)."""
        r = self.rank
        A = torch.zeros(r, self.perm.numel(), dtype=self.B.dtype, device=self.B.device)
        A[:, self.perm[:r]] = torch.eye(r, dtype=self.B.dtype, device=self.B.device)
        A[:, self.perm[r:]] = self.A_rest
        return A

    def product(self) -> torch.Tensor:
        return self.B @ self.dense_A()


def pivoted_qr_columns(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column order of A (r, d) by QR with column pivoting (Businger-Golub greedy pivots).

    Computed as the pivoted Cholesky factorization of the Gram matrix A^T A, which picks the same
    columns in exact arithmetic (the residual column norms of QR are the residual diagonal of the
    Gram), at O(d r^2 / 2) work instead of modified Gram-Schmidt's O(d r^2) with r passes over A.
    The r sequential pivot steps run in float64 NumPy on the CPU, where a step costs microseconds
    rather than a handful of framework calls. Returns (perm (d,), |R_kk| (r,)) on A's device;
    ``pivoted_qr_columns_reference`` is the plain MGS version.
    """
    r, d = A.shape
    if r > d:
        raise FactorizationError(f"identity block needs rank <= input size, got rank {r} > {d}")
    gram = (A.T @ A).to(device="cpu", dtype=torch.float64).numpy()
    residual = gram.diagonal().copy()
    L = np.zeros((r, d))  # row k: the k-th Cholesky column
    perm = np.arange(d)
    diag = np.zeros(r)
    chosen = np.zeros(d, dtype=bool)
    for k in range(r):
        j = int(np.argmax(np.where(chosen, -np.inf, residual)))
        pivot = residual[j]
        if not pivot > 0:
            break
        diag[k] = math.sqrt(pivot)
        column = (gram[:, j] - L[:k, j] @ L[:k]) / diag[k]
        L[k] = column
        residual -= column * column
        chosen[j] = True
        perm[k] = j
    count = int(chosen.sum())
    order = np.concatenate([perm[:count], np.flatnonzero(~chosen)])
    return torch.from_numpy(order).to(A.device), torch.from_numpy(diag).to(device=A.device, dtype=A.dtype)


def pivoted_qr_columns_reference(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain QR with column pivoting by modified Gram-Schmidt (the reference the fast path is tested against)."""
    R = A.clone()
    r, d = R.shape
    perm = torch.arange(d, device=A.device)
    diag = torch.zeros(r, dtype=A.dtype, device=A.device)
    for k in range(r):
        norms = (R[:, k:] ** 2).sum(0)
        j = k + int(torch.argmax(norms))
        R[:, [k, j]] = R[:, [j, k]]
        perm[[k, j]] = perm[[j, k]]
        diag[k] = R[:, k].norm()
        if not bool(diag[k] > 0):
            break
        q = R[:, k] / diag[k]
        R[:, k + 1:] -= torch.outer(q, q @ R[:, k + 1:])
    return perm, diag


def identity_block(factors: Factors, name: str = "identity block") -> IdentityBlockFactors:
    """Rewrite B A as (B J)(J^{-1} A) with J = the r columns of A picked by pivoted QR."""
    B, A = factors.B, factors.A
    r = A.shape[0]
    check_finite(name, B, A)
    perm, diag = pivoted_qr_columns(A)
    scale = float(diag.abs().max())
    ratio = float(diag.abs().min()) / scale if scale > 0 else 0.0
    if not ratio > 1e-13:
        raise FactorizationError(f"{name}: input factor is rank deficient (pivoted QR ratio {ratio:.3g}); cannot form an identity block")
    J = A[:, perm[:r]]
    try:
        A_rest = torch.linalg.solve(J, A[:, perm[r:]])
    except RuntimeError as err:
        raise FactorizationError(f"{name}: singular pivot block ({err})") from err
    result = IdentityBlockFactors(B=B @ J, perm=perm, A_rest=A_rest, pivot_ratio=ratio)
    check_finite(name, result.B, result.A_rest)
    return result


# ----------------------------------------------------------------------------------------------
# Budget accounting
# ----------------------------------------------------------------------------------------------
