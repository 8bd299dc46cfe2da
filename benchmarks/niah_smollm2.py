"""Long-context retrieval of SmolLM2-135M-Instruct, its conversions and kvpress's presses on the
same prompts (docs/evaluation.md, "Long-context retrieval on pretrained models").

    # 1. slimkv's models, one after another (resumable per cell; the first run also exports the prompts)
    .venv/bin/python benchmarks/niah_smollm2.py run smollm2 runs/smollm2-mla50 runs/smollm2-mla25 --threads 1
    # 2. the presses, in kvpress's own environment, on the exported prompts
    make bench-kvpress PROMPTS=runs/niah/smollm2/niah_prompts.json OUT=runs/kvpress/all
    # 3. the comparison: benchmarks/results/niah/niah_smollm2.{json,md,png}
    .venv/bin/python benchmarks/niah_smollm2.py report --runs runs/niah --kvpress runs/kvpress/*
    # bounded memory (docs/conversion.md, kvm): the original, rope-partial, kvm and streaming at 4K
    .venv/bin/python benchmarks/niah_smollm2.py run smollm2 runs/convert_kvm/kvm runs/convert_kvm/streaming --lengths 4k --runs runs/niah_kvm
    .venv/bin/python benchmarks/niah_smollm2.py report --runs runs/niah_kvm --out benchmarks/results/niah/niah_kvm_smollm2 \
        --title "bounded memory (kvm, streaming) at equal state bytes"
    # one more bounded model beside the committed rows (--add keeps the rows whose runs are not in --runs)
    .venv/bin/python benchmarks/niah_smollm2.py run runs/convert_kvm/mla-kvm --lengths 4k --runs runs/niah_kvm
    .venv/bin/python benchmarks/niah_smollm2.py report --add --runs runs/niah_kvm --out benchmarks/results/niah/niah_kvm_smollm2 --title "..."

The grid (``GRID``) is sized for the 2-core development box: 2 tasks x 3 depths x 1 sample = 6
prompts per length and model. ``report`` renders the markdown from the JSON only
(``slimkv.retrieval.comparison.render_markdown``), and ``check`` fails when the committed markdown
differs from what the committed JSON renders.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from slimkv.common.files import read_json, write_json, write_text
from slimkv.common.results import results_dir
from slimkv.eval.models import conversion_method
from slimkv.eval.ppl import perplexity_report
from slimkv.retrieval import models as retrieval
from slimkv.retrieval.comparison import comparison, generations_row, plot, render_markdown, slimkv_row
from slimkv.retrieval.grid import lengths_syntax, parse_lengths
from slimkv.retrieval.prompts import TASKS

RESULTS = Path(__file__).resolve().parent / "results"
PPL_FILE = "ppl.json"
PPL_TEXTS = ("shakespeare-val", "austen")  # the held-out plays and another author and era
NAME = "niah_smollm2"
GRID = {"tasks": ["passkey", "needle-number"], "depths": [0.1, 0.5, 0.9], "samples": 1, "seed": 0, "haystack": "shakespeare-val"}
# the same tasks with 40 prompts per length (2 tasks x 4 depths x 5 samples), enough for intervals that can separate methods
POWER_GRID = {"tasks": ["passkey", "needle-number"], "depths": [0.0, 0.25, 0.5, 0.75], "samples": 5, "seed": 0, "haystack": "shakespeare-val"}
GRIDS = {"main": GRID, "power": POWER_GRID}
NOTES = {
    "slimkv rows": "the model's own generate() over the whole prompt; budget = the cache ratio asked of `convert`, cache kept = achieved (a --cache-budget plan: its byte budget, and the bfloat16 bytes "
                   "measured at the length it was planned for); "
                   "bytes/token measured from the live cache after the prompt and the answer",
    "kvpress rows": "the press compresses the prefilled context (budget = cache kept = the fraction of its entries kept); the question and the answer are "
                    "appended uncompressed at their true positions, so bytes/token is above the budget by that tail",
}


def label_of(report: dict) -> str:
    identity = report["settings"]["identity"]
    converted = identity.get("converted")
    if converted:
        stage = "healed" if converted.get("healing") else "one-shot"
        plan = converted.get("budget_plan")
        if plan:  # convert --cache-budget: the budget and what the planner chose (its element ratio says neither)
            storage = plan["storage"].partition(":")[0]
            at = f" --at {plan['at']}" if plan["at"] != 8192 else ""  # --at defaults to SmolLM2's 8192 positions
            window = f", window {plan['window']}" if (converted.get("options") or {}).get("budget_windows") else ""
            return f"--cache-budget {plan['budget']:g}{at} ({storage}, {plan['exact_heads']} of {plan['total_heads']} heads exact{window}) {stage}"
        if converted["method"] == "hybrid":  # its ratio is the budget at the length it was planned for
            return f"{conversion_method(converted)} {converted['cache_ratio']:g} {stage}"
        if converted.get("achieved_cache_ratio") is None:  # kvm, mla-kvm, streaming, rope-partial: bounded or sized by their own options
            return f"{Path(report['settings']['model']).name} ({converted['method']}, bounded{', healed' if converted.get('healing') else ''})"
        return f"{converted['method']} {converted['cache_ratio']:g} {stage}"
    compressed = identity.get("compressed")
    if compressed:
        return f"{compressed['method']} ratio {compressed['ratio']:g}"
    return "original" if report["settings"]["model"] == "smollm2" else Path(report["settings"]["model"]).name


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = parse_lengths(args.lengths)
    grid = GRIDS[args.grid]
    for model in args.models:
        out = Path(args.runs) / Path(model).name
        print(f"=== {model}: {time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads", flush=True)
        retrieval.evaluate(model, tasks=[TASKS[t] for t in grid["tasks"]], lengths=lengths, depths=grid["depths"], samples=grid["samples"], seed=grid["seed"],
                           haystack=grid["haystack"], out_dir=out, export_prompts=True)


def ppl(args: argparse.Namespace) -> None:
    """Perplexity of each model and its original on two texts (1024-token windows, the first
    ``--max-tokens``), into RUNS/<model>/ppl.json, for the comparison's perplexity columns."""
    if args.threads:
        torch.set_num_threads(args.threads)
    for model in args.models:
        out = Path(args.runs) / Path(model).name / PPL_FILE
        results = {}
        for text in PPL_TEXTS:
            rows = perplexity_report(model, text, 1024, args.max_tokens, progress=False)["results"]
            results[text] = {"ppl": rows[-1]["ppl"], "original_ppl": rows[0]["ppl"], "tokens_predicted": rows[-1]["tokens_predicted"]}
        write_json(out, {"model": model, "max_tokens": args.max_tokens, "seq_len": 1024, "texts": results})
        print(f"{model}: " + ", ".join(f"{t} {r['ppl']:.2f} (original {r['original_ppl']:.2f})" for t, r in results.items()), flush=True)


