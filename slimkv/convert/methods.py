"""Conversion methods in a registry: a method turns each attention layer of a source model into
one of slimkv's compact kinds. A method is three functions and a registration:

* ``min_ratio(shape)``: the smallest cache ratio it can represent (checked before any work);
* ``plan(layers, ratio)``: per-layer options whose total cache meets the ratio (how sizes are
  allocated across layers is the method's choice, recorded in the manifest);
* ``fit(layer, options)``: one converted layer (``LayerFit``: its state dict, the parameters it
  changed, and the layer's options when the fit decides some of them, as MLA's RoPE frequencies).

``LayerContext`` hands a method one source layer in slimkv's conventions (``slimkv.convert.source``)
with its calibration statistics. The numerics of the built-in methods live in their own modules
(``gqa``, ``mla``, ``lrkv``, on the helpers of ``pairs`` and ``lowrank``); they are registered at
the bottom of this file. docs/conversion.md describes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slimkv.common.checks import close_matches
from slimkv.convert import gqa, lrkv, mla
from slimkv.convert.context import LayerContext, LayerFit
from slimkv.convert.source import Shape

__all__ = ["CONVERSIONS", "Conversion", "LayerContext", "LayerFit", "get_conversion", "register_conversion"]


@dataclass(frozen=True)
class Conversion:
    """A registered conversion method (module docstring); ``kind`` is the slimkv kind of its layers
    and ``options`` the options every layer shares."""

    name: str
    kind: str
    min_ratio: Callable[[Shape], float]
    plan: Callable[[list[LayerContext], float], tuple[list[dict[str, Any]], str]]
    fit: Callable[[LayerContext, dict[str, Any]], LayerFit]
    options: Callable[[Shape], dict[str, Any]]
    description: str


CONVERSIONS: dict[str, Conversion] = {}


def register_conversion(name: str, *, kind: str, min_ratio: Callable[[Shape], float], plan: Callable, fit: Callable,
                        options: Callable[[Shape], dict[str, Any]] = lambda shape: {}, description: str = "") -> None:
    """Add a conversion method (``slimkv convert --to NAME``)."""
    if name in CONVERSIONS:
        raise ValueError(f"conversion method {name!r} is already registered")
    CONVERSIONS[name] = Conversion(name, kind, min_ratio, plan, fit, options, description)


def get_conversion(name: str) -> Conversion:
    if name not in CONVERSIONS:
        raise ValueError(f"--to {name!r} is not a conversion method{close_matches(name, CONVERSIONS)}; allowed values: {', '.join(CONVERSIONS)}")
    return CONVERSIONS[name]


# ---------------------------------------------------------------- the built-in methods

register_conversion(
    "mla", kind="mla", min_ratio=mla.min_ratio, plan=mla.plan_uniform, fit=mla.fit_layer,
    options=lambda shape: {"latent_norm": False},
    description="multi-head latent attention: rotated pairs chosen by the error their loss leaves, the rest in a balanced latent (recommended)",
)
register_conversion(
    "mla-prefix", kind="mla", min_ratio=mla.min_ratio,
    plan=lambda layers, ratio: mla.plan_uniform(layers, ratio, prefix=True),
    fit=lambda layer, options: mla.fit_layer(layer, options, select="prefix"),
    options=lambda shape: {"latent_norm": False},
    description="mla with the fastest RoPE frequencies in every layer (the ladder DeepSeek-V3's classes can express)",
)
register_conversion(
    "lrkv", kind="lrkv", min_ratio=lrkv.min_ratio, plan=lrkv.plan_uniform, fit=lrkv.fit_layer,
    options=lambda shape: {"rope_mode": "full", "n_kv_heads": shape.n_kv_heads},
    description="shared K/V plus low-rank residuals per K/V head (aligned, alternating fit); RoPE exact",
)
register_conversion(
    "gqa", kind="gqa", min_ratio=gqa.min_ratio,
    plan=lambda layers, ratio: gqa.plan_greedy(layers, ratio, "aware"),
    fit=lambda layer, options: gqa.fit_layer(layer, options, merge="aware"),
    description="fewer K/V heads per layer, merged query/output-aware (the baseline)",
)
register_conversion(
    "gqa-mean", kind="gqa", min_ratio=gqa.min_ratio,
    plan=lambda layers, ratio: gqa.plan_greedy(layers, ratio, "mean"),
    fit=lambda layer, options: gqa.fit_layer(layer, options, merge="mean"),
    description="fewer K/V heads per layer, merged by the mean",
)
