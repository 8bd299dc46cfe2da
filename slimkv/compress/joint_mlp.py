"""Joint MLP compression: the two sides of the MLP factored with each other in view.

Gated SiLU MLPs (Llama/Mistral/Qwen2: y = W_d (act(W_g x) * W_u x)) - slimkv's design:

1. Gate and up read the same x, so they share one input factor A (rank r, from the combined
   gate+up budget): W_g ~ B_g A, W_u ~ B_u A, found as RootCov of the row-weighted stack
   [D_g W_g; D_u W_u] under C = E[x x^T]. The row weights are the first-order sensitivity of the
   block output to each pre-activation: h = act(g) * u moves by act'(g) u dg + act(g) du, and
   channel j reaches the output through column j of W_d, so
       D_g[j]^2 = E[(act'(g_j) u_j)^2] ||W_d[:, j]||^2,   D_u[j]^2 = E[act(g_j)^2] ||W_d[:, j]||^2.
   The weighted problem is solved exactly (B = D^{-1} U_r, A = U_r^T D W).
2. Down is then factored by RootCov under the covariance of its actual input
   h_hat = act(B_g A x) * (B_u A x), i.e. calibrated after gate/up are compressed.
   (A refit of down towards the original output W_d h from h_hat was tried and lowered the
   held-out quality at thousands of calibration tokens - a 1536-wide regression overfits - so it
   is not used.)
Plain non-ReLU MLPs (GPT-2's GELU) use the same two steps with the single input projection
weighted by D_u[j]^2 = E[act'(z_j)^2] ||W_d[:, j]||^2.

ReLU MLPs (OPT: y = W_d relu(W_u x)) - the paper's auxiliary-variable form:
    L = alpha ||W_u X - Z||^2 + beta ||Z' - relu(Z)||^2 + gamma ||W_d Z' - Y||^2
alternating rank-constrained refits of Z X^+ and Y Z'^+ (RootCov of the least-squares map under
its input covariance), the closed form Z' = (gamma W_d^T W_d + beta I)^{-1}(beta relu(Z) + gamma W_d^T Y)
and the elementwise ReLU update of Z (the better of the z >= 0 and z <= 0 branch optima).
The paper gives no penalty weights; slimkv uses alpha = beta = gamma = 1 on mean-per-token
squared errors (all three terms are in the same activation units). Each step minimizes L over
its block, so L is non-increasing up to the damping of the least-squares maps (tested). The
compressed MLP is W_d^ relu(W_u^ x + b_u) with the last iteration's factors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from slimkv.compress.linalg import FactorizationError, Factors, check_finite, damping_for, rootcov_factors, solve_damped

# Default relative damping of the least-squares maps inside the ReLU alternation (small, so each
# block step stays an almost exact minimizer and the objective stays monotone).
UD_DAMPING = 1e-6


def activation_derivative(act: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(z), act'(z)) for an elementwise activation module, via autograd."""
    with torch.enable_grad():
        leaf = z.detach().requires_grad_(True)
        value = act(leaf)
        (grad,) = torch.autograd.grad(value.sum(), leaf)
    return value.detach(), grad


class SensitivityAccumulator:
    """Per-channel E[(act'(g) u)^2] and E[act(g)^2] (gated) or E[act'(z)^2] (plain), float64."""

    def __init__(self, width: int, gated: bool, device: torch.device | str = "cpu"):
        self.gated = gated
        self.gate_sq = torch.zeros(width, dtype=torch.float64, device=device)
        self.up_sq = torch.zeros(width, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, act: nn.Module, first: torch.Tensor, up: torch.Tensor | None = None) -> None:
        """``first`` = gate pre-activation (gated) or the single pre-activation (plain), (..., width)."""
        value, grad = activation_derivative(act, first)
        grad, value = grad.reshape(-1, grad.shape[-1]).double(), value.reshape(-1, value.shape[-1]).double()
        if self.gated:
            up = up.double().reshape(-1, up.shape[-1])
            self.gate_sq += ((grad * up) ** 2).sum(0)
            self.up_sq += (value**2).sum(0)
        else:
            self.up_sq += (grad**2).sum(0)
        self.count += value.shape[0]

    def row_weights(self, W_down: torch.Tensor) -> list[torch.Tensor]:
        """[D_g, D_u] (gated) or [D_u] (plain), each including ||W_d[:, j]||."""
        column = (W_down**2).sum(0)
        parts = [self.gate_sq, self.up_sq] if self.gated else [self.up_sq]
        weights = [(part / max(self.count, 1) * column).sqrt() for part in parts]
        floor = 1e-6 * max(float(w.max()) for w in weights)
        if not floor > 0:
            raise FactorizationError("joint MLP: every channel has zero sensitivity (dead MLP)")
        return [w.clamp_min(floor) for w in weights]


