"""Calibration statistics of a source model for conversion, from one pass of the ORIGINAL model
over calibration windows (float64):

* ``cov`` E[x x^T] (d, d) of each layer's attention input x (the RMS-normalised hidden state):
  every second moment of q, k, v follows from it, since they are linear in x (W C W^T);
* ``mean`` E[x] (d,): with it, the fits treat a biased projection W x + b as the linear map [W | b]
  of x' = [x; 1], whose second moment is ``augmented_cov`` [[C, mu], [mu^T, 1]];
* ``distance`` (H, T): per query head, the attention mass at each relative distance m - n
  (summed over queries and windows), for treatments of RoPE that average the rotation over the
  distances a head actually attends to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from slimkv.compress.linalg import StatsAccumulator
from slimkv.convert.source import Source


@dataclass
class LayerStats:
    """Calibration statistics of one layer (see the module docstring)."""

    cov: torch.Tensor
    mean: torch.Tensor
    distance: torch.Tensor
    tokens: int

    def augmented_cov(self) -> torch.Tensor:
        """E[x' x'^T] of x' = [x; 1]: [[C, mu], [mu^T, 1]], (d + 1, d + 1)."""
        d = self.cov.shape[0]
        out = self.cov.new_empty(d + 1, d + 1)
        out[:d, :d] = self.cov
        out[:d, d] = out[d, :d] = self.mean
        out[d, d] = 1.0
        return out


def _distance_mass(q: torch.Tensor, k: torch.Tensor, group: int, causal_bias: torch.Tensor, distance_index: torch.Tensor) -> torch.Tensor:
    """Attention mass per relative distance, per query head: q (H, T, d_h), k (G, T, d_h), both
    rotated -> (H, T), entry [h, delta] = sum over queries m of softmax(q_m k^T)[m - delta].
    ``causal_bias`` (T, T): 0 where query m sees key n, -inf elsewhere; ``distance_index`` (T T,):
    m - n of every entry, row-major, clamped at 0 (entries above the diagonal hold zero mass)."""
    heads, length, hd = q.shape
    scores = (q * hd**-0.5).view(-1, group * length, hd) @ k.transpose(-1, -2)  # (G, group T, T): a K/V head's readers together
    probs = scores.view(heads, length, length).add_(causal_bias).softmax(-1)  # (H, T m, T n)
    out = torch.zeros(heads, length, dtype=torch.float64)
    out.index_add_(1, distance_index, probs.reshape(heads, -1))
    return out


@torch.no_grad()
def feed_windows(model: nn.Module, windows: torch.Tensor, on_input: Callable[[int, torch.Tensor], None],
                 on_output: Callable[[int, torch.Tensor], None] | None = None, *, desc: str, progress: bool = True) -> None:
    """Run a transformers Llama-family ``model`` on each row of ``windows`` (n, T) token ids,
    handing every attention layer's input (1, T, d_model) to ``on_input(layer index, x)`` and, if
    given, its output to ``on_output(layer index, y)``; the hooks are removed afterwards, whatever happens."""
    def hooks(index: int):
        def pre(_module, args, kwargs):
            on_input(index, kwargs.get("hidden_states", args[0] if args else None))

        def post(_module, _args, _kwargs, output):
            on_output(index, output[0] if isinstance(output, tuple) else output)
        return pre, post

    handles = []
    for i, layer in enumerate(model.model.layers):
        pre, post = hooks(i)
        handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
        if on_output is not None:
            handles.append(layer.self_attn.register_forward_hook(post, with_kwargs=True))
    try:
        for row in tqdm(windows, desc=desc, unit="window", disable=not progress):
            model(row[None].to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def layer_statistics(source: Source, windows: torch.Tensor, *, distances: bool = True, progress: bool = True) -> list[LayerStats]:
    """Statistics of every layer from the original model on ``windows`` (n, T) of token ids."""
    shape, model = source.shape, source.model
    accumulators = [StatsAccumulator(shape.d_model, "cpu", mean_abs=False) for _ in range(shape.n_layers)]
    mass = [torch.zeros(shape.n_heads, windows.shape[1], dtype=torch.float64) for _ in range(shape.n_layers)]
    inv_freq = source.rotary_inv_freq()
    length = windows.shape[1]
    causal_bias = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    distance_index = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).clamp_min(0).flatten()

    def rotate(x: torch.Tensor) -> torch.Tensor:  # (heads, T, d_h) in slimkv's adjacent-pair order
        pos = torch.arange(x.shape[1], dtype=torch.float64)
        turn = torch.polar(torch.ones(len(pos), len(inv_freq), dtype=torch.float64), torch.outer(pos, inv_freq))
        return torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous()) * turn).flatten(-2)

    def grab(index: int, x: torch.Tensor) -> None:
        accumulators[index].add(x)
        if distances:
            w = source.attention(index)
            for row in x.double():
                q = torch.einsum("hcd,td->htc", w.q, row) + (w.q_bias[:, None] if w.q_bias is not None else 0)
                k = torch.einsum("gcd,td->gtc", w.k, row) + (w.k_bias[:, None] if w.k_bias is not None else 0)
                mass[index] += _distance_mass(rotate(q), rotate(k), shape.group, causal_bias, distance_index)

    feed_windows(model, windows, grab, desc="calibration", progress=progress)
    stats = []
    for index, acc in enumerate(accumulators):
        finished = acc.finish(f"layer {index} attention input")
        stats.append(LayerStats(finished.cov, finished.mean, mass[index], finished.count))
    return stats
