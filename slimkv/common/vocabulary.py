"""Spellings that were renamed so that each public word means one thing (docs/glossary.md, issue 40).

A user who types an old spelling is refused with a message naming the new one (``renamed_method``,
``renamed_setting``: ``slimkv.convert.methods`` raises them). What was *written* under an old
spelling keeps reading: ``current_method`` rewrites a ``--to`` text as it is spelled today, so a
converted folder's manifest or a results file made before the renames compares and displays with
today's words. Pure data and text (it reads option lists with ``slimkv.common.spec``).

Renamed in vocabulary 2:

* ``--to mla+kvm`` -> ``--to mla-kvm`` (``+`` is the layer pattern of ``--attention swa+kvm``; this
  conversion builds the one kind ``mla-kvm``);
* ``--to kvm:rows`` and ``--to mla-kvm:rows`` -> ``min_rows`` (the layer's option, beside ``max_rows``);
* ``--to lrkv:rope`` -> ``rope_placement`` (``rope`` is the common option, ``full``/``partial``/``none``;
  this setting is where lrkv applies RoPE, ``full``/``decoupled``: the layer's ``rope_placement``);
* the defaults of ``--to kvm`` and ``--to mla-kvm`` are the layer's: ``chunk_size`` 256 (was 128),
  ``sink_len`` 1 (was 4), ``min_rows`` the schedule's default (256 for ``fixed`` and ``sqrt``, as
  ``rows`` was). A text written before spelled neither when it used the old defaults, so
  ``current_method(..., written_in=1)`` writes them out (``CHANGED_DEFAULTS``).

Changed in vocabulary 3: the default ``score`` of ``--to hybrid`` (and so of ``--cache-budget``) is
``combined`` (was ``copy_mass``): a text written before spells ``score=copy_mass`` when read.

Renamed in vocabulary 3, a layer option (``RENAMED_LAYER_OPTIONS``): lrkv's ``rope_mode`` ->
``rope_placement`` (the name of ``--to lrkv:rope_placement`` and of the layer's attribute; ``rope`` is
the common option). Typed (``build_attention``, so ``--attention``, ``--kinds``, ``--kind-option``
and a ``ModelConfig`` made in Python), it is refused by ``renamed_layer_option``'s message. Written
(a saved model's config.json, a run's train_config.json, a conversion manifest's per-layer options,
a recall run's request), it reads as today's (``current_layer_options``, ``current_attention_fields``),
whatever vocabulary the file records: an old option name is never an option of today.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from slimkv.common.spec import split_items

VOCABULARY = 3  # results files and conversion manifests record it; those without it were written under vocabulary 1

RENAMED_METHODS = {"mla+kvm": "mla-kvm"}
RENAMED_SETTINGS = {"kvm": {"rows": "min_rows"}, "mla-kvm": {"rows": "min_rows"}, "lrkv": {"rope": "rope_placement"}}
# attention kind -> {old option name: today's}: the options of the layers themselves (build_attention, ModelConfig)
RENAMED_LAYER_OPTIONS = {"lrkv": {"rope_mode": "rope_placement"}}
# vocabulary N -> the defaults that changed in it: what a method's options were under every vocabulary before N
CHANGED_DEFAULTS = {2: {"kvm": {"chunk_size": 128, "sink_len": 4}, "mla-kvm": {"chunk_size": 128, "sink_len": 4}},
                    3: {"hybrid": {"score": "copy_mass"}}}


def renamed_method(name: str) -> str | None:
    """The message refusing ``--to NAME`` when NAME is an old spelling, else None."""
    new = RENAMED_METHODS.get(name)
    return None if new is None else (f"--to {name} is now spelled --to {new} (it builds the one kind {new}; `+` alternates layers in --attention)")


def renamed_setting(method: str, key: str) -> str | None:
    """The message refusing ``--to METHOD:KEY=...`` when KEY is an old spelling, else None."""
    new = RENAMED_SETTINGS.get(method, {}).get(key)
    return None if new is None else f"--to {method}: the option {key!r} is now spelled {new!r} ({method}:{new}=...)"


def renamed_layer_option(kind: str, name: str) -> str | None:
    """The message refusing the option NAME of attention kind KIND when NAME is an old spelling, else None."""
    new = RENAMED_LAYER_OPTIONS.get(kind, {}).get(name)
    return None if new is None else f"the option {name!r} of attention kind {kind!r} is now spelled {new!r} ({kind}:{new}=...)"


def current_layer_options(kinds: str | Iterable[str], options: Any) -> Any:
    """Layer options written earlier for layers of ``kinds`` (one kind, or the kinds of a pattern
    whose layers all received them) with today's names. An old name stays when today's is there
    too (``build_attention`` then refuses it, naming the new one); anything but a mapping is returned as it is."""
    if not isinstance(options, Mapping):
        return options
    renames: dict[str, str] = {}
    for kind in kinds if isinstance(kinds, Iterable) and not isinstance(kinds, str) else [kinds]:
        renames.update(RENAMED_LAYER_OPTIONS.get(kind, {}) if isinstance(kind, str) else {})
    return {(renames[k] if k in renames and renames[k] not in options else k): v for k, v in options.items()}


def current_attention_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A stored config (config.json, train_config.json, a recall run's request) with the layer
    options of its ``attention_options``, ``kind_options`` and ``per_layer_options`` (the fields of
    ``slimkv.common.spec.AttentionSpec``) spelled as today (``current_layer_options``); every other
    field, and a field it cannot read, as it is (the config's own checks report those)."""
    out = dict(fields)
    attention = fields.get("attention")
    if isinstance(attention, str):
        kinds = [k.strip() for k in attention.replace(",", "+").split("+")]
    elif isinstance(attention, (list, tuple)):
        kinds = list(attention)
    else:
        return out
    if isinstance(fields.get("attention_options"), Mapping):
        out["attention_options"] = current_layer_options(kinds, fields["attention_options"])
    if isinstance(fields.get("kind_options"), Mapping):
        out["kind_options"] = {kind: current_layer_options(kind, options) for kind, options in fields["kind_options"].items()}
    if isinstance(fields.get("per_layer_options"), (list, tuple)) and kinds:
        out["per_layer_options"] = [current_layer_options(kinds[i % len(kinds)], options) for i, options in enumerate(fields["per_layer_options"])]
    return out