def weighted_shared_factors(weights: list[torch.Tensor], row_weights: list[torch.Tensor], cov: torch.Tensor, rank: int) -> tuple[Factors, list[int]]:
    """One input factor A for several projections reading the same input.

    Minimizes sum_i ||D_i (W_i - B_i A) C^{1/2}||^2: RootCov of the stacked, row-weighted
    matrix, rows unweighted afterwards. Returns stacked factors (B = [B_1; B_2; ...]) and the
    row counts of each part.
    """
    stacked = torch.cat([w[:, None] * W for W, w in zip(weights, row_weights)])
    factors = rootcov_factors(stacked, cov, rank, name="joint MLP (shared input factor)")
    scale = torch.cat(row_weights)
    return Factors(B=factors.B / scale[:, None], A=factors.A), [W.shape[0] for W in weights]


@dataclass
class ReluUDResult:
    up: Factors
    down: Factors
    objective: list[float] = field(default_factory=list)  # L after each iteration (per token)
    damping: list[float] = field(default_factory=list)  # absolute lambda of each least-squares map


def _least_squares_map(inputs: torch.Tensor, targets: torch.Tensor, rank: int, eps: float, name: str) -> tuple[Factors, float]:
    """Rank-``rank`` M minimizing ||inputs M^T - targets||^2 (rows are tokens): RootCov of the
    (damped) least-squares map under the input covariance. Returns the factors and lambda."""
    count = inputs.shape[0]
    cov = inputs.T @ inputs / count
    cross = targets.T @ inputs / count  # E[t x^T]
    lam = damping_for(cov, eps)
    return rootcov_factors(solve_damped(cross, cov, lam, name), cov, rank, name=name), lam


def relu_ud(X: torch.Tensor, W_u: torch.Tensor, b_u: torch.Tensor | None, W_d: torch.Tensor, rank_up: int, rank_down: int,
            iterations: int = 4, damping: float = UD_DAMPING, alpha: float = 1.0, beta: float = 1.0, gamma: float = 1.0) -> ReluUDResult:
    """The paper's joint U/D alternation for y = W_d relu(W_u x + b_u) on calibration inputs X (N, d).

    Returns the compressed up/down factors, the objective history and the damping used
    (``damping`` is relative to mean(diag) of each least-squares map's input covariance).
    """
    check_finite("joint MLP (ReLU)", X, W_u, W_d)
    count = X.shape[0]
    bias = torch.zeros(W_u.shape[0], dtype=X.dtype, device=X.device) if b_u is None else b_u
    Z = X @ W_u.T + bias
    Y = torch.relu(Z) @ W_d.T
    Zp = torch.relu(Z)

    def objective(up: Factors, down: Factors) -> float:
        pre = X @ up.A.T @ up.B.T + bias
        return float(alpha * ((pre - Z) ** 2).sum() + beta * ((Zp - torch.relu(Z)) ** 2).sum() + gamma * ((Zp @ down.A.T @ down.B.T - Y) ** 2).sum()) / count

    history: list[float] = []
    lambdas: list[float] = []
    up = down = None
    for _ in range(iterations):
        up, lam_up = _least_squares_map(X, Z - bias, rank_up, damping, "joint MLP (ReLU up fit)")
        down, lam_down = _least_squares_map(Zp, Y, rank_down, damping, "joint MLP (ReLU down fit)")
        lambdas += [lam_up, lam_down]
        Wd_hat = down.product()
        system = gamma * Wd_hat.T @ Wd_hat + beta * torch.eye(Wd_hat.shape[1], dtype=X.dtype, device=X.device)
        Zp = torch.linalg.solve(system, (beta * torch.relu(Z) + gamma * Y @ Wd_hat).T).T
        pre = X @ up.A.T @ up.B.T + bias
        z_pos = ((alpha * pre + beta * Zp) / (alpha + beta)).clamp_min(0)
        z_neg = pre.clamp_max(0)
        cost_pos = alpha * (z_pos - pre) ** 2 + beta * (Zp - z_pos) ** 2
        cost_neg = alpha * (z_neg - pre) ** 2 + beta * Zp**2
        Z = torch.where(cost_pos <= cost_neg, z_pos, z_neg)
        history.append(objective(up, down))
        check_finite("joint MLP (ReLU alternation)", Z, Zp)
    return ReluUDResult(up=up, down=down, objective=history, damping=lambdas)
