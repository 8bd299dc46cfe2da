"""One grammar for "which attention kind(s) the layers use, with which options": ``AttentionSpec``.

Every spelling the library accepts becomes one ``AttentionSpec``:

* entry text (``slimkv compare --kinds``, ``slimkv train --attention``): ``KIND[+KIND...][:ITEM,...]``.
  ``KIND+KIND`` is a per-layer pattern repeated over the layers (``swa+kvm`` alternates them).
  An ITEM ``NAME=VALUE`` applies to every kind of the entry, ``KIND.NAME=VALUE`` to that kind's
  layers only; a NAME given twice is refused. Values are read as YAML (``8``, ``0.5``, ``sqrt``,
  ``true``, ``null``, ``[1, 2]``), where every plain float spelling is a number (``1e-3``,
  ``1E+5``, ``-.5``: YAML 1.1 alone would read them as text); ``null`` means "the kind's own default". Examples: ``lrkv:rank=8,rope_placement=none``,
  ``swa+kvm:swa.window=32,kvm.schedule=sqrt``. The older pattern spelling with commas
  (``--attention swa,mha``) still reads as a pattern when the text is one entry.
* several entries in one string (``--kinds mha,gqa,lrkv:rank=8,rope_placement=none``): ``split_entries``.
  A comma starts a new entry unless the piece after it is an option (has ``=`` and no ``:``).
* the fields of ``ModelConfig`` / ``TrainConfig`` (and so of config.json and train_config.json):
  ``attention`` (a kind or a list), ``attention_options`` (every layer), ``kind_options``
  (kind -> options), and ``per_layer_options`` (one mapping per layer, used by converted models
  whose layers have different sizes): ``AttentionSpec.from_fields`` / ``to_fields``.

The spec only reads and combines; whether a kind exists and its options are valid is decided by
``slimkv.attention.build_attention`` alone (``ModelConfig`` builds every layer on the meta device).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from slimkv.common.checks import close_matches

PATTERN_SEPARATOR = "+"


class _ValueLoader(yaml.SafeLoader):
    """``yaml.safe_load`` (YAML 1.1) with numbers spelled as people mean them: the float spellings
    it reads as text are floats (``1e-3``, ``1E+5``, ``1.0e5``, ``-.5``: its own float needs a dot
    and a signed exponent), ``012`` is twelve (not octal ten) and ``1:30`` is text (not base-60 ninety)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        text = self.construct_scalar(node).replace("_", "")
        if ":" in text:
            return self.construct_scalar(node)
        return int(text) if re.fullmatch(r"[-+]?[0-9]+", text) else super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> Any:
        return self.construct_scalar(node) if ":" in self.construct_scalar(node) else super().construct_yaml_float(node)


_ValueLoader.add_constructor("tag:yaml.org,2002:int", _ValueLoader.construct_yaml_int)
_ValueLoader.add_constructor("tag:yaml.org,2002:float", _ValueLoader.construct_yaml_float)
_ValueLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"),
                                   list("-+0123456789."))  # tried after YAML's own int and float: 8 stays an int


