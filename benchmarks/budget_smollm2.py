"""SmolLM2 under ``convert --cache-budget``: the planner's conversions and their perplexity.

``run`` converts SmolLM2-135M with ``slimkv convert --cache-budget B`` for each budget (a folder
per budget under ``--runs``, reused when finished), then scores each conversion and the original on
4K windows of the held-out plays and of Austen with ``slimkv eval ppl`` (a quantized cache is
scored through itself, ``slimkv.eval.ppl.cache_chunk``) into ``results/budget/budget_smollm2.json``.
``report`` renders the JSON as markdown (``budget_smollm2.md`` beside it).

Retrieval of the same folders runs through RULER into ``results/ruler/smollm2-budget<B>/<length>/``
(``slimkv eval ruler --model DIR --out ...``, docs/ruler.md); ``report`` then also renders
``results/ruler/budget_comparison.md`` (and ``.png``): every RULER cell of the original SmolLM2
under its cache options (``results/ruler/smollm2/<length>/``: quanto, kvpress presses) beside the
planner's conversions, per task and length, ordered by measured bytes, with intervals.

    .venv/bin/python benchmarks/budget_smollm2.py run --budgets 0.125,0.25 --runs /tmp/budget [--threads 1] [--at N] [--budget-windows 256,128,64]
    .venv-ruler/bin/slimkv eval ruler --model /tmp/budget/budget0.125 --lengths 2k --limit 40 --threads 1 \
        --out benchmarks/results/ruler/smollm2-budget0.125/2048
    .venv/bin/python benchmarks/budget_smollm2.py report
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slimkv.common.files import save_figure, write_text
from slimkv.common.markdown import markdown_table
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir, results_path
from slimkv.common.timing import machine_info, write_results
from slimkv.convert import hybrid
from slimkv.convert.manifest import finished_conversion
from slimkv.convert.methods import CONVERSIONS
from slimkv.convert.pipeline import ConvertOptions, convert_pretrained
from slimkv.eval import ruler, ruler_report
from slimkv.eval.ppl import perplexity_report
from slimkv.eval.ruler_report import BUDGET_TIERS, budget_tier
from slimkv.pretrained import SMOLLM2, fetch_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "budget_smollm2"
TEXTS = ("shakespeare-val", "austen")
SEQ_LEN, MAX_TOKENS = 4096, 8192


def run(budgets: list[float], runs: Path, storage: str | None = None, at: int | None = None, windows: list[int] | None = None) -> Path:
    """Convert at each budget (reusing finished folders; ``storage`` fixes the cache storage, else the
    planner chooses; ``at`` and ``windows`` as ``convert --at`` and ``--budget-windows``), score
    perplexity, write the JSON: these plans' rows replace those of the same budget, storage, length
    and windows, other plans' rows stay, each with the machine and commit it ran on."""
    fetch_smollm2()
    rows = []
    for budget in budgets:
        out = runs / (f"budget{budget:g}{storage or ''}" + (f"at{at}" if at else "") + ("-windows" if windows else ""))
        options = ConvertOptions("hybrid" + (f":at={at}" if at else ""), cache_budget=budget, cache_storage=storage, budget_windows=windows)
        manifest = finished_conversion(out, options)
        if manifest is None:
            _, manifest = convert_pretrained(SMOLLM2, options, out)
        scores = {}
        for text in TEXTS:
            report = perplexity_report(str(out), text, SEQ_LEN, MAX_TOKENS)
            original, converted = report["results"]
            scores[text] = {"original_ppl": original["ppl"], "ppl": converted["ppl"], "ratio": converted["ppl"] / original["ppl"],
                            "tokens_predicted": converted["tokens_predicted"], "through_cache_in_calls_of": converted.get("through_cache_in_calls_of")}
        rows.append({"budget": budget, "folder": str(out), "plan": manifest["budget_plan"], "allocation": manifest["allocation"],
                     "cache_storage": manifest["cache_storage"], "asked_storage": storage, "budget_windows": windows, "cache_bytes": manifest["cache_bytes"],
                     "seconds": manifest["seconds"], "ppl": scores, "machine": machine_info()})
    path = results_path(RESULTS, f"{NAME}.json")
    if path.is_file():  # rows of other plans (budget, asked storage) stay, with the machine they name (older rows: the file's)
        earlier = json.loads(path.read_text())
        ran = {plan_key(r) for r in rows}
        rows = [{**r, "machine": r.get("machine", earlier["machine"])} for r in earlier["rows"] if plan_key(r) not in ran] + rows
    payload = {"model": SMOLLM2, "seq_len": SEQ_LEN, "max_tokens": MAX_TOKENS,
               "protocol": f"slimkv convert --cache-budget B; slimkv eval ppl --seq-len {SEQ_LEN} --max-tokens {MAX_TOKENS} on {', '.join(TEXTS)}",
               "rows": rows}
    return write_results(NAME, payload, results_dir(RESULTS, NAME))


