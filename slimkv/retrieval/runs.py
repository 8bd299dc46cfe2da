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

Small models trained here retrieve only when trained with the needle mixture
(``TrainConfig.needle_mix``): then the mechanism, not model scale, is what this measures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from slimkv.common.checks import check_int
from slimkv.common.files import check_file_target, check_folder_target, check_writable, save_figure, write_json
from slimkv.common.plotting import new_figure
from slimkv.data.ruler_needles import NEUTRAL_TEXT, NeedleBuilder, NeedleDocument, random_key, random_value, value_found
from slimkv.train.checkpoint import load_run

TASKS: dict[str, dict[str, str]] = {
    "s1": {"haystack": "neutral", "value": "number", "description": "repeated neutral sentences, 7-digit number"},
    "s2": {"haystack": "prose", "value": "number", "description": "held-out prose (val split), 7-digit number"},
    "s3": {"haystack": "prose", "value": "uuid", "description": "held-out prose (val split), UUID"},
}
RESULT_FILE = "niah.json"
PLOT_FILE = "niah.png"
EXAMPLE_DEPTH = 0.5  # the depth whose first sample per length is kept as an example output


def parse_lengths(text: str, train_len: int) -> list[int]:
    """``"1x,2x,4x,300"`` -> token counts (``Nx`` = N times the training length), in order given."""
    lengths = []
    for part in (p.strip() for p in str(text).split(",")):
        try:
            value = round(float(part[:-1]) * train_len) if part.lower().endswith("x") else int(part)
        except (ValueError, OverflowError):  # infx, 1e999k: no integer
            raise ValueError(f"--lengths: {part!r} is not a token count or a multiple like 2x of the training length") from None
        check_int("--lengths entry", value, 1)
        lengths.append(value)
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths lists a length twice: {lengths}")
    return lengths


def parse_depths(text: str) -> list[float]:
    """``"0,0.25,1"`` -> fractions in [0, 1] (0 = the first line of the haystack, 1 = the last)."""
    try:
        depths = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--depths must be comma-separated fractions in [0, 1], got {text!r}") from None
    if not depths or any(not (0.0 <= d <= 1.0) for d in depths):
        raise ValueError(f"--depths must be comma-separated fractions in [0, 1], got {text!r}")
    return depths


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"--tasks: {task!r} is not allowed; allowed values: {', '.join(TASKS)}")
    if not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"--tasks must name each of {', '.join(TASKS)} at most once, got {text!r}")
    return tasks


def build_prompts(builder: NeedleBuilder, task: str, source: np.ndarray, length: int, depths: list[float], samples: int, seed: int) -> list[list[NeedleDocument]]:
    """Prompts [depth][sample] of exactly ``length`` tokens for one task and length."""
    task_index = list(TASKS).index(task)
    grid: list[list[NeedleDocument]] = [[] for _ in depths]
    for sample in range(samples):
        rng = np.random.default_rng([seed, task_index, length, sample])
        key, value = random_key(rng), random_value(rng, TASKS[task]["value"])
        start = int(rng.integers(len(source)))
        for column, depth in enumerate(depths):
            grid[column].append(builder.build(source, start, length, depth, key, value))
    return grid


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
    prompts = {(task, length): build_prompts(builder, task, sources[TASKS[task]["haystack"]], length, depths, samples, seed) for task in tasks for length in lengths}
    was_training = model.training
    model.eval()
    results: dict[str, Any] = {}
    bar = tqdm(total=len(tasks) * len(lengths) * len(depths), desc="niah", unit="cell", disable=not progress)
    for task in tasks:
        grid, token_grid, nll_grid, actual_depth, examples, value_tokens = [], [], [], [], [], 0
        for length in lengths:
            row, token_row, nll_row, row_depth = [], [], [], []
            for depth, docs in zip(depths, prompts[task, length]):
                outputs = [dataset.decode(ids) for ids in greedy_continuations(model, [d.ids for d in docs], max_new_tokens, batch_size)]
                hits = [value_found(d.value, text) for d, text in zip(docs, outputs)]
                row.append(sum(hits) / len(hits))
                token_accuracy, token_nll = value_token_scores(model, builder, docs, batch_size)
                token_row.append(token_accuracy)
                nll_row.append(token_nll)
                row_depth.append(float(np.mean([d.depth for d in docs])))
                value_tokens = max(value_tokens, *(len(dataset.encode(f" {d.value}")) for d in docs))
                if depth == min(depths, key=lambda x: abs(x - EXAMPLE_DEPTH)):
                    examples.append({"length": length, "depth": depth, "key": docs[0].key, "value": docs[0].value, "output": outputs[0], "hit": hits[0]})
                bar.update()
            grid.append(row)
            token_grid.append(token_row)
            nll_grid.append(nll_row)
            actual_depth.append(row_depth)
        results[task] = {
            **TASKS[task],
            "accuracy": grid,
            "mean_per_length": [float(np.mean(r)) for r in grid],
            "mean": float(np.mean(grid)),
            "value_token_accuracy": token_grid,
            "value_token_accuracy_per_length": [float(np.mean(r)) for r in token_grid],
            "value_token_nll": nll_grid,
            "value_token_nll_per_length": [float(np.mean(r)) for r in nll_grid],
            "needle_depth_actual": actual_depth,
            "value_tokens_max": value_tokens,
            "examples": examples,
        }
    bar.close()
    model.train(was_training)
    return results


