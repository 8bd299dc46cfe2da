"""RoPE channel pairs as complex numbers: the algebra behind the conversions' treatment of positions.

In slimkv's order, channels (2i, 2i+1) of a query or key head are RoPE pair i, read as the complex
number z_i = y_2i + 1j y_2i+1 and rotated by multiplying with exp(1j t w_i) at position t. The
score of pair i between a query at m and a key at n is Re(z_q conj(z_k) exp(1j (m - n) w_i)), so:

* any complex linear mix of several heads' pair i commutes with RoPE (all heads turn by the same
  phase): a mix can be undone exactly by the queries (``mix_pairs``);
* a pair that loses its rotation is best replaced, for a query head that attends at distances
  delta with probability p(delta), by the fixed factor rho = E[exp(1j delta w_i)]
  (``rotation_expectation``), which is linear and folds into that head's query.

Rows are maps of an input x' (any width d'), so a pair's complex row z = W_z x' stands for two real
rows of a weight (``to_complex`` / ``from_complex``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_complex(rows: torch.Tensor) -> torch.Tensor:
    """Real rows in pair order (..., 2P, d') -> complex rows (..., P, d'): row 2i + 1j row 2i+1."""
    return torch.complex(rows[..., 0::2, :], rows[..., 1::2, :])


def from_complex(rows: torch.Tensor) -> torch.Tensor:
    """Complex rows (..., P, d') -> real rows in pair order (..., 2P, d')."""
    return torch.stack((rows.real, rows.imag), dim=-2).flatten(-3, -2)


def pair_energy(rows: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """E|z|^2 of complex rows (..., P, d') under E[x' x'^T] = cov: (..., P) real."""
    return torch.einsum("...pd,de,...pe->...p", rows, cov.to(rows.dtype), rows.conj()).real


def rotation_expectation(distance: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """rho[h, i] = E[exp(1j delta w_i)] over the attention-distance histogram ``distance`` (H, T)
    of each query head (mass at relative distance delta = 0..T-1): (H, P) complex."""
    delta = torch.arange(distance.shape[1], dtype=torch.float64)
    p = distance / distance.sum(1, keepdim=True).clamp_min(1e-300)
    phase = torch.polar(torch.ones(len(delta), len(inv_freq), dtype=torch.float64), torch.outer(delta, inv_freq.double()))
    return p.to(phase.dtype) @ phase


@dataclass
class PairMix:
    """The mixed components of m heads' pair i, for every frequency i, strongest first.

    energy (P, m): the weighted score energy of each component (eigenvalue);
    keys (P, m, d'): component j of frequency i is the one complex key z = keys[i, j] x';
    recon (P, m, m): head g's pair is sum_j recon[i, g, j] z_j (exact with all m components), so
    a query head reading head g reads component j with its pair-i query times conj(recon[i, g, j])."""

    energy: torch.Tensor
    keys: torch.Tensor
    recon: torch.Tensor


def mix_pairs(keys: torch.Tensor, weight: torch.Tensor, cov: torch.Tensor) -> PairMix:
    """Per frequency, the weighted principal components of m heads' complex keys (RoRoPE, generalised).

    keys (m, P, d') complex rows; weight (m, P) >= 0: what an error in head g's pair costs (the query
    energy of the heads reading it). Per frequency, with D = diag(weight) and M = E[z z^H] (m x m),
    the eigenvectors u_j of D^1/2 M D^1/2 give the component keys u_j^H D^1/2 z and recon D^-1/2 u_j:
    keeping the top components minimises sum_g D_g E|z_g - reconstruction|^2, and the dropped
    eigenvalues are exactly that error."""
    moments = torch.einsum("gpd,de,hpe->pgh", keys, cov.to(keys.dtype), keys.conj())  # (P, m, m) E[z_g conj(z_h)]
    d = weight.T.clamp_min(0)  # (P, m)
    d = torch.maximum(d, 1e-12 * d.amax(1, keepdim=True).clamp_min(1e-300))
    root = d.sqrt().to(keys.dtype)
    scaled = root[:, :, None] * moments * root[:, None, :]
    energy, vectors = torch.linalg.eigh(0.5 * (scaled + scaled.conj().transpose(-1, -2)))
    energy, vectors = energy.flip(-1), vectors.flip(-1)  # strongest first
    component_keys = torch.einsum("pgj,pg,gpd->pjd", vectors.conj(), root, keys)
    return PairMix(energy, component_keys, vectors / root[:, :, None])
