"""Joint QK compression: a Tucker approximation of every head's attention-score matrix.

For head i (d_h rows of W_q) and its KV group g(i) (GQA pairs query head i with the key head of its
group), the scores on calibration tokens X are X^T W_q,i^T W_k,g(i) X, and
||X^T M X||_F^2 = ||C^{1/2} M C^{1/2}||_F^2, so the objective is

    L = sum_i ||G_i - Q^T (Q G_i K^T) K||_F^2,   G_i = F_q,i^T F_k,g(i),   F = W C^{1/2},

over row-orthonormal Q (r_q, d) and K (r_k, d). Alternating eigen-updates (the dimensionally
consistent form; the paper's Algorithm 1 transposes the Q update):

    K <- top-r_k eigenvectors of sum_i G_i^T Q^T Q G_i
    Q <- top-r_q eigenvectors of sum_i G_i K^T K G_i^T

starting from the marginal Gram (K = I). L never increases; we check it after every update.

No d x d G_i is ever formed, and no C^{1/2} either: the optimal Q lies in the row space of
F_q = W_q C^{1/2} = L_q S_q U_q^T, and W_q C W_q^T = L_q S_q^2 L_q^T gives that space's
coordinates f_q = L_q S_q (h d_h, p_q) directly (p_q = numerical rank). In those coordinates
G_i = U_q f_q,i^T f_k,g U_k^T, Q = Q~ U_q^T, and every sum is built from d_h x d_h products.
Mapping back keeps each head's basis: A_q = Q C^{-1/2} = Q~ S_q^{-1} L_q^T W_q (shared by all
heads; S_q^{-1} only over the kept, non-negligible singular values) and B_q,i = f_q,i Q~^T, so
q_i = B_q,i A_q x and RoPE, the GQA head map and the stock attention code still apply.

RoPE. With rotary embeddings the score between a query at t and a key at s is
q_t^T R_{s-t} k_s, so the rotation-blind objective above is not what attention sees (the paper
validates RoPE only on a 10-token proxy). ``RopeAverage`` makes the objective RoPE-aware in the
paper's independent-token approximation: sum over causal offsets m = t - s of
(count of such pairs) ||C^{1/2} W_q,i^T R_{-m} W_k,g C^{1/2}||_F^2. Because R_m rotates each
frequency plane by m theta_k, the offset average of R M R^T is an elementwise (Hadamard) map of
M's four d_h/2 blocks with precomputed sums of cos/sin products, so the ALS stays as cheap as the
rotation-blind one: every d_h x d_h inner matrix is replaced by its rotation average. Without
``rope`` (GPT-2, OPT) the objective is the rotation-blind one. ``benchmarks/compress_sweep.py``
measures both forms (attention-score error with and without RoPE, and perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slimkv.compress.linalg import FactorizationError, Factors, check_finite, top_eigh

# Eigen-directions of W C W^T below this fraction of the largest are treated as exactly zero.
RANK_RTOL = 1e-12
# Allowed objective increase per update, relative to sum_i ||G_i||^2 (float64 round-off).
MONOTONE_RTOL = 1e-9


@dataclass
class JointQKResult:
    q: Factors
    k: Factors
    objective: list[float] = field(default_factory=list)  # L after each update (relative to sum ||G_i||^2)
    numerical_ranks: tuple[int, int] = (0, 0)


class RopeAverage:
    """The offset average M -> sum_m w_m R_m M R_m^T for rotate-half RoPE (transformers' Llama layout:
    dimension k pairs with k + d_h/2 at frequency inv_freq[k]), offsets m = -(0..seq_len-1) weighted
    by the number of causal (query, key) pairs at that distance, w_m proportional to seq_len - |m|.

    ``average(M)`` gives sum_m w_m R_m M R_m^T and ``average(M, transpose=True)`` the same with R_m^T;
    both act on (..., d_h, d_h) and cost O(d_h^2).
    """

    def __init__(self, inv_freq: torch.Tensor, seq_len: int):
        distance = torch.arange(seq_len, dtype=torch.float64)
        weights = (seq_len - distance) / (seq_len - distance).sum()
        angles = -distance[:, None] * inv_freq.to(torch.float64)[None, :]  # (offsets, d_h/2): R_{-m}
        cos, sin = angles.cos(), angles.sin()
        weighted_cos, weighted_sin = weights[:, None] * cos, weights[:, None] * sin
        self.cc = weighted_cos.T @ cos  # sum_m w c_k c_l
        self.cs = weighted_cos.T @ sin  # sum_m w c_k s_l
        self.sc = weighted_sin.T @ cos
        self.ss = weighted_sin.T @ sin
        self.half = inv_freq.numel()

    def average(self, M: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """sum_m w_m R M R^T (or R^T M R: the sines change sign) for R = [[C, -S], [S, C]]."""
        h = self.half
        A, B, Cm, D = M[..., :h, :h], M[..., :h, h:], M[..., h:, :h], M[..., h:, h:]
        cc, ss = self.cc, self.ss
        cs, sc = (-self.cs, -self.sc) if transpose else (self.cs, self.sc)
        top_left = A * cc - Cm * sc - B * cs + D * ss
        top_right = A * cs - Cm * ss + B * cc - D * sc
        bottom_left = A * sc + Cm * cc - B * ss - D * cs
        bottom_right = A * ss + Cm * cs + B * sc + D * cc
        return torch.cat([torch.cat([top_left, top_right], -1), torch.cat([bottom_left, bottom_right], -1)], -2)


def _coordinates(W: torch.Tensor, cov: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(f = L S (d_out, p), L (d_out, p), S (p,)) from W C W^T = L S^2 L^T, tiny directions dropped."""
    gram = W @ cov @ W.T
    values, vectors = top_eigh(gram, gram.shape[0], f"joint QK {name}")
    keep = values > RANK_RTOL * float(values[0].clamp_min(0)) if values.numel() else values > 0
    if not bool(keep.any()):
        raise FactorizationError(f"joint QK: W_{name} C W_{name}^T is zero (no signal reaches this projection)")
    singular = values[keep].sqrt()
    basis = vectors[:, keep]
    return basis * singular, basis, singular


