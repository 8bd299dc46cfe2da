"""Needle in a haystack on slimkv training runs (``slimkv eval niah RUN_DIR``): RULER-style
single-needle retrieval over a length x depth grid.

Tasks (docs/evaluation.md, "Needle in a haystack"):

- ``s1``: haystack = a few neutral sentences repeated; value = a 7-digit number;
- ``s2``: haystack = held-out prose, the val split of the run's dataset (never used for training;
  for Shakespeare, the four held-out plays); value = a 7-digit number;
- ``s3``: like s2 with a UUID value.

Each prompt is exactly ``length`` tokens: haystack with the needle line ("One of the special
magic numbers for {key} is: {value}.") at the line boundary nearest the requested depth, then the
question (``slimkv.data.ruler_needles``). The model continues it greedily (``generate()``, through its
own caches) for ``max_new_tokens``; a sample scores 1 when the value appears in the continuation
(case-insensitive, as a whole). Beside that exact match, each cell reports the teacher-forced
accuracy and NLL of the value's tokens (``value_token_scores``): a graded measure that still
moves when a small model retrieves some digits but never the whole value. For each (task, length, sample) the key, value and haystack are
drawn once from ``(seed, task, length, sample)``, so across depths only the needle's place changes.

The cells run through ``slimkv.retrieval.grid`` (its length grammar: ``2x`` is a multiple of the
run's training length); the report is its depth x length table per task and its heatmaps.

Small models trained here retrieve only when trained with the needle mixture
(``TrainConfig.needle_mix``): then the mechanism, not model scale, is what this measures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from slimkv.common.checks import check_int
from slimkv.common.files import report_folder, write_json
from slimkv.data.ruler_needles import NEUTRAL_TEXT, NeedleBuilder, NeedleDocument, random_key, random_value, value_found
from slimkv.retrieval.grid import Cell, build_prompts, grid_cells, grid_table, parse_depths, parse_lengths, plot_grids, run_grid
from slimkv.retrieval.grid import parse_tasks as grid_tasks
from slimkv.train.checkpoint import load_run

TASKS: dict[str, dict[str, str]] = {
    "s1": {"haystack": "neutral", "value": "number", "description": "repeated neutral sentences, 7-digit number"},
    "s2": {"haystack": "prose", "value": "number", "description": "held-out prose (val split), 7-digit number"},
    "s3": {"haystack": "prose", "value": "uuid", "description": "held-out prose (val split), UUID"},
}
RESULT_FILE = "niah.json"
PLOT_FILE = "niah.png"
EXAMPLE_DEPTH = 0.5  # the depth whose first sample per length is kept as an example output


def parse_tasks(text: str) -> list[str]:
    """``"s1,s3"`` -> task names of ``TASKS`` (``all`` = every one), by ``grid.parse_tasks``."""
    return grid_tasks(text, TASKS)


def build_document(builder: NeedleBuilder, sources: dict[str, np.ndarray], cell: Cell, sample: int, seed: int) -> NeedleDocument:
    """The prompt of one sample of ``cell``: exactly ``cell.length`` tokens; the key, value and
    haystack start come from ``(seed, task, length, sample)``, so across depths only the needle moves."""
    task = TASKS[cell.task]
    rng = np.random.default_rng([seed, list(TASKS).index(cell.task), cell.length, sample])
    key, value = random_key(rng), random_value(rng, task["value"])
    source = sources[task["haystack"]]
    return builder.build(source, int(rng.integers(len(source))), cell.length, cell.depth, key, value)


@torch.no_grad()
def greedy_continuations(model: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """Greedy new ids for equal-length ``prompts`` via ``model.generate`` (the model's caches)."""
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[first : first + batch_size], dtype=torch.long, device=device)
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outputs.extend(new[:, ids.shape[1] :].tolist())
    return outputs


