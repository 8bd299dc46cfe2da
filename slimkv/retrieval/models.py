"""Long-context retrieval of a pretrained, converted or compressed causal LM over a task x length x
depth grid (``slimkv eval niah --model``; docs/evaluation.md, "Long-context retrieval on
pretrained models").

Each prompt (``slimkv.retrieval.prompts``) goes through the model's own ``generate()`` and caches,
greedy, for the few tokens its answer needs; a prompt scores the fraction of its answers found in
the continuation (``value_found``: whole, case-insensitive), so 1 or 0 for a single needle. A cell
is (task, length, depth) over ``samples`` prompts; its score is the mean, with the count of
prompts fully answered and a 95% Wilson interval. Results are written after every cell, so an
interrupted run resumes where it stopped (same options, the same weights, by folder and content
sha256, however the model was named, and the same haystack text, by content sha256: else it
refuses; a results file whose cells are damaged is refused naming the file and the cell). The live
cache of one prompt per length is measured from the cache tensors (``slimkv.eval.cache``). The
cells run through ``slimkv.retrieval.grid``, as the training runs' do, and the report is its
depth x length table per task and its heatmaps.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slimkv.common.checks import check_float, check_int
from slimkv.common.files import (
    check_file_target,
    check_folder_target,
    check_writable,
    folder_lock,
    read_json,
    write_json,
    write_text,
)
from slimkv.data.ruler_needles import value_found
from slimkv.data.texts import evaluation_text, text_sha256
from slimkv.eval.cache import layer_bytes
from slimkv.eval.models import load_language_model
from slimkv.pretrained import LoadedModel
from slimkv.pretrained.loading import position_limit, weights_record
from slimkv.retrieval.grid import Cell, build_prompts, cell_id, grid_cells, grid_table, plot_grids, run_grid
from slimkv.retrieval.grid import parse_depths as parse_depths  # re-exported (slimkv eval ruler, benchmarks)
from slimkv.retrieval.grid import parse_lengths as parse_lengths
from slimkv.retrieval.prompts import TASKS, PromptBuilder, RetrievalPrompt, RetrievalTask
from slimkv.scoring import wilson

RESULT_FILE, TABLE_FILE, PLOT_FILE, PROMPTS_FILE = "niah.json", "niah.md", "niah.png", "niah_prompts.json"
PROMPTS_FORMAT = "slimkv-niah-prompts/1"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
ANSWER_ROOM = 64  # positions the default grid leaves for the answer after the longest prompt


def default_lengths(model: Any) -> list[int]:
    """1K, 2K, 4K, 8K where a prompt and its answer fit the model's positions; past that, the
    longest prompt that leaves ``ANSWER_ROOM`` positions (8128 for a model of 8192 positions)."""
    limit = position_limit(model)
    if limit is None:
        return list(DEFAULT_LENGTHS)
    fitting = [n for n in DEFAULT_LENGTHS if n + ANSWER_ROOM <= limit]
    if len(fitting) < len(DEFAULT_LENGTHS) and limit - ANSWER_ROOM > max(fitting, default=0):
        fitting.append(limit - ANSWER_ROOM)
    return fitting


def check_lengths(grid: dict[Cell, list[RetrievalPrompt]], model: Any) -> None:
    """Refuse prompts whose answer would run past the model's positions (``max_position_embeddings``):
    a prompt of ``length`` tokens generates ``max_new_tokens`` more, all at positions the model
    was trained for. The error names --lengths and the longest length that fits."""
    limit = position_limit(model)
    if limit is None:
        return
    too_long = sorted({p.length for cell in grid.values() for p in cell if p.length + p.max_new_tokens > limit})
    if too_long:
        room = max(p.max_new_tokens for cell in grid.values() for p in cell)
        raise ValueError(f"--lengths {', '.join(map(str, too_long))}: a prompt and its answer (up to {room} new tokens) run past this model's "
                         f"positions (max_position_embeddings={limit}); use lengths <= {limit - room}")


def score_output(answers: list[str], output: str) -> float:
    """The fraction of ``answers`` found (whole, case-insensitive) in ``output``."""
    return sum(value_found(a, output) for a in answers) / len(answers)


def build_grid(builder: PromptBuilder, tasks: list[RetrievalTask], lengths: list[int], depths: list[float], samples: int, seed: int) -> dict[Cell, list[RetrievalPrompt]]:
    """Every prompt of the grid, built (and checked) before any model runs; ValueError when the
    haystack's lines are too few to set two of the depths apart (needles sit at line starts, so
    both cells would hold the same prompts)."""
    grid = build_prompts(grid_cells([t.name for t in tasks], lengths, depths), samples, lambda c, s: builder.build(TASKS[c.task], c.length, c.depth, s, seed))
    for t in tasks:
        for n in lengths:
            for s in range(samples):
                placed: dict[float, float] = {}
                for d in depths:
                    actual = grid[Cell(t.name, n, d)][s].depth_actual
                    if actual in placed:
                        raise ValueError(f"--depths {placed[actual]:g} and {d:g} put the needle of a {n}-token {t.name} prompt on the same line (depth {actual:.2f}): "
                                         "the haystack has too few line breaks there; give depths further apart, longer --lengths, or a --haystack with shorter lines")
                    placed[actual] = d
    return grid


@torch.no_grad()
def generate(loaded: LoadedModel, prompts: list[RetrievalPrompt], batch_size: int) -> tuple[list[str], dict[str, Any]]:
    """Greedy continuations of equal-length ``prompts`` (each for its ``max_new_tokens``), and the
    live cache of the first batch: bytes per token processed, measured from its tensors."""
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    texts, measured = [], {}
    for first in range(0, len(prompts), batch_size):
        part = prompts[first : first + batch_size]
        ids = torch.tensor([p.ids for p in part], dtype=torch.long, device=device)
        new = max(p.max_new_tokens for p in part)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=pad, return_dict_in_generate=True)
        for row, p in enumerate(part):
            texts.append(tokenizer.decode(out["sequences"][row, ids.shape[1] : ids.shape[1] + p.max_new_tokens].tolist(), skip_special_tokens=True))
        if not measured:
            cache = out["cache"]
            tokens = cache.get_seq_length()
            total = sum(layer_bytes(cache))
            measured = {"cache_type": type(cache).__name__, "tokens": int(tokens), "batch": len(part), "bytes_per_token": total / len(part) / max(int(tokens), 1)}
    return texts, measured


def measure_cell(loaded: LoadedModel, cell: Cell, prompts: list[RetrievalPrompt], batch_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One cell's record for ``niah.json`` (scores, answers, outputs, seconds) and the live cache
    ``generate`` measured."""
    started = time.perf_counter()
    outputs, measured = generate(loaded, prompts, batch_size)
    scores = [score_output(p.answers, text) for p, text in zip(prompts, outputs)]
    record = {"task": cell.task, "length": cell.length, "depth": cell.depth, "score": float(np.mean(scores)), "scores": scores,
              "depth_actual": [p.depth_actual for p in prompts], "answers": [p.answers for p in prompts], "outputs": outputs,
              "seconds": time.perf_counter() - started}
    return record, measured


