"""``slimkv compare``: train every requested attention kind with ONE recipe, over several seeds,
and report quality against cache size (docs/evaluation.md, "Language-model quality" and "Cache size").

An *entry* is one labelled configuration of the attention (``slimkv.bench.entries``: ``mha``,
``lrkv:rank=8``, ``swa+kvm:swa.window=32``); options an entry does not set come from each kind's
comparable preset. Only the attention differs between entries.

For every entry and seed: train (``slimkv.train``), evaluate val CE/BPB on the held-out split
(``slimkv.eval.lm``, bytes denominator), measure the cache after prefilling ``seq_len`` tokens
(per layer, per model, ratio to MHA of the same shape) and the head diversity
(``slimkv.eval.diversity``). Once per entry (it does not depend on training): per-token decode
latency of ONE LAYER of each kind in the entry at the recipe's width, with a filled cache, at
each ``decode_contexts`` (``slimkv.bench.decode.decode_sweep``); a pattern reports the mean over
its layers. Seeds are aggregated as mean, sample std, min and max.

Resumable: each run directory ``OUT/runs/<entry>/seed<k>`` keeps ``compare_run.json`` once it is
trained and evaluated; a second invocation reuses it (and says so), and an interrupted training
resumes from its checkpoint. ``--workers 2`` trains two runs at once, each in its own process
(``slimkv.common.workers``). Separate processes may also share ``--out``: a run another holds is
skipped and left out of this report; rerun once all are done for one report of all.
``report.json`` holds everything; ``report.md`` and the PNGs are a pure function of it
(``slimkv report report.json`` regenerates them).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from slimkv.bench.decode import DecodeVariant, decode_sweep
from slimkv.bench.entries import Entry, config_for, run_folders
from slimkv.bench.report import REPORT_FORMAT, render_markdown, write_report_files
from slimkv.bench.statistics import aggregate, comparisons
from slimkv.common.files import FolderBusyError, check_folder_target, read_json, write_json
from slimkv.common.timing import machine_info
from slimkv.common.workers import check_workers, run_each, workers_note
from slimkv.eval.diversity import model_diversity
from slimkv.eval.lm import evaluate_run
from slimkv.train.checkpoint import has_checkpoint, load_run
from slimkv.train.config import TrainConfig
from slimkv.train.trainer import resolve_device, train

RUN_FILE = "compare_run.json"  # a finished (trained + evaluated) run of one entry and seed
DEFAULT_EVAL_TOKENS = 32768
DEFAULT_DECODE_CONTEXTS = (256, 1024, 4096)


# ---------------------------------------------------------------- one run: train, evaluate, measure


def train_and_evaluate(cfg: TrainConfig, run_dir: Path, *, eval_tokens: int | None, progress: bool, other_text: str | None = None) -> tuple[dict[str, Any], bool]:
    """(row, reused): train ``cfg`` into ``run_dir`` (resuming an interrupted run), evaluate it
    (and on ``other_text``) and measure cache and head diversity. A run whose ``compare_run.json``
    matches is reused."""
    marker = run_dir / RUN_FILE
    if marker.is_file():
        stored = read_json(marker)
        if stored.get("config") == cfg.to_dict() and stored.get("eval_tokens") == eval_tokens and stored.get("other_text") == other_text:
            return stored["row"], True
    summary = train(cfg, run_dir, resume=has_checkpoint(run_dir), progress=progress)
    result = evaluate_run(run_dir, max_tokens=eval_tokens, other_text=other_text, progress=progress, verbose=False)
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
        "other": result["other"],
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
    write_json(marker, {"config": cfg.to_dict(), "eval_tokens": eval_tokens, "other_text": other_text, "row": row})
    return row, False


def compare_run(cfg: TrainConfig, run_dir: Path, heading: str, eval_tokens: int | None, other_text: str | None, progress: bool) -> dict[str, Any]:
    """One entry and seed of a comparison (``train_and_evaluate``), in this process or a worker:
    {"busy": True} when another process holds ``run_dir``, else the row, whether it was reused
    and the seconds it took."""
    print(f"{heading}: {run_dir}", flush=True)
    started = time.perf_counter()
    try:
        row, reused = train_and_evaluate(cfg, run_dir, eval_tokens=eval_tokens, progress=progress, other_text=other_text)
    except FolderBusyError:
        return {"busy": True}
    return {"busy": False, "row": row, "reused": reused, "seconds": time.perf_counter() - started}


def compare_configs(entries: list[Entry], recipe: TrainConfig, seeds: list[int]) -> dict[tuple[str, int], TrainConfig]:
    """Every (entry label, seed) run's config, validated (ValueError names the option)."""
    return {(e.label, s): config_for(e, recipe, s) for e in entries for s in seeds}