def report(args: argparse.Namespace) -> None:
    runs = sorted(Path(args.runs).glob(f"*/{retrieval.RESULT_FILE}"))
    if not runs:
        raise SystemExit(f"--runs {args.runs}: no */{retrieval.RESULT_FILE} found; run `benchmarks/niah_smollm2.py run` first")
    reports = [(path, read_json(path, expect=dict)) for path in runs]
    grid = GRIDS[args.grid]
    for path, r in reports:  # a run measured on another grid than --grid says would be reported under the wrong header
        measured = {key: r["settings"].get(key) for key in ("depths", "samples", "seed")}
        if measured != {key: grid[key] for key in measured}:
            raise SystemExit(f"{path} was measured with {measured}, not the --grid {args.grid} grid ({ {k: grid[k] for k in measured} }); "
                             "give the --grid it was run with")
    rows = []
    for path, r in reports:
        row = slimkv_row(r, label_of(r), str(path.parent.name))
        if (path.parent / PPL_FILE).is_file():
            row["ppl"] = read_json(path.parent / PPL_FILE, expect=dict)["texts"]
        rows.append(row)
    out = Path(args.out)
    if args.add:  # the rows of the committed comparison whose runs are not in --runs (measured earlier, their folders gone)
        fresh = {row["label"] for row in rows}
        earlier = read_json(out.with_suffix(".json"), expect=dict)
        if earlier["grid"] != GRIDS[args.grid]:
            raise SystemExit(f"--add: {out.with_suffix('.json')} was measured on another grid ({earlier['grid']}); it cannot be extended")
        rows += [row for row in earlier["rows"] if row["tool"] == "slimkv" and row["label"] not in fresh]
    rows.sort(key=lambda row: (-row["cache_budget"], row["label"]))
    if args.kvpress:
        prompts = {}  # every exported prompt of every run (the same seed and tokenizer give the same prompt per id)
        for path, _ in reports:
            if (path.parent / retrieval.PROMPTS_FILE).is_file():
                prompts.update({p["id"]: p for p in read_json(path.parent / retrieval.PROMPTS_FILE, expect=dict)["prompts"]})
        merged: dict[str, dict] = {}  # one row per label: a press at a budget, over every prompt subset it ran on
        for path in sorted(p for folder in args.kvpress for p in Path(folder).glob("*.json")):
            generations = read_json(path, expect=dict)
            if generations.get("format") != "slimkv-niah-generations/1":
                continue
            row = merged.setdefault(generations["label"], {**generations, "generations": [], "seconds": 0.0, "sources": []})
            row["generations"] += generations["generations"]
            row["seconds"] += generations.get("seconds", 0.0)
            row["sources"].append(f"{path.parent.name}/{path.name}")
        rows += [generations_row(g, prompts, ", ".join(g["sources"])) for g in merged.values()]
    data = comparison(rows, GRIDS[args.grid], NOTES)
    if out.name != NAME:  # another comparison than the main one: its own file and title
        data.update(source=out.with_suffix(".json").name, title=args.title or out.name)
    write_json(out.with_suffix(".json"), data)
    write_text(out.with_suffix(".md"), render_markdown(data))
    plot(data, out.with_suffix(".png"))
    print(render_markdown(data))
    print(f"wrote {out.with_suffix('.json')}, .md and .png")


