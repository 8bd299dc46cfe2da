"""RULER through lm-evaluation-harness (``slimkv eval ruler``; docs/ruler.md).

lm-eval's offline RULER tasks (their data generated on this machine from the model's tokenizer)
run on any model slimkv loads, under a named KV-cache option (``slimkv.eval.ruler_cache``). A
cell is (cache option, task, length): one ``lm_eval.simple_evaluate`` over the first ``limit``
prompts of that task and length, greedy, with ``max_gen_toks`` new tokens at most. lm-eval's
results JSON and per-sample JSONL stay in the cell's folder exactly as lm-eval writes them, its
metric is the score (never rescored here); slimkv's ``cell.json`` beside them adds the count, a 95%
Wilson interval of the prompts fully answered, seconds, load, and the live cache bytes per token
after a prefill of that length with the ratio to the bfloat16 original's. A finished cell (its
``cell.json``, written last and atomically) is skipped when the run is repeated, and a larger ``limit``
grows it: only the new prompts run (lm-eval's ``samples`` selects them), their files in a ``prompts-A-B``
folder inside the cell's, and the cell's score is the mean over all its prompts of lm-eval's per-prompt values.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from slimkv.common.checks import check_choice, check_float, check_int
from slimkv.common.files import check_folder_target, read_json, write_json, write_text
from slimkv.common.timing import machine_info, package_versions, write_results
from slimkv.data.austen import fetch_austen
from slimkv.eval import ruler_cache, ruler_press
from slimkv.eval.models import load_language_model, load_original, original_of
from slimkv.eval.ruler_offline import LOCAL_HAYSTACK, OFFLINE_TASKS, gen_tokens, haystack_file
from slimkv.eval.ruler_report import cell_parts, format_markdown, grid_of, in_report_order, read_samples
from slimkv.pretrained import LoadedModel, resolve_model_path
from slimkv.pretrained.loading import position_limit, weights_record
from slimkv.scoring import mean_interval, wilson

RESULT_NAME, TABLE_FILE, PROBES_FILE, CELL_FILE = "ruler", "ruler.md", "probes.json", "cell.json"
MIN_LENGTH = 1024
MODEL_DTYPES = ("float32", "bfloat16")  # --dtype: what the model runs in (a slimkv model's cache rows too)
INSTALL_HINT = "run `make ruler-env`, then `.venv-ruler/bin/slimkv eval ruler ...`"
def check_lm_eval() -> None:
    """lm-eval and the packages its RULER tasks import must be installed; ImportError saying how."""
    missing = [name for name in ("lm_eval", "wonderwords", "nltk") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"slimkv eval ruler needs lm-eval 0.4.13, wonderwords and nltk; not installed here: {', '.join(missing)}. {INSTALL_HINT}")


def check_lengths(lengths: list[int], model: torch.nn.Module) -> None:
    """Every length at least ``MIN_LENGTH`` and within the model's positions (RULER sizes prompt
    plus answer to the length); ValueError naming --lengths and the limit, before any work."""
    limit = position_limit(model)
    for length in lengths:
        if length < MIN_LENGTH or (limit is not None and length > limit):
            raise ValueError(f"--lengths {length}: RULER lengths run from {MIN_LENGTH} to the model's positions "
                             f"(max_position_embeddings={limit}); use --lengths within {MIN_LENGTH}..{limit}")


def cell_id(option: str, task: str, length: int) -> str:
    return f"{option}/{task}/{length}"


def summarize_cell(parts: list[tuple[dict[str, Any], list[dict[str, Any]]]], task: str, length: int) -> dict[str, Any]:
    """lm-eval's score of ``task`` at ``length`` (its metric named by the length) from the results
    JSON and samples of each part of a cell (one ``simple_evaluate``: the first prompts, then those
    a larger ``--limit`` added); for several parts, the mean of their scores weighted by their prompt
    counts (lm-eval's metric is a mean over prompts). Beside it the per-sample values lm-eval
    recorded, the prompts fully answered among them and the 95% Wilson interval of that proportion
    (for the binary tasks, the niah ones, the score's own interval), and ``score95``, a bootstrap
    interval of the mean score (for partial-credit tasks, vt, cwe, fwe, the interval to compare scores by)."""
    metric = f"{length},none"
    score, values = 0.0, []
    for results, samples in parts:
        part = [float(s[str(length)]) for s in samples]
        effective = results.get("n-samples", {}).get(task, {}).get("effective")
        if effective is not None and effective != len(part):
            raise ValueError(f"lm-eval's results count {effective} samples of {task}, its samples file {len(part)}")
        score += results["results"][task][metric] * len(part)
        values += part
    n = len(values)
    score /= n
    full = sum(v == 1.0 for v in values)
    low, high = wilson(full, n)
    binary = all(v in (0.0, 1.0) for v in values)
    return {"score": score, "n": n, "full": full, "binary": binary, "wilson95": [low, high],
            "score95": [low, high] if binary else list(mean_interval(values))}


def score_interval(summary: dict[str, Any], out_dir: str | Path) -> list[float]:
    """A cell's ``score95``; for a cell summarised before it was recorded, computed as
    ``summarize_cell`` does from lm-eval's samples file in ``out_dir`` (the folder its summary names it in)."""
    if "score95" in summary:
        return summary["score95"]
    if summary.get("binary"):
        return summary["wilson95"]
    values = [float(s[str(summary["length"])]) for s in read_samples(Path(out_dir) / summary["lm_eval_samples"])]
    return list(mean_interval(values))


def plan(pending: list[dict[str, Any]], budget_s: float | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split cells (each with ``estimate_s``) into those that fit ``budget_s`` in grid order and the
    rest (all fit without a budget): the first cell that would pass the budget ends the run."""
    if budget_s is None:
        return list(pending), []
    total = 0.0
    for index, cell in enumerate(pending):
        total += cell["estimate_s"]
        if total > budget_s:
            return pending[:index], pending[index:]
    return list(pending), []


def estimate_cell(probe_row: dict[str, Any], limit: int, max_gen_toks: int) -> float:
    """Seconds of a cell: ``limit`` prompts, each a prefill of the probe's length and ``max_gen_toks``
    decode steps at the probe's cost (an upper bound: generation may stop early)."""
    return limit * (probe_row["prefill_s"] + max_gen_toks * probe_row["decode_s_per_token"])


def part_folder(cell_dir: Path, first: int, limit: int) -> Path:
    """Where lm-eval's files of prompts ``first`` to ``limit - 1`` of a cell go: the cell's folder for
    the first prompts, ``prompts-A-B`` inside it for those a larger ``--limit`` adds."""
    return cell_dir if first == 0 else cell_dir / f"prompts-{first}-{limit - 1}"


def run_cell(loaded: LoadedModel, option: str, task: str, length: int, *, first: int = 0, limit: int, max_gen_toks: int, seed: int,
             tokenizer_dir: str, cell_dir: Path, haystack: str | None = None) -> tuple[Path, Path, float]:
    """One ``lm_eval.simple_evaluate`` of prompts ``first`` to ``limit - 1`` of ``task`` at ``length``
    under cache ``option``; lm-eval's results JSON and samples JSONL, written by its
    ``EvaluationTracker`` into ``cell_dir``, and the seconds spent in ``generate()`` (the rest is
    lm-eval building the task's data). ``haystack``: the local-haystack tasks' text file (other tasks ignore it)."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    new_cache = ruler_cache.cache_factory(loaded.model, option)

    class CacheOptionLM(HFLM):
        """HFLM generating every prompt into a fresh cache of the option (the model's own for
        ``none``), timing its ``generate()`` calls (``generate_s``)."""

        generate_s = 0.0

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            if new_cache is not None:
                generation_kwargs["cache"] = new_cache()
            t0 = time.perf_counter()
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
            self.generate_s += time.perf_counter() - t0
            return out

    for stale in [*cell_dir.glob("lm_eval_*.json"), *cell_dir.glob("samples_*.jsonl")]:  # an interrupted attempt's files
        stale.unlink()
    cell_dir.mkdir(parents=True, exist_ok=True)
    lm = CacheOptionLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=1, max_length=length)
    tracker = EvaluationTracker(output_path=str(cell_dir / "lm_eval.json"))
    results = simple_evaluate(model=lm, tasks=[task], **ruler_press.prompt_selection(task, first, limit), gen_kwargs={"max_gen_toks": max_gen_toks}, log_samples=True, evaluation_tracker=tracker,
                              task_manager=TaskManager(**ruler_press.task_manager_args(task, length, tokenizer_dir, haystack)), random_seed=seed,
                              verbosity="WARNING")
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    tracker.save_results_samples(task_name=task, samples=samples[task])
    written = sorted(cell_dir.glob("lm_eval_*.json")), sorted(cell_dir.glob("samples_*.jsonl"))
    if len(written[0]) != 1 or len(written[1]) != 1:
        raise RuntimeError(f"lm-eval did not write one results JSON and one samples JSONL into {cell_dir}")
    return written[0][0], written[1][0], lm.generate_s


LM_EVAL_PROGRESS = re.compile(r"generate_until requests:\s*\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+)")
"""lm-eval's tqdm line for a cell's prompts (``Running generate_until requests:  40%|####  | 16/40 [...]``)."""


def prompts_done(output: str) -> int | None:
    """How many prompts the last lm-eval progress line in ``output`` counts, None where it has none."""
    found = LM_EVAL_PROGRESS.findall(output)
    return int(found[-1][0]) if found else None


def run_press_cell(model_dir: str, option: str, task: str, length: int, *, first: int = 0, limit: int, max_gen_toks: int, seed: int, dtype: str,
                   cell_dir: Path, patterns_dir: Path, haystack: str | None = None,
                   on_prompts: Callable[[int], None] | None = None) -> tuple[Path, Path, float, dict[str, Any]]:
    """The cell of a kvpress press: ``ruler_press_runner.py`` runs the same ``simple_evaluate`` in
    kvpress's environment and writes lm-eval's files into ``cell_dir`` (its output in
    ``runner.log``; ``on_prompts`` hears how many prompts it has answered as lm-eval counts them);
    lm-eval's two files, the seconds inside generation and the runner's reply (per-prompt bytes,
    its package versions)."""
    for stale in [*cell_dir.glob("lm_eval_*.json"), *cell_dir.glob("samples_*.jsonl")]:
        stale.unlink()
    cell_dir.mkdir(parents=True, exist_ok=True)

    def relay(output: str) -> None:
        done = prompts_done(output)
        if done is not None and on_prompts is not None:
            on_prompts(done)

    reply = ruler_press.call_runner({"mode": "cell", "option": option, "task": task, "length": length, "first": first, "limit": limit,
                                     "max_gen_toks": max_gen_toks, "seed": seed, "model_dir": model_dir, "tokenizer_dir": model_dir, "dtype": dtype,
                                     "threads": torch.get_num_threads(), "cell_dir": str(cell_dir.resolve()), "patterns_dir": str(patterns_dir.resolve()),
                                     "haystack_file": haystack},
                                    log_path=cell_dir / "runner.log", on_log=relay)
    return Path(reply.pop("results")), Path(reply.pop("samples")), reply.pop("generate_s"), reply


def press_bytes(prompts: list[dict[str, Any]]) -> dict[str, float]:
    """Means over a press cell's prompts of the bytes per token its runner measured after each prompt
    (live tensors; entries still attended) and after its answer."""
    keys = ("bytes_per_token", "bytes_per_token_kept", "bytes_per_token_after_decode", "bytes_per_token_kept_after_decode", "tail_tokens",
            "prompt_tokens", "prefill_s")
    return {key: sum(p[key] for p in prompts) / len(prompts) for key in keys}


def evaluate(model: str, *, tasks: list[str], lengths: list[int], caches: list[str], limit: int, max_gen_toks: int | None = None, seed: int = 0,
             out_dir: str | Path, budget_minutes: float | None = None, plan_only: bool = False, progress: bool = True, dtype: str = "float32",
             say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) every (cache, task, length) cell of ``model`` into ``out_dir``; every option
    is checked before the model loads or the first cell runs. ``dtype`` (``MODEL_DTYPES``) is the
    dtype the model is loaded and run in, and so the dtype a slimkv model's cache holds its rows in.
    Writes ``ruler.json`` (with ``write_results``' provenance) and ``ruler.md`` after each cell;
    returns the summary."""
    started = time.perf_counter()
    check_choice("--dtype", dtype, MODEL_DTYPES)
    check_lm_eval()
    ruler_cache.check_backends(caches)
    check_int("--limit", limit, 1)
    if budget_minutes is not None:
        check_float("--budget-minutes", budget_minutes, 0.0, open_low=True)
    check_int("--seed", seed, 0)
    check_folder_target(out_dir)
    gen = gen_tokens(tasks, max_gen_toks)
    out_dir = Path(out_dir)
    if any(ruler_press.is_press(o) and ruler_press.parse_option(o)[0] == "duo_attention" for o in caches):
        fetch_austen()  # DuoAttention's on-the-fly pattern is scored on these chapters in the runner: fetched now, not after other cells ran
    original_of(model)  # a moved or changed original is refused before any model loads, not after the probes
    loaded = load_language_model(model, dtype=getattr(torch, dtype))
    if loaded.tokenizer is None:
        raise ValueError(f"--model {model}: no tokenizer is saved beside the model; RULER builds its prompts with it")
    check_lengths(lengths, loaded.model)
    for option in caches:
        for length in lengths:
            if ruler_press.is_press(option):
                ruler_press.check_budget(option, length)
    ruler_cache.check_model_takes(loaded.model, caches)
    dtype = next(loaded.model.parameters()).dtype
    base = {"model": model, "identity": loaded.identity, "weights": weights_record(model), "dtype": str(dtype).replace("torch.", ""), "limit": limit,
            "seed": seed, "lm_eval": package_versions(("lm_eval",))["lm_eval"]}
    haystack, haystack_sha256 = haystack_file() if any(ruler_press.is_local_task(t) for t in tasks) else (None, None)
    cells = {cell_id(o, t, n): {"option": o, "task": t, "length": n} for n in lengths for t in tasks for o in caches}
    finished, growing = {}, {}  # growing: cells finished with fewer prompts than --limit, which run only the rest
    for key, cell in cells.items():
        cell["settings"] = {**base, **cell, "max_gen_toks": gen[cell["task"]], **ruler_cache.option_settings(cell["option"])}
        if ruler_press.is_local_task(cell["task"]):
            cell["settings"]["haystack"] = {"text": LOCAL_HAYSTACK, "sha256": haystack_sha256}
        path = out_dir / "cells" / key / CELL_FILE
        if path.is_file():
            previous = read_json(path, expect=dict)
            differ = settings_differ(cell["settings"], previous["settings"])
            if differ == ["limit"] and previous["settings"]["limit"] < limit:
                growing[key] = previous
            elif differ:
                raise ValueError(f"{path} holds cell {key} of other settings (they differ in: {', '.join(differ)}; only a larger --limit adds "
                                 "prompts to it); give another --out, or move it away to run it again")
            else:
                finished[key] = previous
    earlier, other = folder_cells(out_dir, base, exclude=set(cells))  # cells of earlier runs with other grids: the report keeps them
    if earlier:
        say(f"{len(earlier)} finished cell(s) of earlier runs into {out_dir} (other tasks, lengths or caches) stay in its report")
    if other:
        say(f"{len(other)} finished cell(s) in {out_dir} were run with other settings (model, dtype, --limit, --seed or lm-eval) "
            f"and are left out of its report: {', '.join(other[:4])}{' ...' if len(other) > 4 else ''}")
    pending = [key for key in cells if key not in finished]
    # the probes hold for these weights, dtype and threads only: probes of another model or run in --out are measured again
    measured_on = {"weights": base["weights"], "dtype": base["dtype"], "threads": torch.get_num_threads()}
    kept = read_json(out_dir / PROBES_FILE, expect=dict) if (out_dir / PROBES_FILE).is_file() else {}
    probes = dict(kept.get("probes", {})) if kept.get("measured_on") == measured_on else {}

    def save_probes() -> None:
        write_json(out_dir / PROBES_FILE, {"measured_on": measured_on, "probes": probes})
    vocab = len(loaded.tokenizer)
    model_dir = str(resolve_model_path(model))
    press_pairs = []
    for option, length in dict.fromkeys((cells[k]["option"], cells[k]["length"]) for k in pending):
        if f"{option}/{length}" in probes:
            continue
        if ruler_press.is_press(option):  # timed in kvpress's environment, and only for the planner: a cell measures its own bytes
            if budget_minutes is not None or plan_only:
                press_pairs.append([option, length])
            continue
        say(f"timing one {length}-token prompt under --caches {option} (the planner's cost, and the cache's bytes)")
        probes[f"{option}/{length}"] = ruler_cache.probe(loaded.model, option, length, vocab)
        save_probes()
    if press_pairs:
        say(f"timing one prompt per press and length in kvpress's environment ({len(press_pairs)}: the planner's cost)")
        probes.update(ruler_press.call_runner({"mode": "probe", "pairs": press_pairs, "model_dir": model_dir, "tokenizer_dir": model_dir,
                                               "dtype": base["dtype"], "threads": torch.get_num_threads(),
                                               "patterns_dir": str(out_dir.resolve() / "press_patterns")})["probes"])
        save_probes()
    original = None
    for length in dict.fromkeys(cells[k]["length"] for k in pending):
        if f"reference/{length}" not in probes:  # the original's own DynamicCache, counted at 2 bytes an element
            if loaded.identity.get("base"):
                original = original or load_original(loaded)
                probes[f"reference/{length}"] = ruler_cache.probe(original.model, "none", length, vocab, decode_tokens=0)
            else:
                probes[f"reference/{length}"] = probes.get(f"none/{length}") or ruler_cache.probe(loaded.model, "none", length, vocab, decode_tokens=0)
            save_probes()
    for key in pending:
        cell = cells[key]
        cell["first"] = growing[key]["summary"]["n"] if key in growing else 0
        timed = probes.get(f"{cell['option']}/{cell['length']}")
        cell["estimate_s"] = estimate_cell(timed, limit - cell["first"], gen[cell["task"]]) if timed else 0.0
        cell["timed"] = timed is not None
    budget_s = None if budget_minutes is None else budget_minutes * 60 - (time.perf_counter() - started)
    run, skipped = plan([dict(cells[k], id=k) for k in pending], budget_s)
    untimed, timed_min = sum(not c["timed"] for c in run), sum(c["estimate_s"] for c in run) / 60
    cost = (f"about {timed_min:.1f} min" if not untimed else f"{untimed} cell(s) not timed" if untimed == len(run)
            else f"about {timed_min:.1f} min plus {untimed} cell(s) not timed")
    say(f"{len(finished)} of {len(cells)} cells finished before; {len(run)} to run, {cost} "
        f"({limit} prompts each, upper bound from the timed prompt)" + (f", within --budget-minutes {budget_minutes:.1f}" if budget_minutes else ""))
    for cell in run:
        grows = f" (prompts {cell['first']}-{limit - 1}: {cell['first']} finished before)" if cell["first"] else ""
        say(f"  run   {cell['id']}{grows}: " + (f"~{cell['estimate_s'] / 60:.1f} min" if cell["timed"] else "not timed (a press is timed for --budget-minutes or --plan-only)"))
    for cell in skipped:
        say(f"  skip  {cell['id']}: ~{cell['estimate_s'] / 60:.1f} min, past the budget")
    report = {"settings": {**base, "run": {"tasks": tasks, "lengths": lengths, "caches": caches, "budget_minutes": budget_minutes}}, "cells": {},
              "not_run": [c["id"] for c in skipped], "probes": probes}
    previous_order = list(read_json(out_dir / f"{RESULT_NAME}.json", expect=dict).get("cells", {})) if (out_dir / f"{RESULT_NAME}.json").is_file() else []
    kept_cells = {k: v["summary"] for k, v in {**earlier, **finished}.items()}
    for summary in kept_cells.values():  # cells summarised before score95 was recorded: from lm-eval's own samples
        summary.setdefault("score95", score_interval(summary, out_dir))
    report["cells"] = in_report_order(kept_cells, caches, previous_order, list(OFFLINE_TASKS))
    report["settings"].update(grid_of(report["cells"]))
    if plan_only:
        return report
    bar = tqdm(total=len(cells), initial=len(finished), desc=f"ruler {Path(model).name}", unit="cell", disable=not progress)
    for cell in run:
        cell_dir = out_dir / "cells" / cell["id"]
        first, before = cell["first"], growing.get(cell["id"])
        part_dir = part_folder(cell_dir, first, limit)
        load_start, t0 = os.getloadavg(), time.perf_counter()
        press = ruler_press.is_press(cell["option"])
        if press:  # in kvpress's process: its prompts on a bar of their own (lm-eval's shows in its runner.log)
            with tqdm(total=limit - first, desc=f"{cell['id']} (kvpress env)", unit="prompt", leave=False, disable=not progress) as prompts_bar:
                results_path, samples_path, generate_s, reply = run_press_cell(model_dir, cell["option"], cell["task"], cell["length"], first=first, limit=limit,
                                                                               max_gen_toks=gen[cell["task"]], seed=seed, dtype=base["dtype"], cell_dir=part_dir,
                                                                               patterns_dir=out_dir / "press_patterns", haystack=haystack,
                                                                               on_prompts=lambda done: prompts_bar.update(done - prompts_bar.n))
            prompts = (before["probe"]["prompts"] if before else []) + reply["prompts"]
            measured = {**press_bytes(prompts), "prompts": prompts, **ruler_press.settings(cell["option"])}
        else:
            results_path, samples_path, generate_s = run_cell(loaded, cell["option"], cell["task"], cell["length"], first=first, limit=limit,
                                                              max_gen_toks=gen[cell["task"]], seed=seed, tokenizer_dir=model_dir, cell_dir=part_dir,
                                                              haystack=haystack)
            measured = probes[f"{cell['option']}/{cell['length']}"]
        seconds = time.perf_counter() - t0
        added = {"first": first, "n": limit - first, "seconds": seconds, "generate_s": generate_s, "load_average_start": list(load_start),
                 "load_average_end": list(os.getloadavg()), "threads": torch.get_num_threads(),
                 "lm_eval_results": str(results_path.resolve().relative_to(out_dir.resolve())),
                 "lm_eval_samples": str(samples_path.resolve().relative_to(out_dir.resolve()))}
        parts = [*cell_parts(before["summary"]), added] if before else [added]
        summary = summarize_cell([(read_json(out_dir / part["lm_eval_results"], expect=dict), read_samples(out_dir / part["lm_eval_samples"])) for part in parts],
                                 cell["task"], cell["length"])
        if summary["n"] != limit:
            raise RuntimeError(f"cell {cell['id']} holds {summary['n']} prompts after its run, not --limit {limit}")
        seconds, generate_s = sum(p["seconds"] for p in parts), sum(p["generate_s"] for p in parts)
        reference = ruler_cache.bf16_reference(probes[f"reference/{cell['length']}"])
        # the budget axis: the bytes of the entries attention still sees (for a press that only masks, fewer than its tensors hold)
        budget_bytes = measured["bytes_per_token_kept"] if press else measured["bytes_per_token"]
        summary.update({"option": cell["option"], "task": cell["task"], "length": cell["length"], "max_gen_toks": gen[cell["task"]],
                        "bytes_per_token": budget_bytes, "bytes_ratio_to_bf16_original": budget_bytes / reference,
                        "ratio_reference": loaded.identity.get("base") or f"{model} itself (it names no original)",
                        "bytes_per_token_after_decode": measured["bytes_per_token_after_decode"], "seconds": seconds,
                        "seconds_per_sample": seconds / summary["n"], "generate_s_per_sample": generate_s / summary["n"],
                        "estimate_s": cell["estimate_s"] + (before["summary"]["estimate_s"] if before else 0.0),
                        **{k: parts[0][k] for k in ("load_average_start", "load_average_end", "threads", "lm_eval_results", "lm_eval_samples")}})
        if len(parts) > 1:
            summary["added_prompts"] = parts[1:]
        machine = machine_info()
        if press:
            summary.update({"bytes_per_token_live": measured["bytes_per_token"], "bytes_ratio_live": measured["bytes_per_token"] / reference,
                            "question_tail_tokens_mean": measured["tail_tokens"], "bytes_per_token_after_decode": measured["bytes_per_token_kept_after_decode"],
                            "runner": "kvpress env"})
            # the numbers come from kvpress's environment: its python and package versions, beside this process's
            machine["press_runner"] = {"python": reply["runner_python"], "packages": reply["runner_versions"], "threads": reply["threads"]}
        if before:  # the machine (commit, load, packages) each earlier part ran on
            machine["earlier_parts"] = before["machine"].pop("earlier_parts", []) + [before["machine"]]
        write_json(cell_dir / CELL_FILE, {"settings": cell["settings"], "summary": summary, "probe": measured, "machine": machine})
        report["cells"][cell["id"]] = summary
        report["cells"] = in_report_order(report["cells"], caches, previous_order, list(OFFLINE_TASKS))
        report["settings"].update(grid_of(report["cells"]))
        write_summary(report, out_dir)
        bar.update()
        bar.set_postfix_str(f"{cell['id']} {summary['score']:.2f}")
    bar.close()
    write_summary(report, out_dir)
    return report


def settings_differ(wanted: dict[str, Any], stored: dict[str, Any], keys: set[str] | None = None) -> list[str]:
    """The settings (all, or only ``keys``) in which a stored cell differs from what a run wants; the model's path and identity
    may differ (a moved folder with the same weights is the same model)."""
    keys = set(wanted) | set(stored) if keys is None else keys
    return sorted(k for k in keys if k not in ("model", "identity") and wanted.get(k) != stored.get(k))


def folder_cells(out_dir: Path, base: dict[str, Any], exclude: set[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The finished cells in ``out_dir`` outside ``exclude`` (this run's grid) that were run on this run's model with its
    ``base`` settings (weights, dtype, limit, seed, lm-eval): what an earlier run with another grid left there; and the
    keys of the other finished cells (other settings: not this run's to report)."""
    found, other = {}, []
    for path in sorted((out_dir / "cells").glob(f"**/{CELL_FILE}")) if (out_dir / "cells").is_dir() else []:
        key = path.parent.relative_to(out_dir / "cells").as_posix()
        if key in exclude:
            continue
        stored = read_json(path, expect=dict)
        if settings_differ(base, stored.get("settings", {}), set(base)):
            other.append(key)
        else:
            found[key] = stored
    return found, other


def write_summary(report: dict[str, Any], out_dir: Path) -> None:
    """``ruler.json`` (machine and provenance added by ``write_results``) and ``ruler.md``."""
    write_results(RESULT_NAME, report, out_dir)
    write_text(out_dir / TABLE_FILE, format_markdown(report) + "\n")