@torch.no_grad()
def value_token_scores(model: Any, builder: NeedleBuilder, docs: list[NeedleDocument], batch_size: int) -> tuple[float, float]:
    """Teacher-forced scores of the value's tokens after each prompt: (fraction predicted exactly by
    argmax, mean NLL in nats). A graded view of retrieval that still moves when greedy exact match
    is 0 (chance for one digit of a number is 0.1). The scored tokens are the answer's
    ``" {value}"`` tokens, fed one after another (the model sees the true earlier ones)."""
    device = next(model.parameters()).device
    scored = [(d, builder.pieces(d.key, d.value, answer=True)[2], len(builder.encode(f" {d.value}"))) for d in docs]
    by_length: dict[int, list] = {}
    for item in scored:  # rows of one forward must have equal lengths
        by_length.setdefault(len(item[0].ids) + len(item[1]), []).append(item)
    correct, total, nll = 0, 0, 0.0
    for items in by_length.values():
        for first in range(0, len(items), batch_size):
            part = items[first : first + batch_size]
            ids = torch.tensor([d.ids + tail for d, tail, _ in part], dtype=torch.long, device=device)
            log_probs = model(ids[:, :-1]).logits.float().log_softmax(-1)
            for row, (doc, _, count) in enumerate(part):
                positions = torch.arange(len(doc.ids) - 1, len(doc.ids) - 1 + count, device=device)
                targets = ids[row, positions + 1]
                predicted = log_probs[row, positions]
                correct += int((predicted.argmax(-1) == targets).sum())
                nll += float(-predicted.gather(1, targets[:, None]).sum())
                total += count
    return correct / total, nll / total


