"""Conversions of SmolLM2-135M: perplexity in and out of domain, and the live cache.

For each ``METHOD:RATIO`` the model is converted (``slimkv convert``, calibrated on ``--calib``,
convert's default mix unless given; one-shot unless ``--heal-tokens``: then healed by distillation
on ``--heal-text``; a folder already converted with the same options under ``--work`` is reused),
then evaluated on the first
``--eval-tokens`` tokens of each ``--texts`` entry (default: the held-out plays, in domain, and
Jane Austen, out of domain) in 1024-token windows, and its live cache is measured after a real
``generate()`` to ``--context`` tokens. The original is evaluated once per text in the same run.

    .venv/bin/python benchmarks/convert_oneshot.py
    .venv/bin/python benchmarks/convert_oneshot.py --runs mla:0.5 lrkv:0.5 --eval-tokens 4096
    .venv/bin/python benchmarks/convert_oneshot.py --calib shakespeare --name convert_oneshot_plays_smollm2
    .venv/bin/python benchmarks/convert_oneshot.py --runs mla:0.5 --heal-tokens 100000 --name convert_healed_smollm2
    .venv/bin/python benchmarks/convert_oneshot.py --name convert_smollm2 --plot-from benchmarks/results/convert/convert_{oneshot,healed}_smollm2.json
    .venv/bin/python benchmarks/convert_oneshot.py --runs latent:0.5 --heal-tokens 30000 --name heal_curve_latent05_30000   # one curve point
    .venv/bin/python benchmarks/convert_oneshot.py --runs latent:0.25 --heal-tokens 30000 --heal-lr 3e-4 --name heal_lr_latent025_3e-4   # learning rate
    .venv/bin/python benchmarks/convert_oneshot.py --name heal_curve_latent_smollm2 --curve-from benchmarks/results/heal/heal_curve_*.json ...

Writes benchmarks/results/<experiment>/<name>.json, .md and .png (convert/, or heal/ for a name heal_*: slimkv.common.results) (perplexity / original's against live cache ratio).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from slimkv.common.files import read_json, save_figure
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.convert.heal import PARAMETER_SETS, HealConfig
from slimkv.convert.manifest import finished_conversion
from slimkv.convert.pipeline import ConvertOptions, check_before_work, convert_pretrained
from slimkv.data.texts import evaluation_text
from slimkv.eval.cache import cache_report
from slimkv.eval.models import load_language_model
from slimkv.eval.ppl import perplexity
from slimkv.pretrained import fetch_smollm2

RESULTS = Path(__file__).resolve().parent / "results"  # where this repository keeps benchmark results
DEFAULT_RUNS = ["mla:0.5", "lrkv:0.5", "gqa:0.5", "mla-prefix:0.5", "mla:0.375", "lrkv:0.375", "gqa:0.34", "mla:0.25"]


def parse_run(text: str) -> tuple[str, float]:
    method, _, ratio = text.rpartition(":")
    if not method:
        raise SystemExit(f"--runs entry {text!r}: expected METHOD[:OPTIONS]:RATIO, e.g. mla:0.5 or latent:weighting=rootcov:0.5")
    return method, float(ratio)


def converted_folder(work: Path, options: ConvertOptions, heal: HealConfig | None, progress: bool) -> tuple[Path, dict, float | None]:
    """The conversion's folder (reused if it holds the same finished conversion), its manifest and
    the seconds a new conversion (and healing) took."""
    calib = options.calib.replace(",", "+").replace("/", "_")
    out = work / (f"{options.method}_{options.cache_ratio}_{calib}" + (f"_seed{options.seed}" if options.seed else "")
                  + (f"_heal{heal.tokens}_{heal.text.replace(',', '+')}" if heal else "")
                  + (f"_{heal.params}" if heal and heal.params != HealConfig.params else "")
                  + (f"_lr{heal.lr:g}" if heal and heal.lr != HealConfig.lr else ""))
    manifest = finished_conversion(out, options)
    if manifest is not None:
        healing = manifest.get("healing") or {}
        if (healing.get("status") == "finished" and healing.get("config") == heal.to_dict()) if heal else not healing:
            return out, manifest, None
    started = time.perf_counter()
    _, manifest = convert_pretrained("smollm2", options, out, heal_cfg=heal, progress=progress)
    return out, manifest, time.perf_counter() - started


def plot(results: list[dict]):
    """Perplexity / original's against the live cache ratio of every row of ``results`` (payloads
    of this script): colour = method, marker = text, dashed and hollow = healed."""
    figure, ax = new_figure()
    methods = list(dict.fromkeys(r["method"] for result in results for r in result["rows"]))
    colors = {method: f"C{i % 10}" for i, method in enumerate(methods)}
    for result in results:
        healed = bool(result.get("heal_tokens"))
        for name, marker in zip(result["texts"], "os^v"):
            for method in methods:
                mine = sorted((r for r in result["rows"] if r["method"] == method), key=lambda r: r["live_cache_ratio"])
                if mine:
                    ax.plot([r["live_cache_ratio"] for r in mine], [r["ppl_over_original"][name] for r in mine], marker=marker, color=colors[method],
                            linestyle="--" if healed else "-", markerfacecolor="none" if healed else colors[method],
                            label=f"{method}, {name}" + (f", healed {result['heal_tokens']:,} tokens" if healed else ""))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("live cache / original's cache (measured after generate())")
    ax.set_ylabel("perplexity / original's")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M converted to a smaller KV cache")
    ax.legend(fontsize=6, ncols=2)
    return figure


def curve_plot(results: list[dict]):
    """Perplexity / original's against healing tokens (0: one-shot) of the ``latent`` rows of
    ``results`` (``claims_md.healing.curve_points``): colour = cache ratio, marker = text."""
    from claims_md.healing import curve_points  # benchmarks/claims_md, beside this script

    figure, ax = new_figure()
    for i, (ratio, points) in enumerate(sorted(curve_points(results).items(), reverse=True)):
        tokens = sorted(points)
        for name, marker in zip(results[0]["texts"], "os^v"):
            ax.plot(tokens, [points[t][0]["ppl_over_original"][name] for t in tokens], marker=marker, color=f"C{i}", label=f"R = {ratio}, {name}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("healing tokens (0: one-shot)")
    ax.set_ylabel("perplexity / original's")
    ax.set_title("SmolLM2-135M -> latent: perplexity against healing tokens")
    ax.legend(fontsize=7)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help=f"METHOD:RATIO entries (default {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--texts", nargs="+", default=["shakespeare-val", "austen"], help="evaluation texts (first: in domain)")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="tokens of each text evaluated (default 8192)")
    parser.add_argument("--context", type=int, default=2048, help="context of the live-cache measurement (default 2048)")
    parser.add_argument("--work", default="runs/convert_oneshot", help="where converted folders are written and reused")
    parser.add_argument("--calib", default=ConvertOptions.calib, help=f"calibration text, as convert's --calib (default {ConvertOptions.calib})")
    parser.add_argument("--heal-tokens", type=int, default=0, help="heal every conversion on this many tokens of --heal-text (default 0: one-shot)")
    parser.add_argument("--heal-params", default=HealConfig.params, choices=PARAMETER_SETS,
                        help=f"what healing trains, as convert's --heal-params (default {HealConfig.params})")
    parser.add_argument("--heal-text", default=HealConfig.text, help=f"healing text, as convert's --heal-text (default {HealConfig.text})")
    parser.add_argument("--heal-lr", type=float, default=HealConfig.lr, help=f"peak healing learning rate, as convert's --heal-lr (default {HealConfig.lr:g})")
    parser.add_argument("--seed", type=int, default=0, help="calibration (and healing) seed of every conversion (default 0)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="convert_oneshot_smollm2")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                        help="only redraw one figure from result files of this script (e.g. one-shot and healed) into <--name>.png")
    parser.add_argument("--curve-from", nargs="+", default=None, metavar="JSON",
                        help="only draw perplexity against healing tokens of the latent rows of these result files into <--name>.png")
    args = parser.parse_args()
    if args.plot_from or args.curve_from:
        path = results_dir(RESULTS, args.name) / f"{args.name}.png"
        draw = plot if args.plot_from else curve_plot
        save_figure(draw([read_json(p, expect=dict) for p in args.plot_from or args.curve_from]), path)
        print(f"wrote {path}")
        return
    runs = [parse_run(r) for r in args.runs]
    fetch_smollm2()
    heal = HealConfig(tokens=args.heal_tokens, text=args.heal_text, params=args.heal_params, lr=args.heal_lr, seed=args.seed) if args.heal_tokens else None
    for method, ratio in runs:  # every entry checked before the first conversion
        check_before_work("smollm2", ConvertOptions(method, ratio, calib=args.calib, seed=args.seed), None, heal)
    torch.set_num_threads(args.threads)
    texts = {name: evaluation_text(name) for name in args.texts}
    work = Path(args.work)

    original = load_language_model("smollm2")
    baseline = {name: perplexity(original.model, original.tokenizer, text, 1024, args.eval_tokens)["ppl"] for name, text in texts.items()}
    del original
    print("original: " + ", ".join(f"{n} {p:.2f}" for n, p in baseline.items()), flush=True)
    rows = []
    for method, ratio in runs:
        load_before = os.getloadavg()[0]
        out, manifest, seconds = converted_folder(work, ConvertOptions(method, ratio, calib=args.calib, seed=args.seed), heal, not args.no_progress)
        loaded = load_language_model(str(out))
        ppl = {name: perplexity(loaded.model, loaded.tokenizer, text, 1024, args.eval_tokens)["ppl"] for name, text in texts.items()}
        del loaded
        live = cache_report(str(out), args.context)
        row = {"method": method, "cache_ratio": ratio, "achieved_cache_ratio": manifest["achieved_cache_ratio"],
               "live_cache_ratio": live["ratio_to_original"], "live_bytes_per_token": live["model"]["bytes_per_token"],
               "ppl": ppl, "ppl_over_original": {n: p / baseline[n] for n, p in ppl.items()}, "convert_seconds": seconds,
               "healing": manifest.get("healing"), "plan": manifest.get("allocation"), "sensitivity": manifest.get("sensitivity"),
               "layer_options": [entry["options"] for entry in manifest["layers"]],
               "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}, "folder": str(out)}
        rows.append(row)
        print(f"{method:<10} R={ratio:<5} live cache {row['live_cache_ratio']:.3f}: " + ", ".join(
            f"{n} {p:.2f} ({row['ppl_over_original'][n]:.2f}x)" for n, p in ppl.items()), flush=True)

    payload = {"model": "smollm2", "threads": args.threads, "calib": args.calib, "seed": args.seed, "heal_tokens": args.heal_tokens, "heal_text": args.heal_text if heal else None, "heal_params": args.heal_params if heal else None, "heal_lr": args.heal_lr if heal else None,
               "eval_tokens": args.eval_tokens, "seq_len": 1024, "context": args.context,
               "texts": args.texts, "original_ppl": baseline, "rows": rows}
    path = write_results(args.name, payload, results_dir(RESULTS, args.name), plot([payload]))
    what = (f"healed on {args.heal_tokens:,} tokens of {args.heal_text}, peak learning rate {args.heal_lr:g}" if args.heal_tokens else "one-shot")
    lines = [f"# Conversion of SmolLM2-135M, calibrated on {args.calib}, {what} ({args.eval_tokens} tokens per text, 1024-token windows, {args.threads} threads)", "",
             "original: " + ", ".join(f"{n} {p:.2f}" for n, p in baseline.items()), "",
             "| method | R asked | live cache ratio | " + " | ".join(f"{n} ppl (x original)" for n in texts) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in texts) + " |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['cache_ratio']} | {r['live_cache_ratio']:.3f} | "
                     + " | ".join(f"{r['ppl'][n]:.2f} ({r['ppl_over_original'][n]:.2f}x)" for n in texts) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
