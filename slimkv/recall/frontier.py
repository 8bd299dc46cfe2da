"""``slimkv eval recall``: the recall frontier. Every entry (compare's grammar) is trained on a
recall task (MQAR by default; ``slimkv.recall.run``) over several seeds with ONE recipe, then its
recall accuracy is set against the cache it measured, at the training length and at longer ones
(docs/recall.md).

The default entries are every registered kind at the cache sizes of its ``sizes`` preset
(MHA and MQA once each), plus the SWA/KVM hybrid the KVM paper proposes: SWA layers at the
smallest SWA window, alternating with KVM at each of its fixed-state sizes.

Resumable like compare: run ``OUT/runs/<entry>/seed<k>`` keeps ``recall_run.json`` once done and
is reused; an interrupted run resumes from its checkpoint. ``--workers 2`` trains two runs at once,
each in its own process (``slimkv.common.workers``). Separate processes may also share ``--out``;
a run another process holds is skipped and left out of this report (rerun once all are done to
get one report of everything). ``report.json`` holds it all;
``report.md`` and ``recall_frontier.png`` are a pure function of it.
"""

from __future__ import annotations

import statistics
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from slimkv.attention import ATTENTION_KINDS, kind_spec
from slimkv.bench.entries import Entry, recipe_shape, run_folders
from slimkv.bench.statistics import summarize
from slimkv.common.files import (
    FolderBusyError,
    check_folder_target,
    check_writable,
    read_json,
    save_figure,
    write_json,
    write_text,
)
from slimkv.common.plotting import new_figure
from slimkv.common.spec import AttentionSpec
from slimkv.common.timing import machine_info
from slimkv.common.workers import check_workers, run_each, workers_note
from slimkv.model import SlimKVForCausalLM
from slimkv.recall.recipe import RecallRecipe, model_config
from slimkv.recall.run import train_recall

REPORT_FORMAT = 1
REPORT_KIND = "recall"
PLOT_FILE = "recall_frontier.png"
HYBRID = ("swa", "kvm")
SOLVED = 0.9  # a seed "solved" the task when its accuracy at the training length reaches this
HEAD_SHARING = {"mha", "gqa", "mqa"}  # one curve on the plot: the same mechanism at n_kv_heads = H, H/g, 1
MAX_PARAMETERS = 100_000_000  # a recall model is small (the defaults: about 100K); more is a typo that would exhaust memory


def frontier_entries(recipe: RecallRecipe) -> list[Entry]:
    """The default entries: every kind at its preset cache sizes, then the SWA/KVM hybrid."""
    shape = recipe_shape(recipe)
    entries = []
    for kind in ATTENTION_KINDS:
        for label, options in kind_spec(kind).size_variants(shape, kind):
            entries.append(Entry(label, (kind,), {kind: dict(options)}))
    if all(kind in ATTENTION_KINDS for kind in HYBRID):
        window = min((o for _, o in kind_spec("swa").size_variants(shape, "swa")), key=lambda o: o["window"])
        for _, options in kind_spec("kvm").size_variants(shape, "kvm"):
            if options.get("schedule") == "fixed":
                entry = Entry("", HYBRID, {"swa": dict(window), "kvm": dict(options)})
                entries.append(Entry(entry.spec().text(), HYBRID, entry.options))
    return entries


def family(entry: dict[str, Any]) -> str:
    """The curve an entry belongs to on the frontier plot."""
    kinds = entry["kinds"]
    if len(kinds) == 1 and kinds[0] in HEAD_SHARING:
        return "mha/gqa/mqa"
    return "+".join(kinds)


