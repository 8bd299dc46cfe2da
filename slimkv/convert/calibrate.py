"""Calibration statistics of a source model for conversion, from one pass of the ORIGINAL model
over calibration windows (float64):

* ``cov`` E[x x^T] (d, d) of each layer's attention input x (the RMS-normalised hidden state):
  every second moment of q, k, v follows from it, since they are linear in x (W C W^T).
* ``distance`` (H, T): per query head, the attention mass at each relative distance m - n
  (summed over queries and windows), for treatments of RoPE that average the rotation over the
  distances a head actually attends to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from slimkv.compress.linalg import StatsAccumulator
from slimkv.convert.source import Source


@dataclass
class LayerStats:
    """Calibration statistics of one layer (see the module docstring)."""

    cov: torch.Tensor
    distance: torch.Tensor
    tokens: int


def _distance_mass(q: torch.Tensor, k: torch.Tensor, group: int) -> torch.Tensor:
    """Attention mass per relative distance, per query head: q (H, T, d_h), k (G, T, d_h), both
    rotated -> (H, T), entry [h, delta] = sum over queries m of softmax(q_m k^T)[m - delta]."""
    heads, length, hd = q.shape
    scores = (q @ k.repeat_interleave(group, 0).transpose(-1, -2)) / hd**0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (H, T m, T n)
    delta = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).clamp_min(0)  # (m, n) -> m - n
    out = torch.zeros(heads, length, dtype=torch.float64)
    out.index_add_(1, delta.flatten(), probs.reshape(heads, -1).double().where(causal.flatten(), torch.zeros((), dtype=torch.float64)))
    return out


@torch.no_grad()
def layer_statistics(source: Source, windows: torch.Tensor, *, distances: bool = True, progress: bool = True) -> list[LayerStats]:
    """Statistics of every layer from the original model on ``windows`` (n, T) of token ids."""
    shape, model = source.shape, source.model
    accumulators = [StatsAccumulator(shape.d_model, "cpu", mean_abs=False) for _ in range(shape.n_layers)]
    mass = [torch.zeros(shape.n_heads, windows.shape[1], dtype=torch.float64) for _ in range(shape.n_layers)]
    inv_freq = source.rotary_inv_freq()

    def rotate(x: torch.Tensor) -> torch.Tensor:  # (heads, T, d_h) in slimkv's adjacent-pair order
        pos = torch.arange(x.shape[1], dtype=torch.float64)
        turn = torch.polar(torch.ones(len(pos), len(inv_freq), dtype=torch.float64), torch.outer(pos, inv_freq))
        return torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous()) * turn).flatten(-2)

    def hook(index: int):
        def grab(_module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            accumulators[index].add(x)
            if distances:
                w = source.attention(index)
                for row in x.double():
                    q = torch.einsum("hcd,td->htc", w.q, row) + (w.q_bias[:, None] if w.q_bias is not None else 0)
                    k = torch.einsum("gcd,td->gtc", w.k, row) + (w.k_bias[:, None] if w.k_bias is not None else 0)
                    mass[index] += _distance_mass(rotate(q), rotate(k), shape.group)
        return grab

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        for row in tqdm(windows, desc="calibration", unit="window", disable=not progress):
            model(row[None].to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    stats = []
    for index, acc in enumerate(accumulators):
        finished = acc.finish(f"layer {index} attention input")
        stats.append(LayerStats(finished.cov, mass[index], finished.count))
    return stats