GRID_KEYS = ("tasks", "lengths", "depths")  # may change between runs into one --out: cells accumulate
NAMING_KEYS = ("model", "identity")  # how the model was named and what its loader says of it: shown, not fingerprinted (``weights`` is)


def fingerprint(settings: dict[str, Any]) -> str:
    """What a cell's content depends on (the weights by folder and content, samples, seed, haystack,
    dtype), not how the model was named nor which cells are asked for: a later run into the same
    --out may spell the model's path another way, or add lengths, depths or tasks."""
    fixed = {k: v for k, v in settings.items() if k not in GRID_KEYS + NAMING_KEYS}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def evaluate(
    model: str,
    *,
    tasks: list[RetrievalTask],
    lengths: list[int] | None = None,
    depths: list[float],
    samples: int,
    seed: int = 0,
    haystack: str = "shakespeare-val",
    batch_size: int = 1,
    out_dir: str | Path,
    progress: bool = True,
    export_prompts: bool = False,
) -> dict[str, Any]:
    """Run (or resume) the grid for ``model`` (anything ``load_language_model`` reads); writes
    ``niah.json`` after every cell, then ``niah.md`` and ``niah.png`` into ``out_dir``. With
    ``export_prompts`` also ``niah_prompts.json`` (the prompts as token ids, for other tools such
    as ``benchmarks/kvpress_niah.py``). Every option is checked and every prompt built before the
    first generation."""
    check_int("--samples", samples, 1)
    check_int("--batch-size", batch_size, 1)
    out_dir = Path(out_dir)
    check_folder_target(out_dir)
    check_writable(out_dir)
    for name in (RESULT_FILE, TABLE_FILE, PLOT_FILE) + ((PROMPTS_FILE,) if export_prompts else ()):  # a folder in their place fails now, not after the work
        check_file_target(out_dir / name, "--out")
    loaded = load_language_model(model)
    lengths = list(lengths or default_lengths(loaded.model))
    haystack_text = evaluation_text(haystack)
    builder = PromptBuilder(loaded.tokenizer, haystack_text)
    grid = build_grid(builder, tasks, lengths, depths, samples, seed)
    check_lengths(grid, loaded.model)
    settings = {"model": model, "identity": loaded.identity, "weights": weights_record(model), "tasks": [t.name for t in tasks], "lengths": lengths, "depths": depths, "samples": samples,
                "seed": seed, "haystack": haystack, "haystack_sha256": text_sha256(haystack_text), "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", "")}
    report = {"settings": settings, "fingerprint": fingerprint(settings), "cells": {}, "cache": {}}
    with folder_lock(out_dir, "eval niah run (into this --out)"):  # created here; a second run into it would overwrite this one's cells
        path = out_dir / RESULT_FILE
        if path.is_file():
            previous = read_results(path)
            if previous["fingerprint"] != report["fingerprint"]:
                refuse_resume(path, previous["settings"], settings)
            report["cells"], report["cache"] = previous["cells"], previous["cache"]
            for task, length, depth in grid:
                kept = report["cells"].get(cell_id(task, length, depth))
                if kept is not None and kept["depth"] != depth:
                    raise ValueError(f"{path} holds the cell {cell_id(task, length, depth)!r} at depth {kept['depth']:g}, not {depth:g}; "
                                     f"give --depths {kept['depth']:g} to reuse it, or another --out")
        if export_prompts:
            write_json(out_dir / PROMPTS_FILE, {"format": PROMPTS_FORMAT, "model": model, "settings": settings,
                                                "prompts": [p.to_json() for cell in grid.values() for p in cell]})

        def keep(cell: Cell, measured: tuple[dict[str, Any], dict[str, Any]]) -> None:  # written at once: an interrupted run resumes after it
            report["cells"][cell_id(*cell)] = measured[0]
            report["cache"].setdefault(str(cell.length), measured[1])
            write_json(path, report)

        done = {cell for cell in grid if cell_id(*cell) in report["cells"]}
        run_grid(list(grid), lambda cell: measure_cell(loaded, cell, grid[cell], batch_size), keep, done=done, desc=f"niah {Path(model).name}", progress=progress)
        summarize(report)
        write_json(path, report)
        write_text(out_dir / TABLE_FILE, format_markdown(report) + "\n")
        plot_report(report, out_dir / PLOT_FILE)
        return report


