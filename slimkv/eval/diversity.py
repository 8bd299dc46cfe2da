"""Head diversity: the effective rank of the heads' bilinear query-key operators.

For query head h of a layer, A_h = W^Q_h (W^K_h)^T (d_model x d_model) is the map whose
x_i A_h x_j^T is the unscaled attention logit (before RoPE, biases and the per-token rms scale of
qk-norm; see ``Attention.head_qk_maps``). The operators are never formed: their Frobenius inner
products come from d_qk x d_qk products,

    <A_i, A_j> = tr((W^K_i^T W^K_j)(W^Q_j^T W^Q_i)).

Normalising gives the cosine Gram G; centring across heads, G_c = J G J with J = I - 11^T/H,
removes the mean operator. With eigenvalue proportions p of G_c, r_eff = exp(-sum p ln p).
Centring removes one dimension: H mutually orthogonal operators give exactly H - 1, the ceiling
(H-1)/H of r_eff/H; identical heads give 0 (G_c = 0; defined as 0). The uncentred value, from G,
lies in [1, H].

``slimkv analyze diversity RUN_DIR`` prints a table per layer (``format_table``) and writes ``diversity.json``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slimkv.attention import Attention

# Eigenvalues of G or G_c below this fraction of H count as zero (round-off of a rank-deficient Gram).
EIGEN_TOLERANCE = 1e-10


def operator_gram(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """Frobenius Gram (H, H) of the operators A_h = W^Q_h W^K_h^T, from wq, wk (H, d, d_qk),
    in float64 without forming any d x d operator."""
    wq, wk = wq.detach().double(), wk.detach().double()
    rows = []
    for i in range(wq.shape[0]):  # one row at a time keeps memory at H d_qk^2
        kk = torch.einsum("da,jdb->jab", wk[i], wk)  # W^K_i^T W^K_j
        qq = torch.einsum("jdb,da->jba", wq, wq[i])  # W^Q_j^T W^Q_i
        rows.append(torch.einsum("jab,jba->j", kk, qq))
    return torch.stack(rows)


def cosine_gram(gram: torch.Tensor) -> torch.Tensor:
    """G[i, j] = <A_i, A_j> / (|A_i| |A_j|); ValueError if some operator is zero."""
    norms = gram.diagonal().clamp_min(0).sqrt()
    if bool((norms == 0).any()):
        zero = (norms == 0).nonzero().flatten().tolist()
        raise ValueError(f"heads {zero} have a zero query-key operator; their direction is undefined")
    return gram / norms[:, None] / norms[None, :]


def effective_rank(gram: torch.Tensor) -> float:
    """exp(entropy) of the eigenvalue proportions of a symmetric PSD matrix; 0 if it is zero."""
    eig = torch.linalg.eigvalsh(gram.double())
    eig = torch.where(eig > EIGEN_TOLERANCE * gram.shape[0], eig, torch.zeros_like(eig))
    total = eig.sum()
    if total <= 0:
        return 0.0
    p = eig[eig > 0] / total
    return math.exp(-float((p * p.log()).sum()))


def centred(gram: torch.Tensor) -> torch.Tensor:
    """J G J with J = I - 11^T / H."""
    h = gram.shape[0]
    j = torch.eye(h, dtype=gram.dtype) - torch.full((h, h), 1.0 / h, dtype=gram.dtype)
    return j @ gram @ j


def head_diversity(wq: torch.Tensor, wk: torch.Tensor) -> dict[str, float]:
    """The metric for one layer from its per-head maps (H, d, d_qk)."""
    heads = wq.shape[0]
    g = cosine_gram(operator_gram(wq, wk))
    r_eff = effective_rank(centred(g))
    uncentred = effective_rank(g)
    return {
        "heads": heads,
        "r_eff": r_eff,
        "r_eff_over_heads": r_eff / heads,
        "ceiling": (heads - 1) / heads,
        "r_eff_uncentred": uncentred,
        "r_eff_uncentred_over_heads": uncentred / heads,
    }


@torch.no_grad()
def layer_diversity(attn: Attention) -> dict[str, Any]:
    """The metric for one attention layer, from its ``head_qk_maps``."""
    wq, wk = attn.head_qk_maps()
    return {"kind": attn.kind, **head_diversity(wq, wk)}


def model_diversity(model) -> list[dict[str, Any]]:
    """One row per layer of a ``SlimKVForCausalLM`` (layers whose kind exposes no per-head maps
    get a row with ``error``)."""
    rows = []
    for i, attn in enumerate(model.attention_layers):
        try:
            rows.append({"layer": i, **layer_diversity(attn)})
        except NotImplementedError as err:
            rows.append({"layer": i, "kind": attn.kind, "error": str(err)})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Human table: one line per layer and the mean."""
    header = f"{'layer':>5}  {'kind':<6} {'H':>3}  {'r_eff':>7}  {'r_eff/H':>7}  {'ceiling':>7}  {'uncentred':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layer']:>5}  {r['kind']:<6} {'':>3}  n/a ({r['error']})")
            continue
        lines.append(
            f"{r['layer']:>5}  {r['kind']:<6} {r['heads']:>3}  {r['r_eff']:>7.3f}  {r['r_eff_over_heads']:>7.1%}  "
            f"{r['ceiling']:>7.1%}  {r['r_eff_uncentred']:>9.3f}"
        )
    done = [r for r in rows if "error" not in r]
    if done:
        mean = sum(r["r_eff_over_heads"] for r in done) / len(done)
        lines.append(f"mean r_eff/H over {len(done)} layers: {mean:.1%}")
    return "\n".join(lines)