def compare_calls(configs: dict[tuple[str, int], TrainConfig], out_dir: Path, *, eval_tokens: int | None, other_text: str | None,
                  progress: bool) -> tuple[list[Path], list[str], list[tuple[Any, ...]]]:
    """The runs of a comparison, in order: each (label, seed)'s folder, its heading and the
    arguments of ``compare_run`` (a caller may train them ahead, as the demo does; ``run_compare``
    then reuses them)."""
    run_dirs, headings = run_folders(out_dir, list(configs))
    calls = [(cfg, run_dir, heading, eval_tokens, other_text, progress) for cfg, run_dir, heading in zip(configs.values(), run_dirs, headings)]
    return run_dirs, headings, calls


def measure_decode(entries: list[Entry], recipe: TrainConfig, contexts: list[int], *, repeats: int = 5, rounds: int = 3) -> dict[str, Any]:
    """Per-token decode latency of one layer of each kind of each entry at the recipe's width
    (untrained weights, random inputs: latency does not depend on training), interleaved, at
    every context. Per entry: the mean over its layer pattern of its kinds' medians."""

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
    other_text: str | None = None,
    title: str = "Attention comparison",
    progress: bool = True,
    prepare: Any = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Train, evaluate and measure every entry x seed, aggregate, write ``report.json``,
    ``report.md`` and the plots into ``out_dir``, print the table; returns the report.

    ``prepare``: a callable run once before training (e.g. preparing the dataset). ``other_text``:
    a second evaluation text (``austen``: out of domain), reported beside val. ``workers``: runs
    trained at once, each in its own process on one torch thread (``slimkv.common.workers``; the
    same numbers as one at a time, no progress bars); the decode measurement stays in this process."""

    check_workers(workers)
    configs = compare_configs(entries, recipe, seeds)  # every error before any work
    out_dir = Path(out_dir)
    check_folder_target(out_dir)
    started = time.perf_counter()
    if prepare is not None:
        prepare()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(configs)
    if workers > 1:
        print(workers_note(workers), flush=True)
    labels = list(configs)
    run_dirs, headings, calls = compare_calls(configs, out_dir, eval_tokens=eval_tokens, other_text=other_text, progress=progress and workers == 1)
    outcomes: list[dict[str, Any]] = [{} for _ in calls]  # by index, whatever order the runs finish in
    for index, outcome in run_each(compare_run, calls, workers):
        outcomes[index] = outcome
        if outcome["busy"]:
            print(f"{headings[index]}: another process is training {run_dirs[index]}; left out of this report", flush=True)
            continue
        row = outcome["row"]
        state = f"reused the finished run in {run_dirs[index]} ({RUN_FILE})" if outcome["reused"] else f"trained and evaluated in {outcome['seconds']:.0f} s"
        print(f"{headings[index]}: val BPB {row['val_bpb']:.4f}, CE {row['val_ce']:.4f}, cache {row['cache']['ratio_to_mha']:.3f} of MHA; {state}", flush=True)
    runs = [{"label": label, **outcome["row"], "reused": outcome["reused"]} for (label, _), outcome in zip(labels, outcomes) if not outcome["busy"]]
    busy = [str(run_dir) for run_dir, outcome in zip(run_dirs, outcomes) if outcome["busy"]]
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
        "other_text": other_text,
        "entries": [e.to_dict() for e in entries],
        "runs": runs,
        "aggregate": rows,
        "comparisons": comparisons(rows),
        "comparisons_other": comparisons(rows, metric="other_bpb") if other_text else [],
        "decode": decode,
        "machine": machine_info(),
        "wall_seconds": time.perf_counter() - started,
        "reused_runs": sum(r["reused"] for r in runs),
        "busy_runs": busy,
    }
    write_json(out_dir / "report.json", report)
    written = write_report_files(report, out_dir)
    print()
    print(render_markdown(report).split("\n## Options")[0])
    print(f"wall time {report['wall_seconds']:.0f} s ({report['reused_runs']} of {total} runs reused); wrote {out_dir / 'report.json'}, " + ", ".join(str(p) for p in written))
    return report