def refuse_resume(path: Path, before: dict[str, Any], settings: dict[str, Any]) -> None:
    """ValueError: ``path`` holds cells another run's settings produced; say which settings differ
    (for the haystack, whether the same file now holds another text) and what to do."""
    differ = sorted(k for k in set(settings) | set(before) if k not in GRID_KEYS + NAMING_KEYS and settings.get(k) != before.get(k))
    todo = "give another --out, or move that file away to start over (more tasks, lengths or depths with the same model and options are added to it)"
    if differ == ["haystack_sha256"]:
        recorded = before.get("haystack_sha256")
        why = (f"the text of --haystack {settings['haystack']!r} changed since (sha256 {recorded[:12]}... then, {settings['haystack_sha256'][:12]}... now)"
               if isinstance(recorded, str) else "they were written before the haystack's text was fingerprinted, so the text they read is unknown")
        raise ValueError(f"{path} holds results on another haystack text: {why}; its cells and new ones would not be comparable; {todo}")
    raise ValueError(f"{path} holds results of another model or other options (they differ in: {', '.join(differ) or 'the fingerprint'}); {todo}")


def read_results(path: Path) -> dict[str, Any]:
    """The results of an earlier run in ``path`` (``niah.json``), checked before they are kept
    beside new cells: its fingerprint and settings, and every cell and cache entry with the fields
    and value types this module writes; ValueError naming the file and the cell otherwise."""
    report = read_json(path, expect=dict)
    damaged = "the file was edited or damaged; move it away to start over (its cells are run again)"
    for key, kind in (("fingerprint", str), ("settings", dict), ("cells", dict), ("cache", dict)):
        if not isinstance(report.get(key), kind):
            raise ValueError(f"{path}: {key} is {report.get(key)!r}, not a JSON {'object' if kind is dict else 'string'}; {damaged}")
    for key, cell in report["cells"].items():
        try:
            check_cell(cell)
        except ValueError as err:
            raise ValueError(f"{path}: cell {key!r}: {err}; {damaged}") from None
        if key != cell_id(cell["task"], cell["length"], cell["depth"]):
            raise ValueError(f"{path}: cell {key!r} holds the cell {cell_id(cell['task'], cell['length'], cell['depth'])!r}; {damaged}")
    for length, measured in report["cache"].items():
        try:
            if not isinstance(measured, dict):
                raise ValueError(f"it is {measured!r}, not a JSON object")
            check_float("bytes_per_token", measured.get("bytes_per_token"), 0.0)
        except ValueError as err:
            raise ValueError(f"{path}: cache at length {length!r}: {err}; {damaged}") from None
    return report