@dataclass(frozen=True)
class AttentionSpec:
    """The attention of a model: a per-layer pattern of kinds and the options of each layer.

    ``kinds``: the pattern, repeated over the layers (one kind for a uniform model).
    ``shared``: options for every layer. ``per_kind``: kind -> options for that kind's layers
    (they win over ``shared``). ``per_layer``: per-layer overrides, either empty or one mapping
    per layer (they win over both).
    """

    kinds: tuple[str, ...]
    shared: dict[str, Any] = field(default_factory=dict)
    per_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_layer: tuple[dict[str, Any], ...] = ()

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_fields(cls, attention: str | Sequence[str], attention_options: Mapping | None = None, kind_options: Mapping | None = None,
                    per_layer_options: Sequence[Mapping] | None = None) -> AttentionSpec:
        """From the keys of a ModelConfig / TrainConfig; ValueError naming the field if malformed."""
        if isinstance(attention, str):
            kinds = tuple(k.strip() for k in attention.split(",")) if "," in attention else (attention,)
        elif isinstance(attention, Sequence) and not isinstance(attention, (bytes, bytearray)):
            kinds = tuple(attention)
        else:
            raise ValueError(f"attention must be a kind name or a list of kind names, got {attention!r}")
        if not kinds or not all(isinstance(k, str) and k for k in kinds):
            raise ValueError(f"attention must be a kind name or a non-empty list of kind names, got {attention!r}")
        if not isinstance(attention_options or {}, Mapping):
            raise ValueError(f"attention_options must be a mapping of option names to values, got {attention_options!r}")
        if not isinstance(kind_options or {}, Mapping) or not all(isinstance(v, Mapping) for v in (kind_options or {}).values()):
            raise ValueError(f"kind_options must map kind names to mappings of options, got {kind_options!r}")
        if per_layer_options is not None and (isinstance(per_layer_options, (str, Mapping)) or not all(isinstance(v, Mapping) for v in per_layer_options)):
            raise ValueError(f"per_layer_options must be a list with one mapping of options per layer, got {per_layer_options!r}")
        return cls(
            kinds,
            copy.deepcopy(dict(attention_options or {})),
            {k: copy.deepcopy(dict(v)) for k, v in (kind_options or {}).items()},
            tuple(copy.deepcopy(dict(v)) for v in (per_layer_options or ())),
        )

    @classmethod
    def parse(cls, text: str) -> AttentionSpec:
        """One entry ``KIND[+KIND...][:ITEM,...]`` (module docstring); ValueError naming the bad part."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("an attention entry is empty: write KIND or KIND:NAME=VALUE (e.g. lrkv:rank=8)")
        head, _, tail = text.strip().partition(":")
        separator = PATTERN_SEPARATOR if PATTERN_SEPARATOR in head or "," not in head else ","
        kinds = tuple(k.strip() for k in head.split(separator))
        if not all(kinds):
            raise ValueError(f"entry {text!r}: an empty kind in the pattern {head!r} (write KIND+KIND, e.g. swa+kvm)")
        shared: dict[str, Any] = {}
        per_kind: dict[str, dict[str, Any]] = {}
        for item in split_items(tail, f"entry {text!r}"):
            name, value = parse_item(item, f"entry {text!r}")
            kind, dot, option = name.rpartition(".")
            if dot:
                if kind not in kinds:
                    raise ValueError(f"entry {text!r}: option {item!r} names kind {kind!r}, which the entry does not use{close_matches(kind, kinds)}; "
                                     f"its kinds: {', '.join(dict.fromkeys(kinds))}")
                per_kind.setdefault(kind, {})[option] = value
            else:
                shared[name] = value
        return cls(kinds, shared, per_kind)

    # -- views ---------------------------------------------------------------------------

    @property
    def is_pattern(self) -> bool:
        return len(self.kinds) > 1

    def distinct_kinds(self) -> list[str]:
        return list(dict.fromkeys(self.kinds))

    def layer_kinds(self, n_layers: int) -> list[str]:
        """The kind of each of ``n_layers`` layers (the pattern repeated)."""
        return [self.kinds[i % len(self.kinds)] for i in range(n_layers)]

    def options_for(self, kind: str) -> dict[str, Any]:
        """Options of ``kind``'s layers before per-layer overrides; ``None`` values dropped (kind defaults)."""
        merged = {**self.shared, **self.per_kind.get(kind, {})}
        return {k: v for k, v in merged.items() if v is not None}

    def layer_options(self, layer: int) -> dict[str, Any]:
        """Options ``build_attention`` receives for layer ``layer``."""
        kind = self.kinds[layer % len(self.kinds)]
        merged = {**self.shared, **self.per_kind.get(kind, {}), **(self.per_layer[layer] if self.per_layer else {})}
        return {k: v for k, v in merged.items() if v is not None}

    def check_layers(self, n_layers: int) -> None:
        """The pattern, kind options and per-layer overrides fit ``n_layers`` layers (ValueError otherwise)."""
        if self.is_pattern and n_layers % len(self.kinds):
            raise ValueError(f"attention pattern {'+'.join(self.kinds)} of length {len(self.kinds)} does not divide n_layers={n_layers}")
        for kind in self.per_kind:
            if kind not in self.kinds:
                raise ValueError(f"kind_options names {kind!r}, which no layer uses{close_matches(kind, self.kinds)}; layers use: {', '.join(self.distinct_kinds())}")
        if self.per_layer and len(self.per_layer) != n_layers:
            raise ValueError(f"per_layer_options has {len(self.per_layer)} entries; it needs one per layer ({n_layers})")

    def to_fields(self) -> dict[str, Any]:
        """The ModelConfig / TrainConfig keys (``attention`` a string for one kind, else a list)."""
        fields = {
            "attention": self.kinds[0] if not self.is_pattern else list(self.kinds),
            "attention_options": copy.deepcopy(self.shared),
            "kind_options": copy.deepcopy(self.per_kind),
        }
        if self.per_layer:
            fields["per_layer_options"] = [copy.deepcopy(o) for o in self.per_layer]
        return fields

    def with_options(self, shared: Mapping | None = None, per_kind: Mapping | None = None) -> AttentionSpec:
        """A copy with more options (the new ones win); per-kind options for kinds not in the pattern are ignored."""
        merged_kind = {k: dict(v) for k, v in self.per_kind.items()}
        for kind, options in (per_kind or {}).items():
            if kind in self.kinds:
                merged_kind.setdefault(kind, {}).update(options)
        return AttentionSpec(self.kinds, {**self.shared, **(shared or {})}, merged_kind, self.per_layer)

    def text(self) -> str:
        """The entry text that parses back to this spec (without per-layer overrides)."""
        items = [f"{k}={format_value(v)}" for k, v in self.shared.items()]
        for kind, options in self.per_kind.items():
            items += [f"{kind}.{k}={format_value(v)}" for k, v in options.items()]
        return PATTERN_SEPARATOR.join(self.kinds) + (":" + ",".join(items) if items else "")