def check_entries(entries: list[Entry], recipe: RecallRecipe) -> None:
    """Every entry builds with the recipe and has at most ``MAX_PARAMETERS`` parameters (counted on
    the meta device: nothing is allocated), before any training."""
    recipe.validate()
    for entry in entries:
        try:
            config = model_config(entry.spec(), recipe)
        except ValueError as err:
            raise ValueError(f"entry {entry.label!r}: {err}") from None
        with torch.device("meta"):
            parameters = sum(p.numel() for p in SlimKVForCausalLM(config).parameters())
        if parameters > MAX_PARAMETERS:
            raise ValueError(f"entry {entry.label!r}: d_model={recipe.d_model}, n_layers={recipe.n_layers} (--d-model, --n-layers) give a model of "
                             f"{parameters:,} parameters, more than the {MAX_PARAMETERS:,} a recall run may have; lower them")


def run_recall(entries: list[Entry], recipe: RecallRecipe, seeds: list[int], out_dir: str | Path, *, title: str = "Recall frontier",
               progress: bool = True, workers: int = 1) -> dict[str, Any]:
    """Train and evaluate every entry x seed (reusing finished runs), aggregate, write
    ``report.json``, ``report.md`` and the plot into ``out_dir``; returns the report.

    ``workers``: runs trained at once, each in its own process on one torch thread
    (``slimkv.common.workers``; the same numbers as one at a time, no progress bars)."""
    check_workers(workers)
    check_entries(entries, recipe)
    out_dir = Path(out_dir)
    check_folder_target(out_dir)
    check_writable(out_dir)
    started = time.perf_counter()
    if workers > 1:
        print(workers_note(workers), flush=True)
    pairs = [(e, s) for e in entries for s in seeds]
    run_dirs, headings, calls = recall_calls(entries, recipe, seeds, out_dir, progress=progress and workers == 1)
    outcomes: list[dict[str, Any]] = [{} for _ in calls]  # by index, whatever order the runs finish in
    for index, outcome in run_each(recall_run, calls, workers):
        outcomes[index] = outcome
        if outcome["busy"]:
            print(f"{headings[index]}: another process is training {run_dirs[index]}; left out of this report", flush=True)
            continue
        result = outcome["result"]
        accuracies = ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in result["lengths"].items())
        state = "reused" if outcome["reused"] else f"{outcome['seconds']:.0f} s"
        print(f"{headings[index]}: accuracy {accuracies}; {result['lengths']['1x']['cache']['bytes_per_token']:.0f} B/token ({state})", flush=True)
    runs = [{"label": entry.label, "run_dir": str(run_dir), "reused": outcome["reused"], **outcome["result"]}
            for (entry, _), run_dir, outcome in zip(pairs, run_dirs, outcomes) if not outcome["busy"]]
    busy = [str(run_dir) for run_dir, outcome in zip(run_dirs, outcomes) if outcome["busy"]]
    report = {
        "format": REPORT_FORMAT,
        "kind": REPORT_KIND,
        "title": title,
        "recipe": recipe.to_dict(),
        "seeds": seeds,
        "entries": [e.to_dict() for e in entries],
        "runs": runs,
        "aggregate": aggregate(entries, runs, recipe),
        "busy_runs": busy,
        "machine": machine_info(),
        "wall_seconds": time.perf_counter() - started,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "report.json", report)
    written = write_report_files(report, out_dir)
    print()
    print(render_markdown(report).split("\n## Accuracy by")[0])
    print(f"wall time {report['wall_seconds']:.0f} s; wrote {out_dir / 'report.json'}, " + ", ".join(map(str, written)))
    return report


def recall_calls(entries: list[Entry], recipe: RecallRecipe, seeds: list[int], out_dir: Path, *,
                 progress: bool) -> tuple[list[Path], list[str], list[tuple[Any, ...]]]:
    """The runs of a sweep, entry by entry and seed by seed: each one's folder, its heading and the
    arguments of ``recall_run`` (a caller may train them ahead, as the demo does; ``run_recall``
    then reuses them)."""
    pairs = [(e, s) for e in entries for s in seeds]
    run_dirs, headings = run_folders(out_dir, [(entry.label, seed) for entry, seed in pairs])
    calls = [(entry.spec(), recipe, seed, run_dir, heading, progress) for (entry, seed), run_dir, heading in zip(pairs, run_dirs, headings)]
    return run_dirs, headings, calls


