"""Public names mean one thing each (issue 40; docs/glossary.md is the vocabulary).

Each test collects, mechanically, the places where one spelling names two things: an option of a
kind that is also an attribute the base class stores for something else, a common option the base
stores under another name, two registries sharing a name, a conversion whose name reads as another
``--attention`` entry, a conversion setting spelled as its layer's option but taking other values or
another default. Clashes that live in code owned elsewhere are listed in ``KNOWN_CLASHES`` with
the spelling docs/glossary.md recommends: a test fails when a clash appears that is not listed,
and when a listed one is gone (then delete its line).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import slimkv
from slimkv.attention import ATTENTION_KINDS, COMMON_OPTIONS, Attention, attention_options, build_attention, kind_spec
from slimkv.common.spec import AttentionSpec
from slimkv.compress.methods import METHODS
from slimkv.convert.methods import CONVERSIONS
from slimkv.convert.source import Shape
from slimkv.model import ModelConfig
from slimkv.ops.quantize import STORAGE_KINDS

KNOWN_CLASHES: dict[str, str] = {
    "--to lrkv:rope_placement": "the layer's rope_placement, but default full in the conversion (a pretrained model's keys rotate whole) and "
                                "decoupled on the layer (exact factored decode), and the conversion refuses none (it would drop the "
                                "model's positions): kept on purpose, docs/glossary.md",
}

# A source model shape every built-in conversion accepts with its default settings.
SHAPE = Shape(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab_size=64, rope_theta=10000.0, norm_eps=1e-5,
              qkv_bias=False, tie_word_embeddings=True, max_position_embeddings=4096)
GRAMMAR = set("+:,=. ")  # characters of the entry grammar (slimkv.common.spec)


def check_against_known(found: set[str], scope: Callable[[str], bool]) -> None:
    """``found`` clashes are exactly the known ones within this test's ``scope`` (a predicate on keys)."""
    known = {key for key in KNOWN_CLASHES if scope(key)}
    assert not found - known, f"public names with two meanings: {sorted(found - known)} (docs/glossary.md)"
    assert not known - found, f"no longer clashing, delete from KNOWN_CLASHES: {sorted(known - found)}"


def own_defaults(kind: str) -> dict[str, Any]:
    """The constructor defaults of ``kind``'s options (own and common), ``inspect.Parameter.empty`` where required."""
    cls = kind_spec(kind).cls
    defaults = {}
    for klass in reversed(cls.__mro__):  # a subclass's default wins over its base's
        init = vars(klass).get("__init__")
        if init is not None and klass is not object:
            defaults.update({p.name: p.default for p in inspect.signature(init).parameters.values() if p.kind == p.KEYWORD_ONLY})
    return {name: defaults.get(name, inspect.Parameter.empty) for name in attention_options(kind)}