def evaluate_niah(
    model: Any,
    dataset: Any,
    *,
    tasks: list[str],
    lengths: list[int],
    depths: list[float],
    samples: int,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy grids [length][depth] per task for ``model`` with ``dataset``'s tokenizer.

    All prompts are built (and bad lengths rejected) before any generation.
    """
    check_int("samples", samples, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("batch_size", batch_size, 1)
    builder = NeedleBuilder.for_dataset(dataset)
    sources = {"neutral": np.asarray(dataset.encode(NEUTRAL_TEXT), dtype=np.int64), "prose": np.asarray(dataset.val, dtype=np.int64)}
    cells = grid_cells(tasks, lengths, depths)
    prompts = build_prompts(cells, samples, lambda cell, sample: build_document(builder, sources, cell, sample, seed))
    was_training = model.training
    model.eval()
    measured: dict[Cell, dict[str, Any]] = {}
    run_grid(cells, lambda cell: measure_cell(model, dataset, builder, prompts[cell], max_new_tokens, batch_size), measured.__setitem__, desc="niah", progress=progress)
    model.train(was_training)
    example_depth = min(depths, key=lambda x: abs(x - EXAMPLE_DEPTH))
    results: dict[str, Any] = {}
    for task in tasks:
        rows = [[measured[Cell(task, n, d)] for d in depths] for n in lengths]  # [length][depth]
        grid, token_grid, nll_grid = ([[cell[name] for cell in row] for row in rows] for name in ("accuracy", "value_token_accuracy", "value_token_nll"))
        results[task] = {
            **TASKS[task],
            "accuracy": grid,
            "mean_per_length": [float(np.mean(r)) for r in grid],
            "mean": float(np.mean(grid)),
            "value_token_accuracy": token_grid,
            "value_token_accuracy_per_length": [float(np.mean(r)) for r in token_grid],
            "value_token_nll": nll_grid,
            "value_token_nll_per_length": [float(np.mean(r)) for r in nll_grid],
            "needle_depth_actual": [[cell["depth_actual"] for cell in row] for row in rows],
            "value_tokens_max": max(cell["value_tokens"] for row in rows for cell in row),
            "examples": [{"length": n, "depth": example_depth, **measured[Cell(task, n, example_depth)]["example"]} for n in lengths],
        }
    return results


def measure_cell(model: Any, dataset: Any, builder: NeedleBuilder, docs: list[NeedleDocument], max_new_tokens: int, batch_size: int) -> dict[str, Any]:
    """One cell's scores: exact-match accuracy of the greedy continuations, the value tokens'
    teacher-forced accuracy and NLL, the needle's mean actual depth, the most tokens a value
    takes, and the first sample as an example."""
    outputs = [dataset.decode(ids) for ids in greedy_continuations(model, [d.ids for d in docs], max_new_tokens, batch_size)]
    hits = [value_found(d.value, text) for d, text in zip(docs, outputs)]
    token_accuracy, token_nll = value_token_scores(model, builder, docs, batch_size)
    return {"accuracy": sum(hits) / len(hits), "value_token_accuracy": token_accuracy, "value_token_nll": token_nll,
            "depth_actual": float(np.mean([d.depth for d in docs])), "value_tokens": max(len(dataset.encode(f" {d.value}")) for d in docs),
            "example": {"key": docs[0].key, "value": docs[0].value, "output": outputs[0], "hit": hits[0]}}


def niah_report(run_dir: str | Path, *, tasks: list[str], lengths: str, depths: str, samples: int, max_new_tokens: int, seed: int, batch_size: int, out_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Evaluate a run directory; writes ``niah.json`` and ``niah.png`` into ``out_dir`` (default RUN_DIR)."""
    run_dir = Path(run_dir)
    target = report_folder(run_dir, out_dir, (RESULT_FILE, PLOT_FILE))
    model, cfg, dataset = load_run(run_dir)
    length_list, depth_list = parse_lengths(lengths, cfg.seq_len, reference_name="the training length"), parse_depths(depths)
    results = evaluate_niah(model, dataset, tasks=tasks, lengths=length_list, depths=depth_list, samples=samples, max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, progress=progress)
    report = {
        "run_dir": str(run_dir),
        "attention": cfg.attention,
        "attention_options": cfg.attention_options,
        "train_seq_len": cfg.seq_len,
        "needle_mix": getattr(cfg, "needle_mix", 0.0),
        "dataset": cfg.dataset,
        "prose_haystack": f"val split of dataset {cfg.dataset!r} (held out from training)",
        "lengths": length_list,
        "length_multiples": [n / cfg.seq_len for n in length_list],
        "depths": depth_list,
        "samples": samples,
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "score": "value appears in the continuation (case-insensitive, not inside a longer alphanumeric run)",
        "value_token_score": "teacher-forced: fraction of the ' {value}' tokens predicted exactly by argmax given the prompt and the true earlier tokens; NLL in nats per token",
        "seed": seed,
        "tasks": results,
    }
    target.mkdir(parents=True, exist_ok=True)
    write_json(target / RESULT_FILE, report)
    plot_report(report, target / PLOT_FILE)
    return report


def plot_report(report: dict[str, Any], path: Path) -> None:
    """The report's heatmaps (``grid.plot_grids``): one per task, depth x length, accuracy
    annotated, each length's mean accuracy under it."""
    tasks = report["tasks"]
    panels = {f"{task}: {r['description'].replace(', ', chr(10))}": np.asarray(r["accuracy"]).T for task, r in tasks.items()}  # (depths, lengths)
    labels = {title: [f"{n}\n({m:.2f})" for n, m in zip(report["lengths"], r["mean_per_length"])] for title, r in zip(panels, tasks.values())}
    plot_grids(panels, report["lengths"], report["depths"], path, length_labels=labels, xlabel="length in tokens\n(mean accuracy)",
               suptitle=f"NIAH {_kind(report)}, trained at {report['train_seq_len']} tokens (needle_mix {report['needle_mix']}), {report['samples']} samples per cell")


def format_table(report: dict[str, Any]) -> str:
    """Per task: accuracy by depth (rows) and length (columns), then the mean per length and the
    value tokens' teacher-forced accuracy (markdown, ``grid.grid_table``)."""
    lines = [
        f"NIAH {_kind(report)} ({report['run_dir']}), trained at {report['train_seq_len']} tokens, needle_mix {report['needle_mix']}; "
        f"{report['samples']} samples per cell, greedy, {report['max_new_tokens']} new tokens, seed {report['seed']}",
        f"prose haystack (s2, s3): {report['prose_haystack']}",
    ]
    depth_index = {d: j for j, d in enumerate(report["depths"])}
    length_index = {n: i for i, n in enumerate(report["lengths"])}
    for task, result in report["tasks"].items():
        summary = [("mean", [f"{m:.2f}" for m in result["mean_per_length"]]),
                   ("value tokens (teacher-forced accuracy, mean over depths)", [f"{m:.2f}" for m in result["value_token_accuracy_per_length"]])]
        table = grid_table(report["lengths"], report["depths"], lambda n, d, r=result: r["accuracy"][length_index[n]][depth_index[d]], summary=summary)
        lines += ["", f"## {task}: {result['description']}", "", table]
        if result["value_tokens_max"] > report["max_new_tokens"]:
            lines += ["", f"WARNING: {task} values take up to {result['value_tokens_max']} tokens but only {report['max_new_tokens']} are generated; raise --max-new-tokens"]
    return "\n".join(lines)


def _kind(report: dict[str, Any]) -> str:
    return report["attention"] if isinstance(report["attention"], str) else "/".join(report["attention"])