def check(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.with_suffix(".md").read_text(encoding="utf-8") != render_markdown(read_json(out.with_suffix(".json"), expect=dict)):
        raise SystemExit(f"{out.with_suffix('.md')} differs from what {out.with_suffix('.json')} renders; run `benchmarks/niah_smollm2.py report`")
    print("ok")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="evaluate slimkv models on the grid (resumable)")
    r.add_argument("models", nargs="+", help="`smollm2` and/or converted or compressed model folders")
    r.add_argument("--lengths", default="1k,2k,4k,8128", help=f"prompt lengths, {lengths_syntax()} (default 1k,2k,4k,8128: 8128 is the longest "
                   "that leaves SmolLM2's 8192 positions room for the answer)")
    r.add_argument("--runs", default="runs/niah", help="where each model's niah.json goes (default runs/niah)")
    r.add_argument("--threads", type=int, default=None, help="torch threads")
    r.add_argument("--grid", choices=GRIDS, default="main", help="main: 6 prompts per length (the committed comparison); power: 40")
    r.set_defaults(func=run)
    q = sub.add_parser("ppl", help="perplexity of each model (and its original) on the held-out plays and Austen")
    q.add_argument("models", nargs="+")
    q.add_argument("--runs", default="runs/niah")
    q.add_argument("--max-tokens", type=int, default=8192, help="tokens of each text (default 8192)")
    q.add_argument("--threads", type=int, default=None)
    q.set_defaults(func=ppl)
    s = sub.add_parser("report", help="merge the runs and the kvpress generations into the comparison")
    s.add_argument("--runs", default="runs/niah", help="folder of */niah.json (default runs/niah)")
    s.add_argument("--kvpress", nargs="*", default=[], help="folders of kvpress generation files (benchmarks/kvpress_niah.py --out)")
    s.add_argument("--out", default=str(results_dir(RESULTS, NAME) / NAME), help="output path without suffix (default benchmarks/results/niah/niah_smollm2)")
    s.add_argument("--title", default=None, help="the title's subject for another --out than the default")
    s.add_argument("--grid", choices=GRIDS, default="main", help="the grid the runs were measured on (as `run --grid`)")
    s.add_argument("--add", action="store_true", help="keep the slimkv rows of the --out JSON there whose runs are not in --runs (the new runs' rows replace theirs)")
    s.set_defaults(func=report)
    c = sub.add_parser("check", help="the committed markdown matches what its JSON renders")
    c.add_argument("--out", default=str(results_dir(RESULTS, NAME) / NAME))
    c.set_defaults(func=check)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
