"""The report of a ``slimkv eval ruler`` run (``slimkv.eval.ruler``): its grid, its markdown table, the
parts and lm-eval samples of its cells, and where in the prompt their needles were lost."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

BUDGET_TIERS = (0.125, 0.25, 0.5, 1.0, 2.0)
"""The budgets a comparison ranks methods at, as fractions of the bfloat16 original's cache bytes."""


def budget_tier(ratio: float) -> float:
    """The budget tier a cell belongs to: the nearest of ``BUDGET_TIERS`` to its measured bytes ratio (on a log scale)."""
    return min(BUDGET_TIERS, key=lambda t: abs(math.log(ratio / t)))


def in_report_order(cells: dict[str, dict[str, Any]], caches: list[str], previous_order: list[str], tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Cells by length, then task (in ``tasks``' order), then cache option: ``none`` first, then as the folder's
    report listed them before, then this run's ``caches`` order, then by name."""

    def key(item: tuple[str, dict[str, Any]]) -> tuple:
        k, c = item
        before = previous_order.index(k) if k in previous_order else len(previous_order)
        run = caches.index(c["option"]) if c["option"] in caches else len(caches)
        return (c["length"], tasks.index(c["task"]) if c["task"] in tasks else len(tasks), c["option"] != "none", before, run, c["option"])

    return dict(sorted(cells.items(), key=key))


def grid_of(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tasks, lengths, cache options and ``max_gen_toks`` per task of the cells a report holds."""
    rows = list(cells.values())
    return {"tasks": list(dict.fromkeys(r["task"] for r in rows)), "lengths": sorted({r["length"] for r in rows}),
            "caches": list(dict.fromkeys(r["option"] for r in rows)), "max_gen_toks": {r["task"]: r["max_gen_toks"] for r in rows}}


def ratio_text(row: dict[str, Any]) -> str:
    """The ratio to the bfloat16 original's bytes, and a masking press's live ratio beside it."""
    text = f"{row['bytes_ratio_to_bf16_original']:.3f}"
    live = row.get("bytes_ratio_live")
    return text + (f" (live {live:.3f})" if live is not None and abs(live - row["bytes_ratio_to_bf16_original"]) > 1e-3 else "")


def format_markdown(report: dict[str, Any]) -> str:
    """One row per finished cell: score, full / n with the Wilson interval, cache bytes and time."""
    s = report["settings"]
    lines = [f"# RULER (lm-eval {s['lm_eval']}): {s['model']}", "",
             f"{s['limit']} prompts per cell, greedy, max_gen_toks {s['max_gen_toks']}, seed {s['seed']}, model in {s['dtype']}. "
             "Score: lm-eval's metric. Cache bytes per token: the live cache after a prefill of the length; ratio to the bfloat16 original's "
             "(a kvpress press: measured after each prompt, its question tail included, counting the entries attention still sees; "
             "`live` is what its tensors hold where kvpress only masks).", "",
             "Score interval: the 95% Wilson interval for the niah tasks (each prompt 0 or 1), a 95% bootstrap interval of the mean "
             "for the partial-credit tasks (vt, cwe, fwe); `full / n`: the prompts lm-eval scored 1.", "",
             "| cache | task | length | score (95% CI) | full / n (95% CI) | bytes/token | ratio to bf16 | s/sample (generate) | load (start) |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in report["cells"].values():
        low, high = r.get("score95", r["wilson95"])
        lines.append(f"| {r['option']} | {r['task']} | {r['length']} | {r['score']:.3f} ({low:.2f}-{high:.2f}) | "
                     f"{r['full']}/{r['n']} ({r['wilson95'][0]:.2f}-{r['wilson95'][1]:.2f}) | "
                     f"{r['bytes_per_token']:,.0f} | {ratio_text(r)} | {r['seconds_per_sample']:.1f} ({r['generate_s_per_sample']:.1f}) | {r['load_average_start'][0]:.2f} |")
    if report.get("not_run"):
        lines += ["", "Not run (past --budget-minutes): " + ", ".join(report["not_run"])]
    return "\n".join(lines)


def read_samples(path: Path) -> list[dict[str, Any]]:
    """lm-eval's per-sample JSONL (one dict per prompt, as its ``EvaluationTracker`` writes them)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cell_parts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts of a finished cell's summary, each one ``simple_evaluate``: its first prompts (the
    summary's own files, load and threads; its seconds what the later parts leave of the total), then
    each ``added_prompts`` entry. A part: first prompt, count, seconds, seconds in ``generate()``, load,
    threads and lm-eval's two files (relative to the run's folder)."""
    added = summary.get("added_prompts", [])
    first = {"first": 0, "n": summary["n"] - sum(p["n"] for p in added), "seconds": summary["seconds"] - sum(p["seconds"] for p in added),
             "generate_s": summary["generate_s_per_sample"] * summary["n"] - sum(p["generate_s"] for p in added),
             **{k: summary[k] for k in ("load_average_start", "load_average_end", "threads", "lm_eval_results", "lm_eval_samples")}}
    return [first, *[dict(p) for p in added]]


DEPTH_BINS = 4
"""Needle depths are reported in this many equal bins of the prompt (``needle_depth_hits``)."""


def needle_depth_hits(summary: dict[str, Any], out_dir: str | Path, bins: int = DEPTH_BINS) -> list[tuple[int, int]] | None:
    """Per depth bin of the prompt, (prompts lm-eval scored 1, prompts) of a binary (niah) cell, over
    every part's samples file (``cell_parts``): a prompt's depth is where its answer (the first of
    lm-eval's ``outputs``) first appears in the prompt, as a fraction of the prompt's characters (bin i
    holds depths in [i / bins, (i + 1) / bins)). Where in the context a cache loses its needles;
    lm-eval's own per-sample metric, not rescored. None for a partial-credit cell or one with a
    samples file missing; a prompt without its answer in it counts in no bin."""
    paths = [Path(out_dir) / part["lm_eval_samples"] for part in cell_parts(summary)] if summary.get("binary") else []
    if not paths or not all(path.is_file() for path in paths):
        return None
    counts = [[0, 0] for _ in range(bins)]
    for sample in (s for path in paths for s in read_samples(path)):
        outputs = sample["doc"]["outputs"]
        answer = str((ast.literal_eval(outputs) if isinstance(outputs, str) else outputs)[0])
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        position = prompt.find(answer)
        if position < 0:
            continue
        cell = counts[min(bins - 1, int(bins * position / len(prompt)))]
        cell[0] += float(sample[str(summary["length"])]) == 1.0
        cell[1] += 1
    return [(hits, n) for hits, n in counts]
