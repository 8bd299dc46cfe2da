"""What a conversion method fits from and what it returns: ``LayerContext`` (one source attention
layer in slimkv's conventions with its calibration statistics) and ``LayerFit`` (the converted
layer's state dict, the parameters it changed, the options it decided, facts for the manifest).

Biases: every fit treats a projection W x + b as the linear map [W | b] of x' = [x; 1]
(``LayerContext.affine``), whose second moment is [[C, mu], [mu^T, 1]]. A fit is then the same
with or without biases, and the last column of each fitted map is the bias of the slimkv
projection that computes it (``linear_state``). For a model without biases that column is zero by
construction (every fitted row is a combination of the source's rows) and is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from slimkv.convert.calibrate import LayerStats
from slimkv.convert.source import LayerWeights, Shape


@dataclass(frozen=True)
class AffineLayer:
    """A source attention layer as linear maps of x' = [x; 1] (float64, slimkv's RoPE pair order).

    q: (H, d_h, d + 1), k and v: (G, d_h, d + 1) with the biases as last column; o: (d, H d_h);
    cov: E[x' x'^T] (d + 1, d + 1); mean: E[x'] (d + 1,)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    cov: torch.Tensor
    mean: torch.Tensor

    def output_block(self, head: int) -> torch.Tensor:
        """W_o,h: the (d, d_h) columns of o that read query head ``head``'s value."""
        hd = self.q.shape[1]
        return self.o[:, head * hd:(head + 1) * hd]

    def centered_moment(self, rows: torch.Tensor) -> torch.Tensor:
        """The covariance of the outputs of ``rows`` (n, d + 1): W C' W^T - (W mu')(W mu')^T."""
        projected = rows @ self.mean
        return rows @ self.cov @ rows.T - torch.outer(projected, projected)


@dataclass
class LayerContext:
    """One source attention layer: its weights (float64, slimkv conventions), statistics, shape."""

    index: int
    shape: Shape
    weights: LayerWeights
    stats: LayerStats
    inv_freq: torch.Tensor  # (head_dim / 2,) RoPE frequency of each adjacent pair
    # per probed plan, the KL (nats/token) of the model with this layer alone converted as that plan
    # says (``slimkv.convert.sensitivity``); measured only for a method whose settings ask for it
    sensitivity: list[float] | None = None
    # per role score (``slimkv.convert.roles.SCORES``), one value per KV head of this layer; measured
    # only for a method that reads roles (``Conversion.measure``)
    roles: dict[str, list[float]] | None = None

    def affine(self) -> AffineLayer:
        """The layer's projections as maps of x' = [x; 1] with their moments (module docstring);
        built on each call, so only the layer being fitted holds them."""
        w = self.weights

        def with_bias(rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            last = bias[..., None] if bias is not None else rows.new_zeros(*rows.shape[:-1], 1)
            return torch.cat((rows, last), dim=-1)

        mean = torch.cat((self.stats.mean, self.stats.mean.new_ones(1)))
        return AffineLayer(with_bias(w.q, w.q_bias), with_bias(w.k, w.k_bias), with_bias(w.v, w.v_bias), w.o, self.stats.augmented_cov(), mean)

    @property
    def head_group(self) -> torch.Tensor:
        """The K/V head each query head reads: (H,) long."""
        return torch.arange(self.shape.n_heads) // self.shape.group


@dataclass
class LayerFit:
    """A converted layer: its attention state dict, the parameter names the conversion changed
    (what healing trains by default), the layer's options when the fit decides some of them
    (``None``: the plan's) and facts for the manifest."""

    state: dict[str, torch.Tensor]
    changed: list[str]
    info: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] | None = None


def linear_state(name: str, rows: torch.Tensor, bias: bool) -> dict[str, torch.Tensor]:
    """State entries of ``nn.Linear`` ``name`` computing the affine map ``rows`` (out, d + 1) of
    x' = [x; 1]: the weight, and the last column as bias when the layer has one. Without a bias
    that column must be zero (RuntimeError otherwise: the fit would be silently changed)."""
    weight, last = rows[:, :-1], rows[:, -1]
    if bias:
        return {f"{name}.weight": weight, f"{name}.bias": last}
    if last.abs().max() > 1e-9 * rows.abs().max().clamp_min(1e-300):
        raise RuntimeError(f"{name}: the fitted map has a constant term but the converted layer has no bias")
    return {f"{name}.weight": weight}


def output_state(o: torch.Tensor, bias: bool) -> dict[str, torch.Tensor]:
    """State entries of an ``o_proj`` with weight ``o`` (the source has no output bias: zero)."""
    state = {"o_proj.weight": o}
    if bias:
        state["o_proj.bias"] = o.new_zeros(o.shape[0])
    return state


def measured_sensitivities(layers: list[LayerContext], option: str) -> list[list[float]]:
    """Every layer's measured KLs (one per probed plan), or RuntimeError naming the method option
    that needs them (``--to NAME:KEY=VALUE``) when the pipeline's probe did not run."""
    if any(layer.sensitivity is None for layer in layers):
        raise RuntimeError(f"{option} needs every layer's measured sensitivity (the pipeline's probe did not run)")
    return [layer.sensitivity for layer in layers]


def least_sensitive(layers: list[LayerContext], candidates: list[Any], option: str) -> list[Any]:
    """Per layer, the candidate whose probe plan (one per candidate, in order) moved the model
    least with that layer alone converted (``measured_sensitivities``)."""
    return [candidates[min(range(len(candidates)), key=kl.__getitem__)] for kl in measured_sensitivities(layers, option)]


def partial_rope_options(shape: Shape, pairs: int) -> dict[str, Any]:
    """The common RoPE options of a converted layer that rotates ``pairs`` leading pairs per head
    (their frequencies, chosen by the fit, go in ``rope_frequencies``)."""
    return {"rope": "partial", "rope_fraction": 2 * pairs / shape.head_dim}


def layer_budget(shape: Shape, ratio: float) -> int:
    """Cache elements per token each layer keeps when every layer gets the same size: floor(ratio x original)."""
    return int(math.floor(ratio * shape.cache_elements + 1e-9))