def recall_run(spec: AttentionSpec, recipe: RecallRecipe, seed: int, run_dir: Path, heading: str, progress: bool) -> dict[str, Any]:
    """One entry and seed of the sweep (``train_recall``), in this process or a worker: {"busy":
    True} when another process holds ``run_dir``, else the result, whether it was reused and the
    seconds it took."""
    print(f"{heading}: {run_dir}", flush=True)
    started = time.perf_counter()
    try:
        result, reused = train_recall(spec, recipe, seed, run_dir, label=heading, progress=progress)
    except FolderBusyError:
        return {"busy": True}
    return {"busy": False, "result": result, "reused": reused, "seconds": time.perf_counter() - started}


def aggregate(entries: list[Entry], runs: list[dict[str, Any]], recipe: RecallRecipe) -> list[dict[str, Any]]:
    """Per entry with at least one finished run: per length, accuracy over seeds (mean, std, min,
    max, median), seeds that solved it, the measured cache per token, the accuracy per gap bucket
    (mean over seeds)."""
    rows = []
    for entry in entries:
        mine = [r for r in runs if r["label"] == entry.label]
        if not mine:
            continue
        lengths = {}
        for factor in recipe.lengths:
            key = f"{factor}x"
            per_seed = [r["lengths"][key] for r in mine]
            per_token = {round(m["cache"]["bytes_per_token"], 6) for m in per_seed}
            if len(per_token) != 1:
                raise ValueError(f"entry {entry.label!r}: the measured cache differs between seeds at {key} ({sorted(per_token)})")
            accuracy = [m["accuracy"] for m in per_seed]
            buckets = sorted({b for m in per_seed for b in m["by_gap"]}, key=lambda b: int(b.split("-")[0]))
            lengths[key] = {
                "seq_len": per_seed[0]["seq_len"],
                "accuracy": {**summarize(accuracy), "median": statistics.median(accuracy)},
                "solved_seeds": sum(a >= SOLVED for a in accuracy),
                "cache_bytes_per_token": per_seed[0]["cache"]["bytes_per_token"],
                "cache_equals_analytic": all(m["cache"]["bytes"] == m["cache"]["analytic_bytes"] for m in per_seed),
                "by_gap": {b: statistics.fmean(m["by_gap"][b]["accuracy"] for m in per_seed if b in m["by_gap"]) for b in buckets},
            }
        rows.append({"label": entry.label, "kinds": list(entry.kinds), "seeds": [r["seed"] for r in mine], "parameters": mine[0]["parameters"],
                     "train_seconds": summarize([r["train_seconds"] for r in mine]), "lengths": lengths})
    return rows


# ---------------------------------------------------------------- report files (a pure function of report.json)