def plan_key(row: dict) -> tuple:
    """What makes a row's plan: budget, asked storage, the length planned at and the windows planned from."""
    return row["budget"], row.get("asked_storage"), row["plan"]["at"], tuple(row.get("budget_windows") or ())


def render(payload: dict) -> str:
    """The markdown page of the JSON."""
    lines = [f"# SmolLM2 under `convert --cache-budget` ({payload['protocol']})", "",
             f"Machine: {payload['machine']['cpu_model']} ({payload['machine']['instruction_set']}), {payload['machine']['threads']} threads; "
             "each row's load at its start and commit in its own columns (rows of one plan are replaced when it runs again).", ""]
    table = []
    for row in payload["rows"]:
        at = {r["context"]: r["ratio"] for r in row["cache_bytes"]}
        window = row["plan"].get("window", hybrid.METHOD_OPTIONS["window"])  # plans made before windows were planned: the method's default
        table.append([f"{row['budget']:g}", str(row["plan"]["at"]), row["plan"]["storage"], str(window), f"{row['plan']['exact_heads']} / {row['plan']['total_heads']}",
                      *(f"{at[n]:.4f}" if n in at else "" for n in (2048, 4096, 8192)),
                      *(f"{row['ppl'][t]['ppl']:.2f} ({row['ppl'][t]['ratio']:.3f}x)" for t in TEXTS), f"{row['seconds']['total']:.0f}",
                      f"{row['machine']['load_average'][0]:.2f}", row["machine"]["git_commit"][:10]])
    lines.append(markdown_table(["budget", "at", "storage", "window", "exact KV heads", "bytes 2K", "bytes 4K", "bytes 8K", *(f"ppl {t} (vs original)" for t in TEXTS),
                                 "convert s", "load", "commit"], table, align=["left", "right", "left", "right", "left"] + ["right"] * 8))
    lines += ["", "Bytes: the live bfloat16 cache against the bfloat16 original's at that context (measured at conversion). "
                  "Perplexity: 4K windows, the original beside each conversion in the same run; a quantized cache scored through itself."]
    return "\n".join(lines) + "\n"


def conversion_label(converted: dict) -> str:
    """A conversion's row label from its manifest (not its folder's name): a planned one's budget, storage
    and how the heads were chosen; any other its method, cache ratio and storage, as the command spells them."""
    plan, options = converted.get("budget_plan") or {}, converted.get("method_options") or {}
    healing = converted.get("healing") or {}
    config = healing.get("config") or {}
    copy = f", copy fraction {config['copy_fraction']:g}" if config.get("copy_fraction") else ""
    steps = f" in {healing['step']} steps" if healing.get("step") else ""  # one token count, batches of another size: another healing
    healed = f", healed {config.get('tokens')} tokens{steps}{copy}" if healing else ""
    if not plan:
        ratio = f" --cache-ratio {converted['cache_ratio']:g}" if converted.get("cache_ratio") is not None else ""
        storage = (converted.get("cache_storage") or "full").split(":")[0]
        method = converted.get("method", "?")
        defaults = CONVERSIONS[method].settings if method in CONVERSIONS else {}
        changed = ",".join(f"{k}={v}" for k, v in options.items() if k in defaults and v != defaults[k])  # as --to spells them
        return f"convert --to {method}{':' + changed if changed else ''}{ratio}" + (f" --cache-storage {storage}" if storage != "full" else "") + healed
    at = f" --at {plan['at']}" if plan.get("at", MAX_TOKENS) != MAX_TOKENS else ""  # as the command spells it (--at defaults to SmolLM2's 8192 positions)
    windows = (converted.get("options") or {}).get("budget_windows")
    at += f" --budget-windows {','.join(map(str, windows))}" if windows else ""  # the windows the plan chose from
    at += " --cache-storage weighed" if plan.get("weighing") else ""  # chosen by measured copy accuracy (slimkv.convert.budget.weighed)
    window = f", window {plan['window']}" if windows else ""
    return (f"convert --cache-budget {plan.get('budget', converted.get('cache_ratio')):g}{at} ({(plan.get('storage') or 'full').split(':')[0]}, "
            f"{plan.get('exact_heads', '?')} exact heads by {options.get('score', '?')}{window}{healed})")


