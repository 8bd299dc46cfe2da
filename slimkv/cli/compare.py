"""``slimkv compare``, ``slimkv report`` and ``slimkv sweep lrkv`` (see ``slimkv.bench.compare``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from slimkv.bench.compare import DEFAULT_EVAL_TOKENS, run_compare
from slimkv.bench.entries import (
    parse_contexts,
    parse_entries,
    parse_kind_overrides,
    parse_ranks,
    parse_seeds,
    split_entries,
    sweep_specs,
)
from slimkv.bench.report import load_report, render_markdown, write_report_files
from slimkv.common.checks import check_int
from slimkv.common.files import read_json
from slimkv.common.workers import check_workers
from slimkv.data import prepare_shakespeare
from slimkv.data.texts import evaluation_text
from slimkv.recall import frontier as recall
from slimkv.train.config import load_config, parse_override

# recipe flags shared by compare and sweep: flag -> TrainConfig key (the attention and the seed
# are what these commands set themselves)
RECIPE_FLAGS = {
    "--dataset": ("dataset", str),
    "--steps": ("steps", int),
    "--lr": ("lr", float),
    "--batch-size": ("batch_size", int),
    "--seq-len": ("seq_len", int),
    "--d-model": ("d_model", int),
    "--n-layers": ("n_layers", int),
    "--n-heads": ("n_heads", int),
    "--device": ("device", str),
}


def _add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of training options (the shared recipe; see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="set any training option of the recipe (e.g. --set warmup_steps=20)")
    for flag, (key, kind) in RECIPE_FLAGS.items():
        p.add_argument(flag, type=kind, help=f"recipe {key}")
    p.add_argument("--seeds", default="3", help="a count (3 = seeds base..base+2, base = the recipe's seed) or a list (0,1,2); default 3")
    p.add_argument("--kind-option", dest="kind_options", action="append", default=[], metavar="KIND.NAME=VALUE",
                   help="change the default table for a kind (e.g. lrkv.rank=16); an entry's own options still win")
    p.add_argument("--eval-tokens", type=int, default=None, help="val tokens evaluated per run (default 32768; 0 = the whole split)")
    p.add_argument("--decode-contexts", "--decode-context", dest="decode_contexts", default="256,1024,4096",
                   help="contexts for the one-layer decode latency (comma-separated; 'none' skips it); the table shows the largest")
    p.add_argument("--other-text", default=None, metavar="TEXT", help="also evaluate every run on this text: austen (out of domain) or a local file/folder")
    p.add_argument("--decode-repeats", type=int, default=5, help="timed calls per round of the decode measurement (default 5)")
    p.add_argument("--workers", type=int, default=1, help="runs trained at once, each in its own process on one torch thread (default 1; "
                   "2 on a 2-core machine trains about twice as fast, with the same numbers)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder: runs/, report.json, report.md, PNGs (re-running reuses finished runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def recipe_from_args(args: argparse.Namespace):
    """The shared TrainConfig: defaults, then --config, then the recipe flags, then --set."""

    overrides = {}
    for flag, (key, _) in RECIPE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[key] = value
    for text in args.overrides:
        key, value = parse_override(text)
        if key.split(".")[0] in ("attention", "attention_options", "kind_options", "seed"):
            raise ValueError(f"--set {key}: the attention and the seed are set per entry (--kinds, --kind-option, --seeds), not for the recipe")
        overrides[key] = value
    return load_config(args.config, overrides)


def _run(args: argparse.Namespace, specs: list[str], title: str) -> int:

    recipe = recipe_from_args(args)
    entries = parse_entries(specs, recipe, parse_kind_overrides(args.kind_options))
    seeds = parse_seeds(args.seeds, recipe.seed)
    contexts = parse_contexts(args.decode_contexts)
    check_int("--decode-repeats", args.decode_repeats, 1)
    check_workers(args.workers, "--workers")
    if args.eval_tokens is not None and args.eval_tokens < 0:
        raise ValueError(f"--eval-tokens must be >= 0 (0 = the whole val split), got {args.eval_tokens}")
    eval_tokens = DEFAULT_EVAL_TOKENS if args.eval_tokens is None else (args.eval_tokens or None)
    prepare = (lambda: prepare_shakespeare(progress=not args.no_progress)) if recipe.dataset == "shakespeare" else None
    if args.other_text is not None:
        evaluation_text(args.other_text)  # fetch / read it before any training (errors name the text)
    run_compare(entries, recipe, seeds, Path(args.out), eval_tokens=eval_tokens, decode_contexts=contexts, decode_repeats=args.decode_repeats,
                other_text=args.other_text, title=title, progress=not args.no_progress, prepare=prepare, workers=args.workers)
    return 0


def _compare(args: argparse.Namespace) -> int:

    return _run(args, split_entries(args.kinds), "Attention comparison")


def _sweep(args: argparse.Namespace) -> int:

    return _run(args, sweep_specs(args.kind, parse_ranks(args.ranks)), "LRKV rank sweep")


def _report(args: argparse.Namespace) -> int:

    path = Path(args.report)
    out = Path(args.out) if args.out else path.parent
    if path.is_file() and recall.is_recall_report(read_json(path)):
        report = recall.load_recall_report(path)
        out.mkdir(parents=True, exist_ok=True)
        written = recall.write_report_files(report, out)
        print(recall.render_markdown(report).split("\n## Accuracy by")[0])
    else:
        report = load_report(path)
        written = write_report_files(report, out)
        print(render_markdown(report).split("\n## Options")[0])
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_commands(subparsers) -> None:
    """Register ``compare``, ``report`` and ``sweep`` on the top-level ``slimkv`` parser."""
    c = subparsers.add_parser(
        "compare",
        help="train every attention kind with one recipe over several seeds; report BPB against cache size",
        description=(
            "Train one small LM per entry and seed with ONE recipe (only the attention changes), evaluate val CE/BPB, "
            "measure cache bytes per token (per layer, per model, ratio to MHA), one-layer decode latency and head "
            "diversity; aggregate over seeds (mean, std, min/max) and write report.json, report.md, bpb_vs_cache.png and "
            "decode_vs_context.png into --out. Entries are KIND or KIND:NAME=VALUE,... (lrkv:rank=8, gqa:n_kv_heads=1); "
            "KIND+KIND is a per-layer pattern (swa+kvm:swa.window=32). Unset options come from a default table that puts "
            "the tunable kinds at about half of MHA's cache. Finished runs in --out are reused."
        ),
        epilog=(
            "examples:\n"
            "  slimkv compare --kinds mha,gqa,mqa,lrkv --seeds 3 --out runs/compare\n"
            "  slimkv compare --kinds mha,lrkv:rank=4,lrkv:rank=8,mla,swa+kvm --seeds 2 --steps 300 --out runs/c2\n"
            "  slimkv compare --kinds mha,lrkv --kind-option lrkv.rank=16 --config configs/small.yaml --out runs/c3"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--kinds", required=True, nargs="+", metavar="ENTRIES",
                   help="entries (KIND[+KIND][:NAME=VALUE,...]), separated by spaces or commas, e.g. mha,gqa,mqa,mla,lrkv,kvm,lrkv:rank=4")
    _add_recipe_arguments(c)
    c.set_defaults(func=_compare)

    s = subparsers.add_parser(
        "sweep",
        help="LRKV rank sweep: val BPB against cache ratio (with mha/gqa/mqa references)",
        description="A compare over lrkv:rank=r for every --ranks value plus mha, gqa and mqa with one recipe; writes the same report.",
    )
    s.add_argument("kind", choices=["lrkv"], help="the mechanism to sweep")
    s.add_argument("--ranks", required=True, help="comma-separated ranks, e.g. 0,4,8,16")
    _add_recipe_arguments(s)
    s.set_defaults(func=_sweep)

    r = subparsers.add_parser("report", help="regenerate report.md and the plots of a compare, sweep or recall frontier from its report.json")
    r.add_argument("report", metavar="REPORT.json", help="report.json written by `slimkv compare`, `slimkv sweep` or `slimkv eval recall`")
    r.add_argument("--out", default=None, metavar="DIR", help="folder for report.md and the PNGs (default: the JSON's folder)")
    r.set_defaults(func=_report)