# ---------------------------------------------------------------- pieces of the text grammar


def split_items(text: str, where: str | None = None) -> list[str]:
    """The ``NAME=VALUE`` items of one option list, comma-separated (not splitting inside [...] or
    {...}; empty items dropped); ValueError naming a NAME given twice (it would silently win), and
    ``where`` the list comes from (``--to kvm:...``) when given."""
    items = _split(text)
    seen: dict[str, str] = {}
    for item in items:
        name, sep, _ = item.partition("=")
        name = name.strip()
        if sep and name in seen:
            raise ValueError(f"{where + ': ' if where else ''}option {name!r} is given twice in {text.strip()!r} ({seen[name]!r} and {item!r}); give it once")
        seen[name] = item
    return items


def _split(text: str) -> list[str]:
    """Comma-separated pieces, not splitting inside [...] or {...}; empty pieces dropped."""
    items, depth, current = [], 0, []
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [i.strip() for i in items if i.strip()]


def parse_item(item: str, where: str) -> tuple[str, Any]:
    """``NAME=VALUE`` -> (name, value as ``read_value`` reads it); ValueError saying where."""
    name, sep, raw = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"{where}: option {item!r} needs a value (NAME=VALUE, e.g. rank=8)")
    try:
        return name, read_value(raw)
    except yaml.YAMLError as err:
        why = ", ".join(part for part in (getattr(err, "context", None), getattr(err, "problem", None)) if part) or " ".join(str(err).split())
        raise ValueError(f"{where}: cannot read the value {raw!r} of option {name!r} ({why}); write it as YAML, e.g. 8, 0.5, sqrt or [1, 2]") from None


def read_value(raw: str) -> Any:
    """An option's value written on a command line: YAML (``8``, ``0.5``, ``sqrt``, ``[1, 2]``),
    every plain float spelling a number (``1e-3``), empty text ``None``; yaml.YAMLError if unreadable."""
    return yaml.load(raw, Loader=_ValueLoader) if raw.strip() else None


def format_value(value: Any) -> str:
    """A value written so that ``parse_item`` reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def split_entries(texts: str | Sequence[str]) -> list[str]:
    """Entry texts from ``--kinds`` (one string or several): commas separate entries except
    before an option (a piece with ``=`` and no ``:`` continues the previous entry), so
    ``mha,lrkv:rank=8,rope_placement=none,gqa`` -> ``mha | lrkv:rank=8,rope_placement=none | gqa``."""
    entries: list[str] = []
    for text in [texts] if isinstance(texts, str) else texts:
        for piece in _split(text):
            if entries and "=" in piece and ":" not in piece:
                entries[-1] += "," + piece
            else:
                entries.append(piece)
    return entries