def compression_label(compressed: dict) -> str:
    """A ``slimkv compress`` output's row label from its identity: the method and the weight ratio removed."""
    return f"compress --method {compressed.get('method', '?')} --ratio {compressed.get('ratio', '?'):g} (weights; the cache is the original's)"


def ruler_rows() -> list[dict]:
    """Every RULER cell of the original (under each cache option) and of the budget conversions; of a
    cell run more than once (another --out, more prompts), the run with the most prompts."""
    rows: dict[tuple, dict] = {}
    for path in sorted((RESULTS / "ruler").glob("smollm2*/*/ruler.json")):
        run = json.loads(path.read_text())
        identity = run["settings"].get("identity") or {}
        converted, compressed = identity.get("converted"), identity.get("compressed")
        for cell in run["cells"].values():
            if cell.get("n"):
                name = (conversion_label(converted) if converted else compression_label(compressed) if compressed
                        else "original" if cell["option"] == "none" else f"original, {cell['option']}")
                if run["settings"].get("dtype", "float32") != "float32":  # `slimkv eval ruler --dtype`: another run, its own row
                    name += f", {run['settings']['dtype']} model"
                low, high = ruler.score_interval(cell, path.parent)
                row = {"method": name, "task": cell["task"], "length": cell["length"], "score": cell["score"], "full": cell["full"], "n": cell["n"],
                       "full_low": cell["wilson95"][0], "full_high": cell["wilson95"][1], "low": low, "high": high,
                       "ratio": cell["bytes_ratio_to_bf16_original"], "option": cell["option"], "dtype": run["settings"].get("dtype", "float32"),
                       "plan_budget": ((converted or {}).get("budget_plan") or {}).get("budget"), "depths": _depths(cell, path.parent)}
                key = (name, cell["task"], cell["length"])
                if key not in rows or row["n"] > rows[key]["n"]:  # a cell run again with more prompts replaces the smaller run
                    rows[key] = row
    return list(rows.values())


def _depths(cell: dict, folder: Path) -> list[tuple[int, int]] | None:
    """The cell's hits per needle-depth bin (``ruler_report.needle_depth_hits``) where they place every prompt
    the cell counts and every prompt lm-eval scored 1, else None."""
    depths = ruler_report.needle_depth_hits(cell, folder)
    placed = depths is not None and sum(n for _, n in depths) == cell["n"] and sum(hits for hits, _ in depths) == cell["full"]
    return depths if placed else None