def _stat(stat: dict[str, Any]) -> str:
    if stat["n"] == 1:
        return f"{stat['mean']:.3f}"
    return f"{stat['mean']:.3f} [{stat['min']:.2f}, {stat['max']:.2f}]"


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the frontier table, then accuracy by key-to-query gap, options and runs."""
    recipe, task = report["recipe"], report["recipe"]["task"]
    factors = [f"{f}x" for f in recipe["lengths"]]
    lines = [
        f"# {report['title']}",
        "",
        task_text(task),
        f"Recipe (the same for every entry; only the attention changes): d_model {recipe['d_model']}, {recipe['n_layers']} layers, "
        f"{recipe['n_heads']} heads, options {recipe['base_options']} under each entry's own, {recipe['steps']} steps of {recipe['batch_size']} "
        f"sequences with {list(recipe['train_pairs']) or task['n_pairs']} pairs, lr {recipe['lr']}.",
        f"Seeds: {', '.join(map(str, report['seeds']))}. Accuracy = exact match of the queried values on fixed test sets "
        f"({recipe['eval_sequences']} sequences at 1x, fewer at longer lengths; an answer counts when all its tokens are right); mean [min, max] over seeds; "
        f"solved = seeds with accuracy >= {SOLVED} at 1x. Cache = live cache bytes per token of the whole model after "
        f"prefilling one test sequence of that length (float32).",
        "",
        "| entry | B/token @1x | " + " | ".join(f"accuracy {f}" for f in factors) + " | solved | " + f"B/token @{factors[-1]} | train s |",
        "|---|---:|" + "---:|" * len(factors) + "---:|---:|---:|",
    ]
    for row in report["aggregate"]:
        per = row["lengths"]
        lines.append(
            f"| {row['label']} | {per['1x']['cache_bytes_per_token']:.0f} | " + " | ".join(_stat(per[f]["accuracy"]) for f in factors)
            + f" | {per['1x']['solved_seeds']}/{len(row['seeds'])} | {per[factors[-1]]['cache_bytes_per_token']:.0f} | {row['train_seconds']['mean']:.0f} |"
        )
    if report.get("busy_runs"):
        lines += ["", f"Left out (another process was training them): {', '.join(report['busy_runs'])}."]
    lines += ["", f"## Accuracy by key-to-query gap (mean over seeds), at {factors[-1]}", ""]
    buckets = sorted({b for row in report["aggregate"] for b in row["lengths"][factors[-1]]["by_gap"]}, key=lambda b: int(b.split("-")[0]))
    lines += ["| entry | " + " | ".join(buckets) + " |", "|---|" + "---:|" * len(buckets)]
    for row in report["aggregate"]:
        gaps = row["lengths"][factors[-1]]["by_gap"]
        lines.append(f"| {row['label']} | " + " | ".join(f"{gaps[b]:.2f}" if b in gaps else "-" for b in buckets) + " |")
    lines += ["", "## Options", ""]
    for entry in report["entries"]:
        options = "; ".join(f"{kind}: " + (",".join(f"{k}={v}" for k, v in opts.items()) or "-") for kind, opts in entry["options"].items())
        lines.append(f"- **{entry['label']}**: {options}")
    lines += ["", "## Runs", "", "| entry | seed | " + " | ".join(f"accuracy {f}" for f in factors) + " | train s | threads | run |",
              "|---|---:|" + "---:|" * len(factors) + "---:|---:|---|"]
    for run in report["runs"]:
        lines.append(f"| {run['label']} | {run['seed']} | " + " | ".join(f"{run['lengths'][f]['accuracy']:.3f}" for f in factors)
                     + f" | {run['train_seconds']:.0f} | {run['threads']} | {run['run_dir']} |")
    machine = report["machine"]
    lines += ["", f"Plot: {PLOT_FILE}. Machine: {machine.get('cpu_model', machine.get('processor'))}, {machine['cpu_count']} CPUs, "
              f"torch {machine['torch']}, load {machine.get('load_average')} at the end."]
    return "\n".join(lines) + "\n"


def task_text(task: dict[str, Any]) -> str:
    """One sentence describing a recall task from its ``to_dict()``."""
    if task.get("task") == "needles":
        values = f"{task['digits']}-digit values" if task.get("values") == "digits" else f"single-token word values (from {task.get('value_words')} words)"
        lines = "needle lines (key, value; no sentence before the key)" if task.get("needle_prefix") == "none" else "needle lines"
        return (f"Needles task: {task['n_pairs']} {lines} with {values} in {task['seq_len']}-token documents of "
                f"{task['dataset']} prose (train split in training, val split in the test sets), each needle asked once at the end. "
                "At f x: f times longer documents, the same needles.")
    haystack = f", fillers drawn from {task['haystack_tokens']} further token ids" if task.get("haystack_tokens") else ""
    return (f"MQAR task: vocabulary {task['vocab_size']}{haystack}, {task['seq_len']} tokens, {task['n_pairs']} pairs, "
            f"{task['n_queries'] or task['n_pairs']} queries, {task['gap']} gaps" + (f" (power_a {task['power_a']})" if task["gap"] == "power" else "")
            + ". At f x: f times the tokens, pairs and queries.")


def short_labels(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each entry's label without the options every entry of its family shares (the plot's
    annotations): ``swa+kvm:swa.window=8,kvm.min_rows=16`` -> ``kvm.min_rows=16`` beside the other hybrids."""
    kind_and_options = {row["label"]: (row["label"].partition(":")[0], row["label"].partition(":")[2].split(",") if ":" in row["label"] else [])
                        for row in rows}
    short = {}
    for row in rows:
        kinds = [kind_and_options[other["label"]] for other in rows if family(other) == family(row)]
        if len(kinds) == 1:
            short[row["label"]] = row["label"]
            continue
        shared = set.intersection(*(set(options) for _, options in kinds))
        kind, options = kind_and_options[row["label"]]
        rest = ",".join(o for o in options if o not in shared)
        if len({k for k, _ in kinds}) > 1:  # a family of several kinds (mha/gqa/mqa): keep the kind
            rest = f"{kind}:{rest}" if rest else kind
        short[row["label"]] = rest or kind
    return short


