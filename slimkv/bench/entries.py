"""The entries of a comparison: labelled attention configurations written in the one grammar of
``slimkv.common.spec`` (``mha``, ``gqa:n_kv_heads=2``, ``lrkv:rank=8``,
``swa+kvm:swa.window=32,kvm.schedule=sqrt``), with the options an entry does not set taken from
each kind's ``comparable`` preset (its own file; tunable kinds at about half of MHA's cache for
the recipe's shape), then from ``--kind-option KIND.NAME=VALUE`` overrides. A value ``null``
means "the kind's own default". Only the attention differs between entries; data, tokenizer,
steps, batch, schedule and the seed set are the recipe's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimkv.attention import LayerShape, kind_spec
from slimkv.common.spec import AttentionSpec, parse_item, split_entries
from slimkv.train.config import TrainConfig


@dataclass(frozen=True)
class Entry:
    """One labelled attention configuration of a comparison.

    ``kinds``: the per-layer pattern (one kind for a plain model); ``options``: kind -> the
    options its layers get (defaults already filled in); ``defaults``: which of them came from
    the kind's preset and why.
    """

    label: str
    kinds: tuple[str, ...]
    options: dict[str, dict[str, Any]]
    defaults: dict[str, str] = field(default_factory=dict)

    @property
    def is_pattern(self) -> bool:
        return len(self.kinds) > 1

    def spec(self) -> AttentionSpec:
        """The entry as an ``AttentionSpec``: a plain model's options for every layer, a pattern's per kind."""
        if not self.is_pattern:
            return AttentionSpec(self.kinds, dict(self.options[self.kinds[0]]))
        return AttentionSpec(self.kinds, {}, {k: dict(v) for k, v in self.options.items() if v})

    def train_values(self) -> dict[str, Any]:
        """The attention keys of a TrainConfig for this entry."""
        return self.spec().to_fields()

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "kinds": list(self.kinds), "options": self.options, "defaults": self.defaults}


def recipe_shape(recipe: Any) -> LayerShape:
    """The layer shape of a recipe (a TrainConfig, a RecallRecipe: anything with d_model, n_heads,
    head_dim and seq_len), for which the presets are computed."""
    return LayerShape(recipe.d_model, recipe.n_heads, recipe.head_dim or recipe.d_model // recipe.n_heads, recipe.seq_len)


def parse_kind_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["lrkv.rank=16", ...]`` (``--kind-option``) -> {"lrkv": {"rank": 16}} (values as YAML).
    The kind must exist; option names are checked when the entries' models are built."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, value = parse_item(item, f"--kind-option {item!r}")
        kind, dot, option = name.partition(".")
        if not dot or not kind or not option:
            raise ValueError(f"--kind-option expects KIND.NAME=VALUE (e.g. lrkv.rank=16), got {item!r}")
        kind_spec(kind)
        if option in out.get(kind, {}):
            raise ValueError(f"--kind-option {kind}.{option} is given twice ({kind}.{option}={out[kind][option]!r} and {item!r}); give it once")
        out.setdefault(kind, {})[option] = value
    return out


def parse_entry(text: str, recipe: Any, kind_overrides: dict[str, dict[str, Any]] | None = None) -> Entry:
    """An ``Entry`` from its text (module docstring). Options: the kind's comparable preset, then
    ``kind_overrides``, then the entry's own options for every kind, then its ``KIND.NAME`` ones;
    options whose value is ``None`` are dropped (the kind's own default applies)."""
    spec = AttentionSpec.parse(text)
    shape = recipe_shape(recipe)
    options, defaults = {}, {}
    for kind in spec.distinct_kinds():
        overrides = (kind_overrides or {}).get(kind, {})
        explicit = {**spec.shared, **spec.per_kind.get(kind, {})}
        table, why = kind_spec(kind).comparable(shape, {**overrides, **explicit})
        merged = {**table, **overrides, **explicit}
        options[kind] = {k: v for k, v in merged.items() if v is not None}
        from_table = [k for k in table if k not in explicit and k not in overrides]
        if from_table:
            defaults[kind] = f"{', '.join(from_table)} from the kind's comparable preset ({why})"
    return Entry(text.strip(), spec.kinds, options, defaults)


def parse_entries(texts: list[str], recipe: Any, kind_overrides: dict[str, dict[str, Any]] | None = None, *,
                  check: Callable[[Entry], Any] | None = None) -> list[Entry]:
    """Entries of ``texts`` (validated, distinct labels, every config buildable) before any work.
    ``check(entry)`` raises ValueError for an entry the recipe cannot build (default: the
    TrainConfig of a ``compare`` recipe)."""
    if not texts:
        raise ValueError("--kinds: name at least one entry (e.g. --kinds mha,gqa,lrkv:rank=8)")
    entries = [parse_entry(t, recipe, kind_overrides) for t in texts]
    unused = sorted(set(kind_overrides or {}) - {k for e in entries for k in e.kinds})
    if unused:
        raise ValueError(f"--kind-option names {', '.join(unused)}, which no entry uses; entries: {', '.join(e.label for e in entries)}")
    seen: dict[str, str] = {}
    for entry in entries:
        slug = run_slug(entry.label)
        if slug in seen:
            raise ValueError(f"--kinds: entries {seen[slug]!r} and {entry.label!r} are the same entry (one run folder {slug!r}); list it once")
        seen[slug] = entry.label
        if check is None:
            config_for(entry, recipe, recipe.seed)  # builds every layer on the meta device
        else:
            check(entry)
    return entries


def run_slug(label: str) -> str:
    """A folder name for an entry label (``lrkv:rank=8`` -> ``lrkv_rank8``)."""
    slug = label.replace(":", "_").replace("=", "").replace(",", "_").replace("+", "-").replace(".", "")
    return re.sub(r"[^A-Za-z0-9_-]", "", slug)


def run_folders(out_dir: Path, labelled_seeds: list[tuple[str, int]]) -> tuple[list[Path], list[str]]:
    """Each (entry label, seed) run's folder (``OUT/runs/<slug>/seed<k>``) and its progress heading
    (``[i/n] label seed k``): the layout compare and the recall sweep share."""
    run_dirs = [Path(out_dir) / "runs" / run_slug(label) / f"seed{seed}" for label, seed in labelled_seeds]
    headings = [f"[{i}/{len(labelled_seeds)}] {label} seed {seed}" for i, (label, seed) in enumerate(labelled_seeds, 1)]
    return run_dirs, headings


def config_for(entry: Entry, recipe: TrainConfig, seed: int) -> TrainConfig:
    """The recipe with this entry's attention and ``seed``; validated (ValueError names the option)."""
    try:
        return TrainConfig.from_dict({**recipe.to_dict(), **entry.train_values(), "seed": seed})
    except ValueError as err:
        raise ValueError(f"entry {entry.label!r}: {err}") from None


MAX_SEEDS = 1000  # seeds of one report (each is a training run per entry)


def parse_seeds(text: str | int, base: int = 0) -> list[int]:
    """``3`` -> [base, base+1, base+2]; ``0,5,7`` -> [0, 5, 7]. At most ``MAX_SEEDS`` seeds, each
    below 2**63 (what torch takes), checked before a list of that many is built."""
    text = str(text).strip()
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            count = int(text)
            if count > MAX_SEEDS:
                raise OverflowError
            seeds = list(range(base, base + count))
    except ValueError:
        raise ValueError(f"--seeds must be a count (e.g. 3) or a comma-separated list of seeds (e.g. 0,1,2), got {text!r}") from None
    except OverflowError:
        raise ValueError(f"--seeds {text}: at most {MAX_SEEDS} seeds are allowed (a training run each per entry)") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must give at least one distinct non-negative seed, got {text!r}")
    if len(seeds) > MAX_SEEDS or max(seeds) >= 2**63:
        raise ValueError(f"--seeds must give at most {MAX_SEEDS} seeds, each below 2**63, got {text if len(text) < 80 else text[:77] + '...'}")
    return seeds


def parse_contexts(text: str) -> list[int]:
    """``256,1024`` -> [256, 1024]; ``none`` or empty -> [] (no decode measurement)."""
    if text.strip().lower() in ("", "none", "0"):
        return []
    try:
        contexts = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--decode-contexts must be comma-separated token counts (e.g. 256,1024,4096) or none, got {text!r}") from None
    if any(c < 1 for c in contexts):
        raise ValueError(f"--decode-contexts must be positive token counts, got {text!r}")
    return contexts


def sweep_specs(kind: str, ranks: list[int], references: tuple[str, ...] = ("mha", "gqa", "mqa")) -> list[str]:
    """The entries of ``slimkv sweep lrkv``: the references, then ``lrkv:rank=r`` per rank."""
    if kind != "lrkv":
        raise ValueError(f"sweep: {kind!r} cannot be swept; allowed values: lrkv")
    if not ranks:
        raise ValueError("--ranks: give at least one rank (e.g. --ranks 0,4,8,16)")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"--ranks must be integers >= 0, got {r!r}")
    return list(references) + [f"lrkv:rank={r}" for r in dict.fromkeys(ranks)]


def parse_ranks(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated integers >= 0 (e.g. 0,4,8,16), got {text!r}") from None


__all__ = ["Entry", "config_for", "parse_contexts", "parse_entries", "parse_entry", "parse_kind_overrides", "parse_ranks", "parse_seeds",
           "recipe_shape", "run_slug", "split_entries", "sweep_specs"]