def render_ruler(rows: list[dict]) -> str:
    """The comparison page: per (task, length), every method by measured bytes, with the original's ceiling."""
    lines = ["# RULER on SmolLM2-135M: the planner's conversions beside quantized caches and kvpress presses", "",
             "lm-eval 0.4.13's own scoring, greedy, the model in float32 (every cache in its own storage: quanto's scales, "
             "slimkv's codes, scales and full-precision windows in float32) unless its row says `bfloat16 model` "
             "(`slimkv eval ruler --dtype bfloat16`: the model and so a slimkv cache's rows, scales and windows in bfloat16, the bytes a "
             "bfloat16 deployment keeps). Bytes: the live cache per token after the prompt, "
             "against the bfloat16 original's at that length. Score interval: for the niah tasks (each prompt 0 or 1) the 95% Wilson "
             "interval; for the partial-credit tasks (vt, cwe, fwe) a 95% bootstrap interval of the mean score (`slimkv.scoring.mean_interval`). "
             "`full / n`: the prompts lm-eval scored 1, with their Wilson interval. `intervals apart`: the score intervals do not overlap "
             "the original's. Tasks ending `_handbook` are slimkv's local-haystack versions of lm-eval's essay tasks (lm-eval's generator "
             "and scoring, the needles hidden in the Debian handbook's held-out pages; docs/ruler.md): prose haystacks, harder for a cache than "
             "`niah_single_1`'s repeated sentences. Generated by `benchmarks/budget_smollm2.py report` from "
             "`results/ruler/smollm2*/<length>/ruler.json`.", ""]
    for task, length in sorted({(r["task"], r["length"]) for r in rows}, key=lambda k: (k[1], k[0])):
        cell = sorted((r for r in rows if (r["task"], r["length"]) == (task, length)), key=lambda r: -r["ratio"])
        original = next((r for r in cell if r["method"] == "original"), None)
        lines += [f"## {task} at {length} tokens", ""]
        if original is not None and original["high"] < 0.5:
            lines += [f"The original itself scores {original['score']:.3f} here: this task measures the model more than its cache "
                      "(reported, not used to rank).", ""]
        table = [[r["method"], f"{r['ratio']:.3f}", f"{r['score']:.3f} ({r['low']:.2f}-{r['high']:.2f})",
                  f"{r['full']}/{r['n']} ({r['full_low']:.2f}-{r['full_high']:.2f})",
                  "" if original is None or r is original else ("yes" if r["high"] < original["low"] or r["low"] > original["high"] else "no")]
                 for r in cell]
        lines += [markdown_table(["method", "bytes (ratio to bf16)", "score (95% CI)", "full / n (95% CI)", "intervals apart"], table,
                                 align=["left", "right", "right", "left", "left"]), ""]
    return "\n".join(lines + ranking(rows) + misses_by_depth(rows))


RANKED_TIERS = (0.25, 0.125)


def ranking(rows: list[dict]) -> list[str]:
    """Every method ranked at 0.25 and 0.125 of the bytes, per (task, length) the original solves: the
    methods whose measured bytes fall in the tier (``budget_tier``: the nearest tier, as each run's
    comparison.md places them), by score, each against the original's score and the tier's best."""
    lines = [f"## Ranking at {' and '.join(map(str, RANKED_TIERS))} of the bytes", "",
             "Per task and length whose original scores well (its interval reaching 0.5 or more), every method whose measured bytes fall "
             "in the tier (the nearest of the tiers " + ", ".join(map(str, BUDGET_TIERS)) + " to its bytes ratio, on a log scale, as each run's "
             "`comparison.md` places its cells), ranked by score (equal scores share a rank, the fewer bytes listed first). `of the original`: the score over the original's (float32 cache). `below "
             "the best`: the method's interval lies below the tier's best's (a winner is named only where intervals separate).", ""]
    table = []
    for task, length in sorted({(r["task"], r["length"]) for r in rows}, key=lambda k: (k[1], k[0])):
        cell = [r for r in rows if (r["task"], r["length"]) == (task, length)]
        original = next((r for r in cell if r["method"] == "original"), None)
        if original is None or original["high"] < 0.5:  # (so its score is above 0: a share of it is defined)
            continue
        for budget in RANKED_TIERS:
            members = sorted((r for r in cell if (not r["method"].startswith("original") or r["option"] != "none") and budget_tier(r["ratio"]) == budget),
                             key=lambda r: (-r["score"], r["ratio"]))  # ties: the fewer bytes first, and the same rank
            for r in members:
                rank = 1 + sum(m["score"] > r["score"] for m in members)
                table.append([task, str(length), str(budget), str(rank), r["method"], f"{r['ratio']:.3f}",
                              f"{r['score']:.3f} ({r['low']:.2f}-{r['high']:.2f})", f"{r['score'] / original['score']:.2f}", "yes" if r["high"] < members[0]["low"] else "no"])
    lines += [markdown_table(["task", "length", "tier", "rank", "method", "bytes (ratio to bf16)", "score (95% CI)", "of the original", "below the best"],
                             table, align=["left", "right", "right", "right", "left", "right", "right", "right", "left"]), ""]
    return lines