def accepts(build: Callable[..., Any], *args: Any, **options: Any) -> bool:
    """Whether ``build(*args, **options)`` takes these values (False for the ValueError that refuses them)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(*args, **options)
    except ValueError:
        return False
    return True


def test_the_base_class_stores_each_common_option_under_its_own_name():
    """``layer.rope`` is the ``rope`` option (it was ``rope_mode``, also lrkv's own option then, now ``rope_placement``); flags as ``use_NAME``."""
    given = {"rope": "partial", "rope_fraction": 0.5, "rope_theta": 500.0, "rope_frequencies": [1.0, 0.5], "qk_norm": True, "bias": True,
             "backend": "reference"}
    assert set(given) == set(COMMON_OPTIONS)
    layer = Attention(16, 2, **given)
    for name, value in given.items():
        stored = [n for n in (name, f"use_{name}") if n in vars(layer) or n in vars(Attention)]
        assert stored, f"the base class does not store common option {name!r} as {name} (or use_{name})"
        assert getattr(layer, stored[0]) == value, f"layer.{stored[0]} is not the {name} option"


def test_no_kind_option_is_an_attribute_of_the_base_class():
    """A kind's own option (common ones excluded) must not share its name with anything the base class holds."""
    base = {n for n in vars(Attention(16, 2)) if not n.startswith("_") and n != "training"}
    base |= {n for klass in Attention.__mro__ if issubclass(klass, Attention) for n in vars(klass) if not n.startswith("_")}
    clashes = {f"{kind}:{option}" for kind in ATTENTION_KINDS for option in kind_spec(kind).own_options() if option in base}
    assert not clashes, f"kind options that are also base-class attributes with another meaning: {sorted(clashes)}"


def test_names_fit_the_entry_grammar():
    """Kinds carry no character of the entry grammar (``+`` patterns, ``:`` options, ``.`` kind prefixes);
    options are identifiers; runtime options are build options."""
    for kind in ATTENTION_KINDS:
        assert not GRAMMAR & set(kind), f"kind {kind!r} uses a character of the entry grammar"
        assert all(option.isidentifier() for option in attention_options(kind)), kind
        assert set(kind_spec(kind).cls.RUNTIME_OPTIONS) <= set(attention_options(kind)), kind
    for name in CONVERSIONS:
        assert not set(":,= ") & set(name), f"--to {name!r} uses a character of the --to grammar"


def test_registries_share_no_name():
    """Kinds, compression methods and storage names are disjoint; a conversion may share a name only
    with the kind it converts to (checked below), never with a compression method or a storage."""
    registries = {"attention kind": set(ATTENTION_KINDS), "compression method": set(METHODS), "cache storage": set(STORAGE_KINDS)}
    names = list(registries)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not registries[a] & registries[b], f"{a} and {b} share {sorted(registries[a] & registries[b])}"
    assert not set(CONVERSIONS) & (set(METHODS) | set(STORAGE_KINDS))
    config_fields = set(inspect.signature(ModelConfig.__init__).parameters) - {"self", "kwargs"}
    for kind in ATTENTION_KINDS:
        assert not set(kind_spec(kind).own_options()) & config_fields, f"{kind} options named like ModelConfig fields"


def test_a_conversion_read_as_an_attention_entry_is_its_kind():
    """``--to NAME`` names what ``--attention NAME`` would build, where NAME reads as registered kinds."""
    found = set()
    for name, conversion in CONVERSIONS.items():
        kinds = AttentionSpec.parse(name).kinds
        if all(k in ATTENTION_KINDS for k in kinds) and kinds != (conversion.kind,):
            found.add(f"--to {name}")
    check_against_known(found, lambda key: key.startswith("--to ") and ":" not in key)


def test_compression_modules_are_not_named_like_kinds():
    package = Path(slimkv.__file__).parent / "compress"
    found = {f"slimkv/compress/{p.name}" for p in package.glob("*.py") if p.stem.replace("_", "-") in ATTENTION_KINDS}
    check_against_known(found, lambda key: key.startswith("slimkv/compress/"))


def _vocabulary() -> set[str]:
    """Every string value the registries name: defaults and example options of every kind, conversion defaults."""
    words = set()
    for kind in ATTENTION_KINDS:
        words.update(v for v in own_defaults(kind).values() if isinstance(v, str))
        words.update(v for options in kind_spec(kind).example_options for v in options.values() if isinstance(v, str))
    words.update(v for c in CONVERSIONS.values() for v in c.settings.values() if isinstance(v, str))
    return words


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_conversion_settings_spelled_as_layer_options_mean_them(name):
    """A ``--to`` setting named like an option of the kind it builds takes the values the layer takes
    (among every word the registries use) and has the layer's default (where the layer has one);
    no setting is named by a fragment of layer options' names."""
    conversion = CONVERSIONS[name]
    layer_defaults, example = own_defaults(conversion.kind), kind_spec(conversion.kind).example_options[0]
    words = _vocabulary()
    found = set()
    for option, default in conversion.settings.items():
        if option not in layer_defaults:
            if any(o.endswith(f"_{option}") or o.startswith(f"{option}_") for o in layer_defaults):
                found.add(f"--to {name}:{option}")  # a fragment of layer options' names (rows of min_rows, max_rows)
            continue
        layer_default = layer_defaults[option]
        if layer_default is not inspect.Parameter.empty and layer_default != default:
            found.add(f"--to {name}:{option}")
        if isinstance(default, str):
            converted = {w for w in words if conversion.check is None or accepts(conversion.check, SHAPE, {**conversion.settings, option: w})}
            built = {w for w in words if accepts(build_attention, conversion.kind, SHAPE.d_model, SHAPE.n_heads, SHAPE.head_dim, **{**example, option: w})}
            assert default in converted, f"--to {name}: the check refuses the default {option}={default!r}"
            if converted != built:
                found.add(f"--to {name}:{option}")
    check_against_known(found, lambda key: key.startswith(f"--to {name}:"))