def _head_blocks(f: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads, d_h, p) view of coordinates whose rows are grouped by head."""
    return f.reshape(heads, f.shape[0] // heads, f.shape[1])


def joint_qk(W_q: torch.Tensor, W_k: torch.Tensor, cov: torch.Tensor, num_heads: int, num_kv_heads: int,
             rank_q: int, rank_k: int, iterations: int = 8, tol: float = 1e-7, rope: RopeAverage | None = None) -> JointQKResult:
    """Tucker-factor W_q (h d_h, d) and W_k (g d_h, d) to ranks (rank_q, rank_k) under input covariance C.

    Returns factors with q = B_q A_q x (B_q rows grouped by head) and likewise for k, and the
    objective history. Stops after ``iterations`` (Q, K) sweeps, or earlier once a sweep lowers
    the relative objective by less than ``tol``. With ``rope`` the objective is RoPE-aware. Raises FactorizationError on NaN or an objective increase.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_finite("joint QK", W_q, W_k, cov)
    fq, Lq, Sq = _coordinates(W_q, cov, "q")
    fk, Lk, Sk = _coordinates(W_k, cov, "k")
    rank_q, rank_k = min(rank_q, fq.shape[1]), min(rank_k, fk.shape[1])
    fq_heads = _head_blocks(fq, num_heads)  # (h, d_h, p_q)
    fk_heads = _head_blocks(fk, num_kv_heads).repeat_interleave(num_heads // num_kv_heads, dim=0)  # (h, d_h, p_k): group of each head
    # Every quantity below is built from d_h x d_h "inner" matrices: P_i = f_q,i Q~^T Q~ f_q,i^T and
    # N_i = f_k,g K~^T K~ f_k,g^T; the objective's kept part is sum_i tr(P_i N_i) (rotation-averaged
    # as avg(N_i) = sum_m w_m R_m N_i R_m^T with RoPE), and ||G_i||^2 is the same with Q~ = K~ = I.
    key_side = (lambda N: N) if rope is None else rope.average
    query_side = (lambda P: P) if rope is None else (lambda P: rope.average(P, transpose=True))

    def projected(f: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        g = f if basis is None else f @ basis.T
        return g @ g.transpose(1, 2)

    gram_q, gram_k = projected(fq_heads, None), projected(fk_heads, None)
    total = float((gram_q * key_side(gram_k)).sum())
    if not total > 0:
        raise FactorizationError("joint QK: all score matrices are zero")

    def loss(Qt: torch.Tensor, Kt: torch.Tensor) -> float:
        return (total - float((projected(fq_heads, Qt) * key_side(projected(fk_heads, Kt))).sum())) / total

    def update_q(Kt: torch.Tensor | None) -> torch.Tensor:
        # sum_i f_q,i^T avg(N_i) f_q,i ; K~ = I gives the marginal Gram
        inner = key_side(gram_k if Kt is None else projected(fk_heads, Kt))
        return top_eigh((fq_heads.transpose(1, 2) @ inner @ fq_heads).sum(0), rank_q, "joint QK (Q update)")[1].T

    def update_k(Qt: torch.Tensor) -> torch.Tensor:
        inner = query_side(projected(fq_heads, Qt))
        return top_eigh((fk_heads.transpose(1, 2) @ inner @ fk_heads).sum(0), rank_k, "joint QK (K update)")[1].T

    Qt = update_q(None)
    Kt = update_k(Qt)
    history = [loss(Qt, Kt)]
    for _ in range(iterations):
        for which in ("q", "k"):
            if which == "q":
                Qt = update_q(Kt)
            else:
                Kt = update_k(Qt)
            history.append(loss(Qt, Kt))
            if history[-1] > history[-2] + MONOTONE_RTOL:
                raise FactorizationError(f"joint QK: objective increased from {history[-2]:.6g} to {history[-1]:.6g} in the {which} update")
        if history[-3] - history[-1] < tol:
            break
    # Map back to weights: A = Q~ S^{-1} L^T W (shared), B = f Q~^T (per head rows).
    q = Factors(B=fq @ Qt.T, A=(Qt / Sq) @ Lq.T @ W_q)
    k = Factors(B=fk @ Kt.T, A=(Kt / Sk) @ Lk.T @ W_k)
    check_finite("joint QK result", q.B, q.A, k.B, k.A)
    return JointQKResult(q=q, k=k, objective=history, numerical_ranks=(fq.shape[1], fk.shape[1]))