def misses_by_depth(rows: list[dict]) -> list[str]:
    """Where in the context each method's needles are lost: per niah task and length the original
    solves, the original and every method of the ranked tiers, hits / prompts per needle-depth bin."""
    bins = ruler_report.DEPTH_BINS
    edges = [f"{100 * i // bins}-{100 * (i + 1) // bins}%" for i in range(bins)]
    lines = ["## Where the needles are lost: hits by needle depth", "",
             f"Per niah task and length whose original scores well, the original and every method of the ranked tiers: the prompts lm-eval "
             f"scored 1 over the prompts, by where the needle's answer first appears in the prompt (as a fraction of its characters, "
             f"{bins} bins; `slimkv.eval.ruler_report.needle_depth_hits`, from each cell's lm-eval samples files). `-`: a cell whose samples do not "
             "place every prompt it counts.", ""]
    table = []
    for task, length in sorted({(r["task"], r["length"]) for r in rows}, key=lambda k: (k[1], k[0])):
        cell = [r for r in rows if (r["task"], r["length"]) == (task, length)]
        original = next((r for r in cell if r["method"] == "original"), None)
        if original is None or original["high"] < 0.5 or not task.startswith("niah"):
            continue
        members = [original] + sorted((r for r in cell if r is not original and budget_tier(r["ratio"]) in RANKED_TIERS
                                       and (not r["method"].startswith("original") or r["option"] != "none")),
                                      key=lambda r: (-budget_tier(r["ratio"]), -r["score"], r["ratio"]))
        for r in members:
            depths = r["depths"] or [None] * bins
            table.append([task, str(length), r["method"], f"{r['ratio']:.3f}", f"{r['full']}/{r['n']}",
                          *("-" if d is None else f"{d[0]}/{d[1]}" for d in depths)])
    lines += [markdown_table(["task", "length", "method", "bytes (ratio to bf16)", "full / n", *(f"depth {e}" for e in edges)], table,
                             align=["left", "right", "left", "right", "right"] + ["right"] * bins), ""]
    return lines


def plot_ruler(rows: list[dict]):
    """Score against bytes, one panel per (task, length)."""
    keys = sorted({(r["task"], r["length"]) for r in rows}, key=lambda k: (k[1], k[0]))
    figure, axes = new_figure(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (task, length) in zip(axes[0], keys):
        for r in (r for r in rows if (r["task"], r["length"]) == (task, length)):
            ax.errorbar([r["ratio"]], [r["score"]], yerr=[[r["score"] - r["low"]], [r["high"] - r["score"]]], fmt="o", capsize=3)
            ax.annotate(r["method"].replace("convert --cache-budget ", "budget "), (r["ratio"], r["score"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set(xscale="log", xlabel="cache bytes / bfloat16 original's", ylabel="score (lm-eval)", title=f"{task}, {length} tokens", ylim=(-0.05, 1.05))
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run")
    run_p.add_argument("--budgets", default="0.125,0.25")
    run_p.add_argument("--runs", type=Path, required=True, help="where the converted folders go (not git)")
    run_p.add_argument("--threads", type=int, default=None)
    run_p.add_argument("--storage", default=None, help="fix the cache storage (full, int8, int4[:...]); default: the planner chooses")
    run_p.add_argument("--at", type=int, default=None, help="the length the budget is planned at (convert --at; default 8192)")
    run_p.add_argument("--budget-windows", default=None, help="the windows the plan chooses from (convert --budget-windows, e.g. 256,128,64)")
    sub.add_parser("report")
    args = parser.parse_args()
    if args.command == "run":
        if args.threads:
            torch.set_num_threads(args.threads)
        windows = [int(w) for w in args.budget_windows.split(",")] if args.budget_windows else None
        run([float(b) for b in args.budgets.split(",")], args.runs, args.storage, args.at, windows)
    payload = json.loads(results_path(RESULTS, f"{NAME}.json").read_text())
    write_text(results_path(RESULTS, f"{NAME}.md"), render(payload))
    print(render(payload))
    rows = ruler_rows()
    if rows:
        write_text(results_path(RESULTS, "budget_comparison.md"), render_ruler(rows))
        save_figure(plot_ruler(rows), results_path(RESULTS, "budget_comparison.png"))


if __name__ == "__main__":
    main()
