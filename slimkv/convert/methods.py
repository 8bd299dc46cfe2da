"""Conversion methods in a registry: a method turns each attention layer of a source model into
one of slimkv's compact kinds. A method is three functions and a registration:

* ``min_ratio(shape)``: the smallest cache ratio it can represent (checked before any work);
* ``plan(layers, ratio)``: per-layer options whose total cache meets the ratio (how sizes are
  allocated across layers is the method's choice, recorded in the manifest);
* ``fit(layer, options)``: one converted layer (``LayerFit``: its state dict, the parameters it
  changed, and the layer's options when the fit decides some of them, as MLA's RoPE frequencies).

A method may also take options of its own (``--to NAME:KEY=VALUE,...``: ``settings`` holds their
names and defaults, ``check(shape, settings)`` validates them before any work, and ``plan``
receives them as keyword arguments), be sized by its options instead of a cache ratio
(``sized_by_ratio=False``: KVM's state is bounded, not a fraction of the original's), and
``refine`` the built model from the original (KVM's attention transfer, ``convert.transfer``).
A method whose plan reads measured per-layer sensitivities gives ``probe_plans(layers, ratio,
**settings)``: the plans of the models to probe (``None`` when the settings do not ask for it);
each of their layers alone is then swapped into the original (``convert.sensitivity``) and
``plan`` reads ``LayerContext.sensitivity`` (one KL per probed plan). A method whose plan reads the
original's head roles gives ``measure(source, settings, calib=, seed=, progress=)``
(``convert.roles``), whose scores ``plan`` reads in ``LayerContext.roles``.

``LayerContext`` hands a method one source layer in slimkv's conventions (``slimkv.convert.source``)
with its calibration statistics. The numerics of the built-in methods live in their own modules
(``gqa``, ``mla``, ``lrkv``, on the helpers of ``pairs`` and ``lowrank``); they are registered at
the bottom of this file. docs/conversion.md describes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimkv.common.checks import close_matches
from slimkv.common.spec import parse_item, split_items
from slimkv.common.vocabulary import renamed_method, renamed_setting
from slimkv.convert import gqa, hybrid, kvm, latent, lrkv, mla, streaming
from slimkv.convert.context import LayerContext, LayerFit
from slimkv.convert.source import Shape

__all__ = ["CONVERSIONS", "Conversion", "LayerContext", "LayerFit", "get_conversion", "parse_method", "register_conversion"]


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
    settings: dict[str, Any] = field(default_factory=dict)
    check: Callable[[Shape, dict[str, Any]], None] | None = None
    sized_by_ratio: bool = True
    refine: Callable[..., dict[str, Any]] | None = None
    text_demand: Callable[[dict[str, Any], Shape], tuple[int, int]] | None = None  # (tokens, window) ``refine`` or ``measure`` reads from the calibration text, checked before any work
    distances: bool = True  # whether the fit reads the attention-distance statistics (the costly part of calibration)
    probe_plans: Callable[..., list[list[dict[str, Any]]] | None] | None = None  # plans whose layers are probed one by one
    measure: Callable[..., dict[str, Any]] | None = None  # head roles of the original (``convert.roles``), before ``plan``
    ratio_floor: Callable[[Shape, dict[str, Any]], float] | None = None  # the smallest ratio under these settings (else ``min_ratio``)
    statistics: bool = True  # whether plan or fit read calibration statistics at all (else the calibration pass is skipped)


CONVERSIONS: dict[str, Conversion] = {}


def register_conversion(name: str, *, kind: str, plan: Callable, fit: Callable, min_ratio: Callable[[Shape], float] = lambda shape: 0.0,
                        options: Callable[[Shape], dict[str, Any]] = lambda shape: {}, description: str = "",
                        settings: dict[str, Any] | None = None, check: Callable[[Shape, dict[str, Any]], None] | None = None,
                        sized_by_ratio: bool = True, refine: Callable[..., dict[str, Any]] | None = None,
                        text_demand: Callable[[dict[str, Any], Shape], tuple[int, int]] | None = None, distances: bool = True,
                        probe_plans: Callable[..., list[list[dict[str, Any]]] | None] | None = None,
                        measure: Callable[..., dict[str, Any]] | None = None,
                        ratio_floor: Callable[[Shape, dict[str, Any]], float] | None = None, statistics: bool = True) -> None:
    """Add a conversion method (``slimkv convert --to NAME``; the module docstring)."""
    if name in CONVERSIONS:
        raise ValueError(f"conversion method {name!r} is already registered")
    CONVERSIONS[name] = Conversion(name, kind, min_ratio, plan, fit, options, description, dict(settings or {}), check, sized_by_ratio, refine, text_demand, distances,
                                   probe_plans, measure, ratio_floor, statistics)


def get_conversion(name: str) -> Conversion:
    """The method ``name`` (the part of ``--to`` before any ``:``)."""
    name = name.partition(":")[0]
    if renamed_method(name):
        raise ValueError(renamed_method(name))
    if name not in CONVERSIONS:
        raise ValueError(f"--to {name!r} is not a conversion method{close_matches(name, CONVERSIONS)}; allowed values: {', '.join(CONVERSIONS)}")
    return CONVERSIONS[name]


def parse_method(text: str) -> tuple[Conversion, dict[str, Any]]:
    """``--to NAME[:KEY=VALUE,...]`` -> the method and its settings (defaults filled in);
    ValueError naming an unknown method or option (values are checked by the method's ``check``)."""
    method = get_conversion(text)
    settings = dict(method.settings)
    _, _, items = text.partition(":")
    for item in split_items(items, f"--to {text}"):
        key, value = parse_item(item, f"--to {text}")
        if key not in settings and renamed_setting(method.name, key):
            raise ValueError(renamed_setting(method.name, key))
        if key not in settings:
            allowed = f"allowed options: {', '.join(settings)}" if settings else "it takes no options"
            raise ValueError(f"--to {text}: {key!r} is not an option of {method.name}{close_matches(key, settings)}; {allowed}")
        settings[key] = value
    return method, settings


def sets_option(text: str, key: str) -> bool:
    """Whether ``--to NAME:KEY=VALUE,...`` sets ``key`` itself."""
    return any(item.partition("=")[0].strip() == key for item in text.partition(":")[2].split(","))


def with_setting(text: str, key: str, value: Any, option: str) -> str:
    """``--to NAME[:...]`` with ``key=value`` added (as ``--at N`` or the budget's window set it);
    ValueError naming ``option`` when the text sets ``key`` already."""
    if sets_option(text, key):
        raise ValueError(f"{option} and --to {text} both set {key}: give it once")
    return f"{text}{',' if ':' in text else ':'}{key}={value}"


# ---------------------------------------------------------------- the built-in methods

register_conversion(
    "mla", kind="mla", min_ratio=mla.min_ratio, plan=mla.plan_uniform, fit=mla.fit_layer,
    options=lambda shape: {"latent_norm": False}, settings=mla.METHOD_OPTIONS, check=mla.check_options, probe_plans=mla.probe_plans,
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
    "latent", kind="latent", min_ratio=latent.min_ratio, plan=latent.plan, fit=latent.fit_layer, settings=latent.METHOD_OPTIONS,
    check=latent.check_options, distances=False, probe_plans=latent.probe_plans,
    description="one cached K/V latent, keys rebuilt then rotated: RoPE exact (the quality ceiling of a latent cache; decode rebuilds keys)",
)
register_conversion(
    "lrkv", kind="lrkv", min_ratio=lrkv.min_ratio, plan=lrkv.plan_uniform, fit=lrkv.fit_layer,
    options=lambda shape: {"rope_placement": "full", "n_kv_heads": shape.n_kv_heads}, settings=lrkv.METHOD_OPTIONS, check=lrkv.check_options,
    probe_plans=lrkv.probe_plans,
    description="shared K/V plus low-rank residuals per K/V head (aligned, alternating fit); RoPE exact, or rope_placement=decoupled for a decode "
                "that reads the compact cache directly",
)
register_conversion(
    "kvm", kind="kvm", plan=kvm.plan, fit=kvm.fit_layer, settings=kvm.METHOD_OPTIONS, check=kvm.check_options, sized_by_ratio=False,
    refine=kvm.attention_transfer, text_demand=lambda settings, shape: kvm.transfer_demand(settings),
    description="key-value means: exact window + bounded state of key/value means (partial RoPE, attention transfer); no --cache-ratio",
)
register_conversion(
    "mla-kvm", kind="mla-kvm", min_ratio=mla.min_ratio, plan=kvm.plan_latent, fit=kvm.fit_latent_layer,
    options=lambda shape: {"latent_norm": False}, settings=kvm.LATENT_OPTIONS, check=kvm.check_latent_options,
    refine=kvm.attention_transfer, text_demand=lambda settings, shape: kvm.transfer_demand(settings),
    description="mla's latent rows for the window, KVM's bounded state of latent means for the past (attention transfer); --cache-ratio sizes the rows",
)
register_conversion(
    "rope-partial", kind="gqa", plan=kvm.plan_rope, fit=kvm.fit_rope_layer, settings=kvm.ROPE_OPTIONS, check=kvm.check_rope_options,
    sized_by_ratio=False,
    description="the kvm conversion's RoPE treatment alone, full cache (what partial RoPE costs); no --cache-ratio",
)
register_conversion(
    "streaming", kind="streaming", plan=streaming.plan, fit=streaming.fit_layer, settings=streaming.METHOD_OPTIONS, check=streaming.check_options,
    sized_by_ratio=False, distances=False,
    description="attention sinks + sliding window (StreamingLLM), weights unchanged: the bounded-memory baseline; no --cache-ratio",
)
register_conversion(
    "hybrid", kind="hybrid", plan=hybrid.plan, fit=hybrid.fit_layer, settings=hybrid.METHOD_OPTIONS, check=hybrid.check_options, distances=False,
    measure=hybrid.measure_roles, ratio_floor=hybrid.ratio_floor, text_demand=hybrid.text_demand, statistics=False,
    description="per-head cache roles: the KV heads that retrieve (measured on copy contexts) keep every token, the rest sinks + a window; "
                "weights unchanged; --cache-ratio is the budget at `at` tokens",
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