def written_in(record: Mapping[str, Any]) -> int:
    """The vocabulary a results file or manifest was written under (1 when it records none)."""
    return record["vocabulary"] if isinstance(record.get("vocabulary"), int) else 1


def is_legacy(record: Mapping[str, Any]) -> bool:
    """Whether a results file or manifest was written before today's vocabulary."""
    return written_in(record) < VOCABULARY


def current_method(text: str | None, *, written_in: int = 1) -> str | None:
    """A ``--to`` text (``NAME[:KEY=VALUE,...][@RATIO]``, as results files hold it) spelled as today:
    renamed methods and options replaced, and the defaults that changed since vocabulary
    ``written_in`` (the record's) written out as they were then. Options keep their order; None stays None."""
    if not text:
        return text
    body, at, ratio = text.rpartition("@") if "@" in text else (text, "", "")
    name, colon, items = body.partition(":")
    new_name = RENAMED_METHODS.get(name, name)
    if name == new_name and name not in RENAMED_SETTINGS and not any(name in changed for changed in CHANGED_DEFAULTS.values()):
        return text  # a method no rename touched (and any other text a results file calls its method)
    renames = RENAMED_SETTINGS.get(new_name, {})
    parts = split_items(items) if colon else []
    keys = []
    for i, piece in enumerate(parts):
        key, sep, value = piece.partition("=")
        key = renames.get(key.strip(), key.strip())
        keys.append(key)
        parts[i] = f"{key}{sep}{value}"
    then = {}
    for version in sorted(CHANGED_DEFAULTS, reverse=True):  # the oldest change wins: it was the default when the text was written
        if written_in < version:
            then.update(CHANGED_DEFAULTS[version].get(new_name, {}))
    parts = [f"{key}={value}" for key, value in then.items() if key not in keys] + parts
    return new_name + (":" + ",".join(parts) if parts else "") + (at + ratio)


def current_settings(method: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's ``method_options`` (``method`` its recorded method name) with today's option names."""
    renames = RENAMED_SETTINGS.get(RENAMED_METHODS.get(method, method), {})
    return {renames.get(key, key): value for key, value in settings.items()}


def in_todays_words(payload: Any) -> Any:
    """A results file's payload read in today's words: when it was written under an older vocabulary
    (``is_legacy``), a copy with every ``method`` text and every text of a ``runs`` mapping (label
    -> ``--to`` text) spelled as today (``current_method``); a file of today as it is."""
    if not isinstance(payload, Mapping) or not is_legacy(payload):
        return payload
    version = written_in(payload)

    def walk(value: Any, key: str | None = None) -> Any:
        if isinstance(value, Mapping):
            if key == "runs":
                return {k: current_method(v, written_in=version) if isinstance(v, str) else walk(v) for k, v in value.items()}
            return {k: current_method(v, written_in=version) if k == "method" and isinstance(v, str) else walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(payload)