def niah_report(run_dir: str | Path, *, tasks: list[str], lengths: str, depths: str, samples: int, max_new_tokens: int, seed: int, batch_size: int, out_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Evaluate a run directory; writes ``niah.json`` and ``niah.png`` into ``out_dir`` (default RUN_DIR)."""
    run_dir = Path(run_dir)
    if out_dir is not None:
        check_folder_target(out_dir)
        check_writable(out_dir)
    model, cfg, dataset = load_run(run_dir)
    target = Path(out_dir) if out_dir is not None else run_dir
    for name in (RESULT_FILE, PLOT_FILE):  # a folder in their place fails now, not after the work
        check_file_target(target / name, "--out" if out_dir is not None else "RUN_DIR")
    length_list, depth_list = parse_lengths(lengths, cfg.seq_len), parse_depths(depths)
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
    plot_grids(report, target / PLOT_FILE)
    return report


def plot_grids(report: dict[str, Any], path: Path) -> None:
    """One heatmap per task: depth (rows) x length (columns), accuracy annotated; atomic PNG."""
    tasks = list(report["tasks"])
    width = max(3.4, 0.9 * len(report["lengths"]) + 1.0)
    fig, axes = new_figure(1, len(tasks), figsize=(width * len(tasks) + 1.0, 2.2 + 0.45 * len(report["depths"])), squeeze=False, layout="constrained")
    for index, (ax, task) in enumerate(zip(axes[0], tasks)):
        grid = np.asarray(report["tasks"][task]["accuracy"]).T  # (depths, lengths)
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black", fontsize=8)
        means = report["tasks"][task]["mean_per_length"]
        ax.set_xticks(range(len(report["lengths"])), [f"{n}\n({m:.2f})" for n, m in zip(report["lengths"], means)], fontsize=8)
        ax.set_yticks(range(len(report["depths"])), [f"{d:.0%}" for d in report["depths"]], fontsize=8)
        ax.set_xlabel("length in tokens\n(mean accuracy)", fontsize=8)
        if index == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{task}: {report['tasks'][task]['description'].replace(', ', chr(10))}", fontsize=8)
    kind = report["attention"] if isinstance(report["attention"], str) else "/".join(report["attention"])
    fig.suptitle(f"NIAH {kind}, trained at {report['train_seq_len']} tokens (needle_mix {report['needle_mix']}), {report['samples']} samples per cell", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03)
    save_figure(fig, path)


def format_table(report: dict[str, Any]) -> str:
    """Per task: accuracy by depth (rows) and length (columns), then the mean per length."""
    kind = report["attention"] if isinstance(report["attention"], str) else "/".join(report["attention"])
    lines = [
        f"NIAH {kind} ({report['run_dir']}), trained at {report['train_seq_len']} tokens, needle_mix {report['needle_mix']}; "
        f"{report['samples']} samples per cell, greedy, {report['max_new_tokens']} new tokens, seed {report['seed']}",
        f"prose haystack (s2, s3): {report['prose_haystack']}",
    ]
    header = f"  {'depth':>6} " + " ".join(f"{n:>7}" for n in report["lengths"])
    for task, result in report["tasks"].items():
        lines += [f"{task}: {result['description']}", header]
        grid = np.asarray(result["accuracy"])
        for j, depth in enumerate(report["depths"]):
            lines.append(f"  {depth:>6.0%} " + " ".join(f"{grid[i, j]:>7.2f}" for i in range(len(report["lengths"]))))
        lines.append(f"  {'mean':>6} " + " ".join(f"{m:>7.2f}" for m in result["mean_per_length"]))
        lines.append(f"  {'tokens':>6} " + " ".join(f"{m:>7.2f}" for m in result["value_token_accuracy_per_length"])
                     + "   (teacher-forced value-token accuracy, mean over depths)")
        if result["value_tokens_max"] > report["max_new_tokens"]:
            lines.append(f"  WARNING: {task} values take up to {result['value_tokens_max']} tokens but only {report['max_new_tokens']} are generated; raise --max-new-tokens")
    return "\n".join(lines)


