"""``slimkv compare``: train every requested attention kind with ONE recipe, over several seeds,
and report quality against cache size (evaluation.md, "Language-model quality" and "Cache size").

An *entry* is one labelled configuration of the attention, written ``KIND[:NAME=VALUE,...]``:
``mha``, ``gqa:n_kv_heads=2``, ``lrkv:rank=8``. ``swa+kvm`` is a per-layer pattern (layers
alternate swa and kvm); its options name the kind, ``swa+kvm:swa.window=32,kvm.schedule=sqrt``.
Options an entry does not set come from ``default_options``, a table that puts every kind at a
comparable setting for the recipe's shape (the tunable kinds at about half of MHA's cache), and
``--kind-option KIND.NAME=VALUE`` changes that table. A value ``null`` means "the kind's own
default". Only the attention differs between entries; data, tokenizer, steps, batch, schedule and
the seed set are the recipe's.

For every entry and seed: train (``slimkv.train``), evaluate val CE/BPB on the held-out split
(``slimkv.eval.lm``, bytes denominator), measure the cache after prefilling ``seq_len`` tokens
(per layer, per model, ratio to MHA of the same shape) and the head diversity
(``slimkv.eval.diversity``). Once per entry (it does not depend on training): per-token decode
latency of ONE LAYER of each kind in the entry at the recipe's width, with a filled cache, at
each ``decode_contexts`` (``slimkv.bench.decode.decode_sweep``); a pattern reports the mean over
its layers. Seeds are aggregated as mean, sample std, min and max.

Resumable: each run directory ``OUT/runs/<entry>/seed<k>`` keeps ``compare_run.json`` once it is
trained and evaluated; a second invocation reuses it (and says so), and an interrupted training
resumes from its checkpoint. ``report.json`` holds everything; ``report.md`` and the PNGs are a
pure function of it (``slimkv report report.json`` regenerates them).
"""

from __future__ import annotations

import re
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slimkv.attention import attention_options, kind_spec
from slimkv.files import save_figure, write_text
from slimkv.train.config import TrainConfig

REPORT_FORMAT = 1
RUN_FILE = "compare_run.json"  # a finished (trained + evaluated) run of one entry and seed
DEFAULT_EVAL_TOKENS = 32768
DEFAULT_DECODE_CONTEXTS = (256, 1024, 4096)
REFERENCE = "mha"
MIN_SEEDS_FOR_CLAIM = 3  # fewer seeds never support "A beats B"
PLOT_BPB = "bpb_vs_cache.png"
PLOT_DECODE = "decode_vs_context.png"


# ---------------------------------------------------------------- entries and their options


@dataclass(frozen=True)
class Entry:
    """One labelled attention configuration of a comparison.

    ``kinds``: the per-layer pattern (one kind for a plain model); ``options``: kind -> the
    options its layers get (defaults already filled in); ``defaults``: which of them came from
    the default table and why.
    """

    label: str
    kinds: tuple[str, ...]
    options: dict[str, dict[str, Any]]
    defaults: dict[str, str] = field(default_factory=dict)

    @property
    def is_pattern(self) -> bool:
        return len(self.kinds) > 1

    def train_values(self) -> dict[str, Any]:
        """The attention keys of a TrainConfig for this entry."""
        if not self.is_pattern:
            return {"attention": self.kinds[0], "attention_options": dict(self.options[self.kinds[0]]), "kind_options": {}}
        kind_options = {k: dict(v) for k, v in self.options.items() if v}
        return {"attention": list(self.kinds), "attention_options": {}, "kind_options": kind_options}

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "kinds": list(self.kinds), "options": self.options, "defaults": self.defaults}


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, max(cap, 1) + 1) if n % d == 0)