def plot_frontier(report: dict[str, Any]):
    """Accuracy against measured cache bytes per token, one panel per length; a point per entry
    (mean over seeds, bar = min..max), a line per family in order of cache size."""
    factors = [f"{f}x" for f in report["recipe"]["lengths"]]
    fig, axes = new_figure(1, len(factors), figsize=(4.6 * len(factors), 4.6), squeeze=False, layout="constrained")
    families = sorted({family(row) for row in report["aggregate"]})
    colors = {name: f"C{i % 10}" for i, name in enumerate(families)}
    labels = short_labels(report["aggregate"])
    for ax, factor in zip(axes[0], factors):
        curves: dict[str, list[tuple[float, float]]] = {}
        for row in report["aggregate"]:
            per = row["lengths"][factor]
            x, stat = per["cache_bytes_per_token"], per["accuracy"]
            name = family(row)
            ax.errorbar(x, stat["mean"], yerr=[[stat["mean"] - stat["min"]], [stat["max"] - stat["mean"]]], fmt="o", color=colors[name], capsize=3, markersize=4)
            ax.annotate(labels[row["label"]], (x, stat["mean"]), textcoords="offset points", xytext=(4, 3), fontsize=6)
            curves.setdefault(name, []).append((x, stat["mean"]))
        for name, points in curves.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, color=colors[name], linewidth=1.0, alpha=0.7, label=name)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(f"live cache bytes per token at {factor} ({report['aggregate'][0]['lengths'][factor]['seq_len']} tokens)")
        ax.set_title(f"test length {factor}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{report['recipe']['task'].get('task', 'mqar')} accuracy (mean, bar = min..max over seeds)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="outside lower center", ncols=len(names))
    recipe = report["recipe"]
    fig.suptitle("\n".join(textwrap.wrap(f"{report['title']}: trained at {recipe['task']['seq_len']} tokens, {recipe['steps']} steps, "
                                         f"seeds {', '.join(map(str, report['seeds']))}", 120)), fontsize=9)
    return fig


def write_report_files(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """``report.md`` and ``recall_frontier.png`` of ``report`` in ``out_dir``; the paths written."""
    write_text(out_dir / "report.md", render_markdown(report))
    written = [out_dir / "report.md"]
    if report["aggregate"]:
        save_figure(plot_frontier(report), out_dir / PLOT_FILE, tight=False)
        written.append(out_dir / PLOT_FILE)
    return written


def is_recall_report(report: Any) -> bool:
    return isinstance(report, dict) and report.get("kind") == REPORT_KIND and report.get("format") == REPORT_FORMAT


def load_recall_report(path: str | Path) -> dict[str, Any]:
    """A ``report.json`` written by ``run_recall`` (ValueError naming the file otherwise)."""
    report = read_json(path, expect=dict)
    if not is_recall_report(report):
        raise ValueError(f"{path} is not a report.json of `slimkv eval recall` (format {REPORT_FORMAT})")
    return report