def check_cell(cell: Any) -> None:
    """One cell of ``niah.json`` as ``evaluate`` writes it: ValueError naming the bad field."""
    if not isinstance(cell, dict):
        raise ValueError(f"it is {cell!r}, not a JSON object")
    if not isinstance(cell.get("task"), str):
        raise ValueError(f"task is {cell.get('task')!r}, not a task name")
    check_int("length", cell.get("length"), 1)
    check_float("depth", cell.get("depth"), 0.0, 1.0)
    check_float("score", cell.get("score"), 0.0, 1.0)
    check_float("seconds", cell.get("seconds"), 0.0)
    prompts = {}
    for name in ("scores", "depth_actual", "answers", "outputs"):
        if not isinstance(cell.get(name), list) or not cell[name]:
            raise ValueError(f"{name} is {cell.get(name)!r}, not a list with one entry per prompt")
        prompts[name] = len(cell[name])
    if len(set(prompts.values())) > 1:
        raise ValueError(f"its lists have different lengths ({', '.join(f'{k} {v}' for k, v in prompts.items())}), not one entry per prompt each")
    for index, score in enumerate(cell["scores"]):
        check_float(f"scores[{index}]", score, 0.0, 1.0)
    if abs(cell["score"] - sum(cell["scores"]) / len(cell["scores"])) > 1e-9:
        raise ValueError(f"score {cell['score']} is not the mean of its scores {cell['scores']}")
    if not all(isinstance(text, str) for text in cell["outputs"]):
        raise ValueError("outputs holds something that is not text")


def summarize(report: dict[str, Any]) -> None:
    """Per task and length: the mean score over depths, prompts fully answered / prompts, and the
    Wilson interval of that proportion; and the overall mean per length; over this run's grid
    (``settings``), while ``cells`` may hold more from earlier runs into the same folder. In place."""
    settings = report["settings"]
    summary: dict[str, Any] = {}
    for task in settings["tasks"]:
        rows = {}
        for length in settings["lengths"]:
            cells = [report["cells"][cell_id(task, length, d)] for d in settings["depths"]]
            scores = [s for c in cells for s in c["scores"]]
            hits = sum(s == 1.0 for s in scores)
            low, high = wilson(hits, len(scores))
            rows[str(length)] = {"score": float(np.mean(scores)), "full_hits": hits, "prompts": len(scores), "wilson95": [low, high]}
        summary[task] = rows
    report["summary"] = summary
    report["mean_per_length"] = {str(n): float(np.mean([summary[t][str(n)]["score"] for t in settings["tasks"]])) for n in settings["lengths"]}


def format_markdown(report: dict[str, Any]) -> str:
    """Per task a depth x length table of scores, then the per-length means with counts."""
    s = report["settings"]
    lines = [f"# Long-context retrieval: {s['model']}", "",
             f"{s['samples']} prompts per cell, greedy, haystack {s['haystack']!r} for the prose tasks, seed {s['seed']}, {s['dtype']}. "
             "Score: the fraction of the asked values found in the continuation.", ""]
    for task in s["tasks"]:
        rows = report["summary"][task]
        mean = [f"{rows[str(n)]['score']:.2f} ({rows[str(n)]['full_hits']}/{rows[str(n)]['prompts']}, {rows[str(n)]['wilson95'][0]:.2f}-{rows[str(n)]['wilson95'][1]:.2f})"
                for n in s["lengths"]]
        table = grid_table(s["lengths"], s["depths"], lambda n, d, task=task: report["cells"][cell_id(task, n, d)]["score"], summary=[("mean (full / prompts, 95% CI)", mean)])
        lines += [f"## {task}: {TASKS[task].description}", "", table, ""]
    cache = report.get("cache", {})
    if cache:
        lines.append("Live cache, bytes per token processed: " + ", ".join(f"{n}: {cache[str(n)]['bytes_per_token']:.0f}" for n in s["lengths"] if str(n) in cache))
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """The report's heatmaps (``grid.plot_grids``): one per task, depth x length, the score annotated."""
    s = report["settings"]
    panels = {task: [[report["cells"][cell_id(task, n, d)]["score"] for n in s["lengths"]] for d in s["depths"]] for task in s["tasks"]}
    plot_grids(panels, s["lengths"], s["depths"], path, suptitle=f"retrieval: {s['model']} ({s['samples']} prompts per cell)")