def default_options(kind: str, recipe: TrainConfig, explicit: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """(options, why) putting ``kind`` at a comparable setting for the recipe's shape.

    The tunable kinds target about half of MHA's cache per token per layer (H heads of d_h):
    gqa H/2 K/V heads; lrkv rank round(d_h (1/2 - 1/H)) (cache 1/H + r/d_h of MHA); mla a latent
    of H d_h - rope_dim with rope_dim d_h/2. swa sees half the training context. kvm works at
    the recipe's scale: chunks of seq_len/8, so it compresses within one training window (its
    paper defaults, 256-token chunks and 256 rows, would never compress a 128-token window).
    ``explicit`` (the entry's own options) only steers choices that depend on it (kvm's schedule).
    Kinds registered later without a table entry get their first registered example options.
    """
    heads = recipe.n_heads
    head_dim = recipe.head_dim or recipe.d_model // heads
    explicit = explicit or {}
    if kind in ("mha", "mqa"):
        return {}, "no options"
    if kind == "gqa":
        kv = _largest_divisor_at_most(heads, heads // 2)
        return {"n_kv_heads": kv}, f"n_kv_heads = H/2 ({kv} of {heads}): half of MHA's cache"
    if kind == "swa":
        return {"window": max(1, recipe.seq_len // 2)}, "window = seq_len / 2"
    if kind == "lrkv":
        if "rank_k" in explicit or "rank_v" in explicit:
            return {}, "ranks set by the entry"
        rank = max(0, round(head_dim * (0.5 - 1 / heads)))
        return {"rank": rank}, f"rank = round(d_h (1/2 - 1/H)) = {rank}: cache 1/H + r/d_h = {1 / heads + rank / head_dim:.3f} of MHA"
    if kind == "mla":
        rope_dim = max(2, head_dim // 2 - head_dim // 2 % 2)
        kv_rank = max(1, heads * head_dim - rope_dim)
        return {"kv_rank": kv_rank, "rope_dim": rope_dim}, f"kv_rank + rope_dim = H d_h = {kv_rank + rope_dim}: half of MHA's cache"
    if kind == "kvm":
        chunk = max(2, recipe.seq_len // 8)
        schedule = explicit.get("schedule", "fixed")
        options: dict[str, Any] = {"chunk_size": chunk, "schedule": schedule}
        if schedule == "sqrt":
            options.update(min_rows=max(1, chunk // 2), sqrt_coef=2.0)
            return options, f"chunk_size = seq_len/8 = {chunk}; rows = max(2 sqrt(N), {chunk // 2})"
        if schedule == "fixed":
            options["min_rows"] = chunk
            return options, f"chunk_size = seq_len/8 = {chunk}; {chunk} state rows"
        return options, f"chunk_size = seq_len/8 = {chunk}"
    example = dict(kind_spec(kind).example_options[0])
    return example, "the kind's first registered example options (no default-table entry)"


def parse_value(name: str, raw: str, where: str) -> Any:
    """An option value read as YAML (``8`` -> int, ``sqrt`` -> str, ``null`` -> None)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: cannot read the value {raw!r} of option {name!r}: {err}") from None


def _check_option(kind: str, name: str, where: str) -> None:
    allowed = attention_options(kind)
    if name not in allowed:
        raise ValueError(f"{where}: unknown option {name!r} for attention kind {kind!r}; allowed options: {', '.join(allowed)}")


def parse_kind_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["lrkv.rank=16", ...]`` (``--kind-option``) -> {"lrkv": {"rank": 16}}, validated."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        kind, dot, name = key.strip().partition(".")
        if not sep or not dot or not kind or not name:
            raise ValueError(f"--kind-option expects KIND.NAME=VALUE (e.g. lrkv.rank=16), got {item!r}")
        kind_spec(kind)
        _check_option(kind, name, f"--kind-option {item!r}")
        out.setdefault(kind, {})[name] = parse_value(name, raw, f"--kind-option {item!r}")
    return out


def parse_entry(spec: str, recipe: TrainConfig, kind_overrides: dict[str, dict[str, Any]] | None = None) -> Entry:
    """An ``Entry`` from ``KIND[+KIND...][:NAME=VALUE,...]`` (module docstring). Raises ValueError
    naming the bad kind or option. Options: default table, then ``kind_overrides``, then the
    spec's own; options whose value is ``None`` are dropped (the kind's own default applies)."""
    text = spec.strip()
    if not text:
        raise ValueError("an entry is empty: write KIND or KIND:NAME=VALUE (e.g. lrkv:rank=8)")
    head, _, tail = text.partition(":")
    kinds = tuple(k.strip() for k in head.split("+"))
    for kind in kinds:
        if not kind:
            raise ValueError(f"entry {spec!r}: an empty kind in the pattern {head!r}")
        kind_spec(kind)
    explicit: dict[str, dict[str, Any]] = {k: {} for k in kinds}
    for item in filter(None, (p.strip() for p in tail.split(","))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"entry {spec!r}: option {item!r} needs a value (NAME=VALUE, e.g. {kinds[0]}:{name or 'rank'}=8)")
        if len(kinds) > 1:
            kind, dot, name = name.partition(".")
            if not dot or kind not in kinds:
                raise ValueError(f"entry {spec!r}: option {item!r} of a pattern must name its kind (KIND.NAME=VALUE with KIND one of {', '.join(kinds)})")
        else:
            kind = kinds[0]
        _check_option(kind, name, f"entry {spec!r}")
        explicit[kind][name] = parse_value(name, raw, f"entry {spec!r}")
    options, defaults = {}, {}
    for kind in dict.fromkeys(kinds):
        table, why = default_options(kind, recipe, {**(kind_overrides or {}).get(kind, {}), **explicit[kind]})
        merged = {**table, **(kind_overrides or {}).get(kind, {}), **explicit[kind]}
        options[kind] = {k: v for k, v in merged.items() if v is not None}
        from_table = [k for k in table if k not in explicit[kind] and k not in (kind_overrides or {}).get(kind, {})]
        if from_table:
            defaults[kind] = f"{', '.join(from_table)} from the default table ({why})"
    return Entry(text, kinds, options, defaults)


def parse_entries(specs: list[str], recipe: TrainConfig, kind_overrides: dict[str, dict[str, Any]] | None = None) -> list[Entry]:
    """Entries of ``specs`` (validated, distinct labels, every config buildable) before any work."""
    if not specs:
        raise ValueError("--kinds: name at least one entry (e.g. --kinds mha,gqa,lrkv:rank=8)")
    entries = [parse_entry(s, recipe, kind_overrides) for s in specs]
    seen: dict[str, str] = {}
    for entry in entries:
        slug = run_slug(entry.label)
        if slug in seen:
            raise ValueError(f"--kinds: entries {seen[slug]!r} and {entry.label!r} are the same entry (one run folder {slug!r}); list it once")
        seen[slug] = entry.label
        config_for(entry, recipe, recipe.seed)  # builds every layer on the meta device
    return entries


def split_specs(text: str) -> list[str]:
    """``--kinds`` text -> entry specs. Commas separate entries, except inside an entry's options:
    a comma-separated piece that has ``=`` but no ``:`` continues the previous entry
    (``mha,lrkv:rank=8,rope_mode=none,gqa`` -> mha | lrkv:rank=8,rope_mode=none | gqa)."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if specs and "=" in piece and ":" not in piece:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def run_slug(label: str) -> str:
    """A folder name for an entry label (``lrkv:rank=8`` -> ``lrkv_rank8``)."""
    slug = label.replace(":", "_").replace("=", "").replace(",", "_").replace("+", "-").replace(".", "")
    return re.sub(r"[^A-Za-z0-9_-]", "", slug)


def config_for(entry: Entry, recipe: TrainConfig, seed: int) -> TrainConfig:
    """The recipe with this entry's attention and ``seed``; validated (ValueError names the option)."""
    try:
        return TrainConfig.from_dict({**recipe.to_dict(), **entry.train_values(), "seed": seed})
    except ValueError as err:
        raise ValueError(f"entry {entry.label!r}: {err}") from None


def parse_seeds(text: str | int, base: int = 0) -> list[int]:
    """``3`` -> [base, base+1, base+2]; ``0,5,7`` -> [0, 5, 7]."""
    text = str(text).strip()
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            seeds = list(range(base, base + int(text)))
    except ValueError:
        raise ValueError(f"--seeds must be a count (e.g. 3) or a comma-separated list of seeds (e.g. 0,1,2), got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must give at least one distinct non-negative seed, got {text!r}")
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


# ---------------------------------------------------------------- one run: train, evaluate, measure


def train_and_evaluate(cfg: TrainConfig, run_dir: Path, *, eval_tokens: int | None, progress: bool) -> tuple[dict[str, Any], bool]:
    """(row, reused): train ``cfg`` into ``run_dir`` (resuming an interrupted run), evaluate it and
    measure cache and head diversity. A run whose ``compare_run.json`` matches is reused."""
    from slimkv.eval.diversity import model_diversity
    from slimkv.eval.lm import evaluate_run
    from slimkv.files import read_json, write_json
    from slimkv.train.checkpoint import load_run
    from slimkv.train.trainer import train

    marker = run_dir / RUN_FILE
    if marker.is_file():
        stored = read_json(marker)
        if stored.get("config") == cfg.to_dict() and stored.get("eval_tokens") == eval_tokens:
            return stored["row"], True
    summary = train(cfg, run_dir, resume=(run_dir / "train_config.json").is_file(), progress=progress)
    result = evaluate_run(run_dir, max_tokens=eval_tokens, progress=progress, verbose=False)
    model, _, _ = load_run(run_dir)
    layers = model_diversity(model)
    measured = [r["r_eff_over_heads"] for r in layers if "error" not in r]
    cache = result["cache"]
    row = {
        "seed": cfg.seed,
        "run_dir": str(run_dir),
        "parameters": result["parameters"],
        "val_ce": result["val_ce"],
        "val_bpb": result["val_bpb"],
        "val_tokens": result["val_tokens"],
        "val_bytes": result["val_bytes"],
        "cache": {
            "context": cache["seq_len"],
            "dtype": cache["dtype"],
            "bytes_per_token_per_layer": cache["bytes_per_token_per_layer"],
            "bytes_per_token_model": cache["bytes_per_token_per_layer"] * len(cache["layers"]),
            "analytic_bytes_per_token_per_layer": cache["analytic_bytes_per_token_per_layer"],
            "mha_bytes_per_token_per_layer": cache["mha_bytes_per_token_per_layer"],
            "ratio_to_mha": cache["ratio_to_mha"],
            "measured_equals_analytic": cache["measured_equals_analytic"],
            "layer_kinds": [layer["kind"] for layer in cache["layers"]],
        },
        "diversity": {"mean_r_eff_over_heads": statistics.fmean(measured) if measured else None, "layers": layers},
        "train_seconds": summary.get("train_seconds"),
        "train_tokens_per_s": summary.get("train_tokens_per_s"),
    }
    write_json(marker, {"config": cfg.to_dict(), "eval_tokens": eval_tokens, "row": row})
    return row, False


def measure_decode(entries: list[Entry], recipe: TrainConfig, contexts: list[int], *, repeats: int = 5, rounds: int = 3) -> dict[str, Any]:
    """Per-token decode latency of one layer of each kind of each entry at the recipe's width
    (untrained weights, random inputs: latency does not depend on training), interleaved, at
    every context. Per entry: the mean over its layer pattern of its kinds' medians."""
    from slimkv.bench.decode import DecodeVariant, decode_sweep
    from slimkv.train.trainer import resolve_device

    if not contexts:
        return {"contexts": [], "rows": [], "per_entry": {}}
    variants = []
    for entry in entries:
        for kind in dict.fromkeys(entry.kinds):
            variants.append(DecodeVariant(f"{entry.label} [{kind}]", kind, dict(entry.options[kind]), source="compare entry"))
    device, _ = resolve_device(recipe)
    head_dim = recipe.head_dim or recipe.d_model // recipe.n_heads
    payload = decode_sweep(variants, contexts, d_model=recipe.d_model, n_heads=recipe.n_heads, head_dim=head_dim, device=str(device), repeats=repeats, rounds=rounds, seed=recipe.seed)
    if payload["skipped"]:
        reasons = "; ".join(f"{s['label']}: {s['reason']}" for s in payload["skipped"])
        raise ValueError(f"decode measurement could not build: {reasons}")
    median = {(r["label"], r["context"]): r["median_s"] for r in payload["rows"]}
    per_entry = {}
    for entry in entries:
        pattern = [entry.kinds[i % len(entry.kinds)] for i in range(recipe.n_layers)]
        per_entry[entry.label] = {str(c): statistics.fmean(median[(f"{entry.label} [{k}]", c)] for k in pattern) * 1e3 for c in contexts}
    rows = [{k: v for k, v in r.items() if k != "samples_s"} | {"samples_ms": [s * 1e3 for s in r["samples_s"]]} for r in payload["rows"]]
    return {"contexts": contexts, "settings": payload["settings"], "rows": rows, "per_entry": per_entry}


# ---------------------------------------------------------------- aggregation and claims


def summarize(values: list[float]) -> dict[str, Any]:
    """mean, sample std (n - 1; None for one value), min, max and n of ``values``."""
    if not values:
        raise ValueError("nothing to summarize: no values")
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def aggregate(entries: list[Entry], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per entry: seed statistics of val BPB, val CE and head diversity; the cache figures
    (the same for every seed: they depend on the shape only)."""
    out = []
    for entry in entries:
        mine = [r for r in runs if r["label"] == entry.label]
        first = mine[0]
        ratios = {round(r["cache"]["ratio_to_mha"], 12) for r in mine}
        if len(ratios) != 1:
            raise ValueError(f"entry {entry.label!r}: the cache size differs between seeds ({sorted(ratios)}); the runs do not share one shape")
        diversity = [r["diversity"]["mean_r_eff_over_heads"] for r in mine if r["diversity"]["mean_r_eff_over_heads"] is not None]
        speeds = [r["train_tokens_per_s"] for r in mine if r.get("train_tokens_per_s")]
        out.append(
            {
                "label": entry.label,
                "seeds": [r["seed"] for r in mine],
                "parameters": first["parameters"],
                "cache": first["cache"],
                "val_bpb": summarize([r["val_bpb"] for r in mine]),
                "val_ce": summarize([r["val_ce"] for r in mine]),
                "r_eff_over_heads": summarize(diversity) if diversity else None,
                "train_tokens_per_s": summarize(speeds) if speeds else None,
            }
        )
    return out


def compare_pair(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Whether the seeds resolve the val-BPB difference of aggregate rows ``a`` and ``b``.

    The rule: both need >= ``MIN_SEEDS_FOR_CLAIM`` seeds, every seed of one must lie below every
    seed of the other (the [min, max] ranges do not overlap) and the difference of the means must
    exceed the sum of the two stds. Otherwise no claim is made. ``delta`` = mean(a) - mean(b)
    (negative: a has lower BPB)."""
    sa, sb = a["val_bpb"], b["val_bpb"]
    delta = sa["mean"] - sb["mean"]
    spread = None if sa["std"] is None or sb["std"] is None else sa["std"] + sb["std"]
    if min(sa["n"], sb["n"]) < MIN_SEEDS_FOR_CLAIM:
        verdict = f"no claim: {min(sa['n'], sb['n'])} seed(s); a claim needs >= {MIN_SEEDS_FOR_CLAIM} seeds per entry"
    elif (sa["max"] < sb["min"] or sb["max"] < sa["min"]) and abs(delta) > spread:
        side = "lower" if delta < 0 else "higher"
        verdict = f"{a['label']} {side} BPB than {b['label']} (seed ranges apart, |difference| > std sum)"
    else:
        verdict = "within the spread: no claim"
    return {"a": a["label"], "b": b["label"], "delta_bpb": delta, "sum_of_stds": spread, "verdict": verdict}


def comparisons(rows: list[dict[str, Any]], reference: str | None = None) -> list[dict[str, Any]]:
    """Every entry against the reference (``mha`` if present, else the first entry)."""
    labels = [r["label"] for r in rows]
    ref_label = reference if reference in labels else (REFERENCE if REFERENCE in labels else labels[0])
    ref = rows[labels.index(ref_label)]
    return [compare_pair(r, ref) for r in rows if r["label"] != ref_label]


# ---------------------------------------------------------------- the report


def fmt_stat(stat: dict[str, Any] | None, digits: int = 4) -> str:
    """``mean ± std [min, max]``, or ``mean (1 seed)``."""
    if stat is None:
        return "-"
    if stat["n"] == 1:
        return f"{stat['mean']:.{digits}f} (1 seed)"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f} [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]"


def recipe_text(recipe: dict[str, Any]) -> str:
    return (
        f"{recipe['dataset']}, d_model {recipe['d_model']}, {recipe['n_layers']} layers, {recipe['n_heads']} heads, "
        f"seq_len {recipe['seq_len']}, batch {recipe['batch_size']}x{recipe['grad_accum']}, {recipe['steps']} steps, "
        f"lr {recipe['lr']}, {recipe['mlp']} MLP"
    )


def _options_text(entry: dict[str, Any]) -> str:
    parts = []
    for kind, options in entry["options"].items():
        text = ",".join(f"{k}={v}" for k, v in options.items()) or "-"
        parts.append(f"{kind}: {text}" if len(entry["options"]) > 1 else text)
    return "; ".join(parts)


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md`` from ``report.json`` alone (deterministic: the same JSON gives the same text)."""
    entries = {e["label"]: e for e in report["entries"]}
    contexts = report["decode"]["contexts"]
    top = str(contexts[-1]) if contexts else None
    seeds = report["seeds"]
    lines = [
        f"# {report['title']}",
        "",
        f"Recipe (identical for every entry; only the attention changes): {recipe_text(report['recipe'])}.",
        f"Seeds: {', '.join(map(str, seeds))} ({len(seeds)} per entry). Val = the dataset's held-out split, "
        f"{report['eval_tokens'] if report['eval_tokens'] else 'all'} tokens per run; BPB = total NLL / (ln 2 x UTF-8 bytes).",
        f"Cache measured from the cache tensors after prefilling {report['aggregate'][0]['cache']['context']} tokens "
        f"({report['aggregate'][0]['cache']['dtype']}, batch 1); ratio = to MHA of the same shape.",
        "",
        "| entry | options | params | cache B/token/layer | B/token (model) | vs MHA | val BPB mean ± std [min, max] | val CE (nats) | head diversity r_eff/H"
        + (f" | decode ms/token/layer @ {top}" if top else "") + " | train tok/s |",
        "|---|---|---:|---:|---:|---:|---|---|---|" + ("---:|" if top else "") + "---:|",
    ]
    for row in report["aggregate"]:
        cache = row["cache"]
        decode = f" | {report['decode']['per_entry'][row['label']][top]:.3f}" if top else ""
        speed = f"{row['train_tokens_per_s']['mean']:,.0f}" if row["train_tokens_per_s"] else "-"
        check = "" if cache["measured_equals_analytic"] else " (measured != analytic!)"
        lines.append(
            f"| {row['label']} | {_options_text(entries[row['label']])} | {row['parameters']:,} | {cache['bytes_per_token_per_layer']:.1f}{check} | "
            f"{cache['bytes_per_token_model']:.1f} | {cache['ratio_to_mha']:.3f} | {fmt_stat(row['val_bpb'])} | {fmt_stat(row['val_ce'])} | "
            f"{fmt_stat(row['r_eff_over_heads'], 3)}{decode} | {speed} |"
        )
    lines += ["", "## Differences in val BPB against the reference", ""]
    lines.append(
        f"A difference is claimed only with >= {MIN_SEEDS_FOR_CLAIM} seeds on both sides, non-overlapping seed ranges "
        "and |difference of means| > std(entry) + std(ref); otherwise no entry is called better."
    )
    lines.append("")
    lines.append("| entry | reference | mean difference | std(entry) + std(ref) | verdict |")
    lines.append("|---|---|---:|---:|---|")
    for c in report["comparisons"]:
        spread = "-" if c["sum_of_stds"] is None else f"{c['sum_of_stds']:.4f}"
        lines.append(f"| {c['a']} | {c['b']} | {c['delta_bpb']:+.4f} | {spread} | {c['verdict']} |")
    if contexts:
        settings = report["decode"]["settings"]
        lines += [
            "",
            "## Decode latency (ms per token, one layer)",
            "",
            f"One layer per kind at the recipe's width ({settings['n_heads']} heads x {settings['head_dim']}, d_model {settings['d_model']}, "
            f"batch {settings['batch']}, {settings['dtype']}, {settings['device']}), untrained weights, cache filled with random inputs; "
            f"median of {settings['rounds']} interleaved rounds x {settings['repeats']} calls. A layer pattern shows the mean over its layers.",
            "",
            "| entry | " + " | ".join(f"@ {c}" for c in contexts) + " |",
            "|---|" + "---:|" * len(contexts),
        ]
        for label, per in report["decode"]["per_entry"].items():
            lines.append(f"| {label} | " + " | ".join(f"{per[str(c)]:.3f}" for c in contexts) + " |")
    lines += ["", "## Options of each entry", ""]
    for e in report["entries"]:
        defaults = "; ".join(f"{k}: {v}" for k, v in e["defaults"].items())
        lines.append(f"- **{e['label']}**: layers {'/'.join(e['kinds'])}; {_options_text(e)}" + (f" ({defaults})" if defaults else ""))
    lines += ["", "## Runs", "", "| entry | seed | val BPB | val CE | r_eff/H | run |", "|---|---:|---:|---:|---:|---|"]
    for r in report["runs"]:
        div = r["diversity"]["mean_r_eff_over_heads"]
        lines.append(f"| {r['label']} | {r['seed']} | {r['val_bpb']:.4f} | {r['val_ce']:.4f} | {'-' if div is None else f'{div:.3f}'} | {r['run_dir']} |")
    lines += ["", f"Plots: {PLOT_BPB}" + (f", {PLOT_DECODE}" if contexts else "") + "."]
    machine = report["machine"]
    lines.append(f"Machine: {machine.get('cpu_model', machine.get('processor'))}, {machine['cpu_count']} CPUs, torch {machine['torch']}, {machine['threads']} threads.")
    return "\n".join(lines) + "\n"


def plot_bpb_vs_cache(report: dict[str, Any]):
    """Val BPB (mean, error bar = std over seeds) against the cache ratio to MHA; variants of one
    kind are joined by a line in order of cache size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = {e["label"]: e for e in report["entries"]}
    fig, ax = plt.subplots(figsize=(7, 4.8))
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for row in report["aggregate"]:
        x, stat = row["cache"]["ratio_to_mha"], row["val_bpb"]
        ax.errorbar(x, stat["mean"], yerr=stat["std"] or 0.0, fmt="o", capsize=4, label=row["label"])
        ax.annotate(row["label"], (x, stat["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        kinds = entries[row["label"]]["kinds"]
        if len(kinds) == 1:
            by_kind.setdefault(kinds[0], []).append((x, stat["mean"]))
    for points in by_kind.values():
        if len(points) > 1:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, color="grey", linewidth=0.8, alpha=0.6)
    n = len(report["seeds"])
    ax.set_xlabel(f"cache bytes per token / MHA's (after {report['aggregate'][0]['cache']['context']} tokens)")
    ax.set_ylabel("val bits per byte (lower is better)")
    ax.set_title("\n".join(textwrap.wrap(f"{report['title']}: {recipe_text(report['recipe'])}; mean ± std over {n} seed(s)", 90)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_decode(report: dict[str, Any]):
    """Decode ms per token per layer against context, one line per entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = report["decode"]["contexts"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, per in report["decode"]["per_entry"].items():
        ax.plot(contexts, [per[str(c)] for c in contexts], marker="o", label=label)
    s = report["decode"]["settings"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("ms per decoded token (one layer, median)")
    ax.set_title(f"{s['n_heads']}x{s['head_dim']} heads, d_model {s['d_model']}, batch {s['batch']}, {s['dtype']}, {s['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report_files(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.md and the PNGs of ``report`` into ``out_dir``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    write_text(md, render_markdown(report))
    written = [md]
    save_figure(plot_bpb_vs_cache(report), out_dir / PLOT_BPB, tight=False)
    written.append(out_dir / PLOT_BPB)
    if report["decode"]["contexts"]:
        save_figure(plot_decode(report), out_dir / PLOT_DECODE, tight=False)
        written.append(out_dir / PLOT_DECODE)
    return written


def load_report(path: str | Path) -> dict[str, Any]:
    """A ``report.json`` written by ``run_compare``."""
    from slimkv.files import read_json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; create it with `slimkv compare --kinds ... --out DIR`")
    report = read_json(path)
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT or "aggregate" not in report:
        raise ValueError(f"{path} is not a report.json of `slimkv compare` (format {REPORT_FORMAT})")
    return report


# ---------------------------------------------------------------- the whole comparison


def run_compare(
    entries: list[Entry],
    recipe: TrainConfig,
    seeds: list[int],
    out_dir: str | Path,
    *,
    eval_tokens: int | None = DEFAULT_EVAL_TOKENS,
    decode_contexts: list[int] | tuple[int, ...] = DEFAULT_DECODE_CONTEXTS,
    decode_repeats: int = 5,
    title: str = "Attention comparison",
    progress: bool = True,
    prepare: Any = None,
) -> dict[str, Any]:
    """Train, evaluate and measure every entry x seed, aggregate, write ``report.json``,
    ``report.md`` and the plots into ``out_dir``, print the table; returns the report.

    ``prepare``: a callable run once before training (e.g. preparing the dataset)."""
    from slimkv.bench.timing import machine_info
    from slimkv.files import write_json

    configs = {(e.label, s): config_for(e, recipe, s) for e in entries for s in seeds}  # every error before any work
    out_dir = Path(out_dir)
    started = time.perf_counter()
    if prepare is not None:
        prepare()
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    total = len(configs)
    for i, ((label, seed), cfg) in enumerate(configs.items(), 1):
        run_dir = out_dir / "runs" / run_slug(label) / f"seed{seed}"
        print(f"[{i}/{total}] {label} seed {seed}: {run_dir}", flush=True)
        t0 = time.perf_counter()
        row, reused = train_and_evaluate(cfg, run_dir, eval_tokens=eval_tokens, progress=progress)
        runs.append({"label": label, **row, "reused": reused})
        state = f"reused the finished run in {run_dir} ({RUN_FILE})" if reused else f"trained and evaluated in {time.perf_counter() - t0:.0f} s"
        print(f"[{i}/{total}] {label} seed {seed}: val BPB {row['val_bpb']:.4f}, CE {row['val_ce']:.4f}, cache {row['cache']['ratio_to_mha']:.3f} of MHA; {state}", flush=True)
    decode_contexts = list(decode_contexts)
    if decode_contexts:
        print(f"decode latency: one layer per kind at contexts {', '.join(map(str, decode_contexts))}", flush=True)
    decode = measure_decode(entries, recipe, decode_contexts, repeats=decode_repeats)
    rows = aggregate(entries, runs)
    report = {
        "format": REPORT_FORMAT,
        "title": title,
        "recipe": {k: v for k, v in recipe.to_dict().items() if k not in ("attention", "attention_options", "kind_options", "seed")},
        "seeds": seeds,
        "eval_tokens": eval_tokens,
        "entries": [e.to_dict() for e in entries],
        "runs": runs,
        "aggregate": rows,
        "comparisons": comparisons(rows),
        "decode": decode,
        "machine": machine_info(),
        "wall_seconds": time.perf_counter() - started,
        "reused_runs": sum(r["reused"] for r in runs),
    }
    write_json(out_dir / "report.json", report)
    written = write_report_files(report, out_dir)
    print()
    print(render_markdown(report).split("\n## Options")[0])
    print(f"wall time {report['wall_seconds']:.0f} s ({report['reused_runs']} of {total} runs reused); wrote {out_dir / 'report.json'}, " + ", ".join(str(p) for p in written))
    return report


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

