"""Bounded-memory conversions of SmolLM2-135M (``slimkv convert --to kvm``): perplexity on long
windows, by position, in and out of domain, beside the original and the ablations that price
each step.

Each ``--runs LABEL=TO`` entry is converted with ``slimkv convert --to TO`` into ``--work/LABEL``
(a folder converted earlier with the same options is reused), then every model, the original
included, scores the same ``--windows`` windows of ``--seq-len`` + 1 tokens of each ``--texts``
entry (default: the held-out plays and Jane Austen, neither in the calibration mix): perplexity
over all positions and by position bucket, so that positions the exact window covers and those
that need the compressed state are reported apart. The state's size comes from each conversion's
manifest (float32 bytes by context, beside the original's).

    .venv/bin/python benchmarks/convert_kvm.py
    .venv/bin/python benchmarks/convert_kvm.py --runs rope16=rope-partial kvm=kvm streaming=streaming:window=769 --windows 2
    .venv/bin/python benchmarks/convert_kvm.py --add --runs kvm-rope24=kvm:rope_pairs=24   # evaluate one more, keep the rows there
    .venv/bin/python benchmarks/convert_kvm.py --add --runs mla-kvm=mla-kvm@0.5   # a method sized by a ratio: @RATIO

``--add`` keeps the rows of the results file already there (the same texts, windows and length)
and evaluates only the runs it does not hold. Every row records the torch threads and the load it
was evaluated under (``--add`` rows ran later, maybe with other settings); ``settings.threads`` is
the last run's.

Writes benchmarks/results/convert/<name>.json, .md, .png (mean NLL by position bucket, per text) and
<name>_state.png (cache bytes against context: the original's grows, a bounded kind's stays flat).
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
from slimkv.common.vocabulary import in_todays_words
from slimkv.convert.manifest import finished_conversion
from slimkv.convert.pipeline import ConvertOptions, check_before_work, convert_pretrained
from slimkv.data.texts import evaluation_text, tokenize
from slimkv.eval.models import load_language_model
from slimkv.eval.positions import bucket_means, position_nll
from slimkv.pretrained import fetch_smollm2
from slimkv.pretrained.loading import CONVERTED_MANIFEST

RESULTS = Path(__file__).resolve().parent / "results"
KVM_RECIPE = "chunk_size=128,sink_len=4"  # the measured kvm runs (the conversion's defaults before they became the layer's)
DEFAULT_RUNS = ("rope-partial=rope-partial", f"kvm-oneshot=kvm:{KVM_RECIPE},transfer_steps=0", f"kvm=kvm:{KVM_RECIPE}",
                "streaming=streaming:window=769")  # streaming: that kvm's bytes at 8K (4 sinks + 768)


def parse_run(text: str) -> tuple[str, str]:
    label, sep, method = text.partition("=")
    if not sep or not label or not method:
        raise SystemExit(f"--runs {text!r}: expected LABEL=METHOD[:KEY=VALUE,...][@RATIO], e.g. kvm=kvm:min_rows=512 or mla-kvm=mla-kvm@0.5")
    return label, method


def split_ratio(method: str) -> tuple[str, float | None]:
    """``METHOD[:OPTIONS][@RATIO]`` -> (the --to text, the --cache-ratio or None)."""
    to, sep, ratio = method.rpartition("@")
    if not sep:
        return method, None
    try:
        return to, float(ratio)
    except ValueError:
        raise SystemExit(f"--runs ...={method}: the text after @ must be a cache ratio, e.g. mla-kvm@0.5") from None


def converted(model: str, label: str, method: str, work: Path, seed: int) -> Path:
    """The folder of ``method``'s conversion under ``work``, converted now unless one with the same
    options is there (healed or not: a healed folder is evaluated as it is)."""
    out = work / label
    to, ratio = split_ratio(method)
    options = ConvertOptions(method=to, cache_ratio=ratio, seed=seed)
    if finished_conversion(out, options) is not None:
        print(f"{label}: reusing {out}", flush=True)
        return out
    check_before_work(model, options, out)
    started = time.perf_counter()
    convert_pretrained(model, options, out, progress=True)
    print(f"{label}: converted in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def text_windows(tokenizer, text: str, seq_len: int, count: int) -> torch.Tensor:
    """``count`` consecutive windows of seq_len + 1 tokens from the start of ``text``."""
    ids = torch.tensor(tokenize(tokenizer, evaluation_text(text)), dtype=torch.long)
    need = count * (seq_len + 1)
    if len(ids) < need:
        raise SystemExit(f"--texts {text}: {len(ids)} tokens, {need} needed for {count} windows of {seq_len + 1}")
    return ids[:need].view(count, seq_len + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="LABEL=METHOD[:KEY=VALUE,...] conversions (default: %(default)s)")
    p.add_argument("--texts", nargs="+", default=["shakespeare-val", "austen"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--windows", type=int, default=2, help="windows per text")
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--work", default="runs/convert_kvm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="convert_kvm_smollm2")
    p.add_argument("--add", action="store_true", help="keep the rows of the results file there (also those another --add run writes meanwhile); "
                   "evaluate only new runs")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [parse_run(r) for r in args.runs]
    rows, methods = [], {}
    if args.add:
        earlier = read_results(results_dir(RESULTS, args.name) / f"{args.name}.json")
        same = {k: earlier["settings"][k] for k in ("seq_len", "windows", "texts")} == {"seq_len": args.seq_len, "windows": args.windows, "texts": args.texts}
        if not same:
            raise SystemExit(f"--add: {args.name}.json was measured with {earlier['settings']}; give the same --seq-len, --windows and --texts")
        rows, methods = earlier["rows"], earlier["settings"]["runs"]
        runs = [(label, method) for label, method in runs if label not in {row["label"] for row in rows}]
    methods.update(dict(runs))
    model = str(fetch_smollm2())
    folders = {label: converted(model, label, method, Path(args.work), args.seed) for label, method in runs}
    todo = ([] if rows else [("original", model)]) + list(folders.items())
    for label, path in todo:
        loaded = load_language_model(str(path))
        manifest = read_json(Path(path) / CONVERTED_MANIFEST) if label != "original" else {}
        row = {"label": label, "method": dict(runs).get(label), "cache_bytes": manifest.get("cache_bytes"),
               "refinement": {k: v for k, v in (manifest.get("refinement") or {}).items() if k != "layers"}, "texts": {},
               "healing": healing_summary(manifest.get("healing")),
               "threads": torch.get_num_threads(), "load_average_1min": {"before": os.getloadavg()[0]}}  # per row: --add runs differ
        for text in args.texts:
            windows = text_windows(loaded.tokenizer, text, args.seq_len, args.windows)
            started = time.perf_counter()
            with torch.no_grad():
                nll = position_nll(loaded.model, windows, batch_size=1, progress=True)
            row["texts"][text] = {"ppl": float(nll.mean().exp()), "mean_nll": float(nll.mean()), "tokens": nll.numel(),
                                  "buckets": bucket_means(nll, args.buckets), "seconds": time.perf_counter() - started}
            print(f"{label:>14} {text:>16}: ppl {row['texts'][text]['ppl']:.3f}", flush=True)
        row["load_average_1min"]["after"] = os.getloadavg()[0]
        rows.append(row)
        del loaded
    if args.add:  # rows another --add run wrote meanwhile (each run read the file when it started) stay
        latest = read_results(results_dir(RESULTS, args.name) / f"{args.name}.json")
        mine = {row["label"] for row in rows}
        rows += [row for row in latest["rows"] if row["label"] not in mine]
        methods = {**latest["settings"]["runs"], **methods}
    base = rows[0]["texts"]
    for row in rows:
        for text, r in row["texts"].items():
            r["ppl_vs_original"] = r["ppl"] / base[text]["ppl"]
    settings = {"seq_len": args.seq_len, "windows": args.windows, "texts": args.texts, "runs": methods, "seed": args.seed,
                "threads": torch.get_num_threads(), "load_average_at_end": os.getloadavg()}
    write_results(args.name, {"settings": settings, "rows": rows}, results_dir(RESULTS, args.name))
    (results_dir(RESULTS, args.name) / f"{args.name}.md").write_text(format_markdown(settings, rows))
    plot(rows, args.texts, results_dir(RESULTS, args.name) / f"{args.name}.png")
    plot_state(rows, results_dir(RESULTS, args.name) / f"{args.name}_state.png")
    print(format_markdown(settings, rows))


def read_results(path: Path) -> dict:
    """A results file of this script, its methods spelled as today (one written before the renames of
    ``slimkv.common.vocabulary`` reads in today's words, the old kvm defaults written out)."""
    return in_todays_words(read_json(path))


def healing_summary(healing: dict | None) -> dict | None:
    """What a results row keeps of a conversion's healing record (``slimkv convert --heal-tokens``)."""
    if not healing:
        return None
    config = healing.get("heal_config", {})
    return {"status": healing.get("status"), "tokens_seen": healing.get("tokens_seen"), "train_seconds": healing.get("train_seconds"),
            "threads": healing.get("threads"), "text": config.get("text"), "seq_len": config.get("seq_len"), "lr": config.get("lr"),
            "params": config.get("params"), "val_kl": healing.get("val_kl"), "load_average_1min": healing.get("load_average_1min")}


def format_markdown(settings: dict, rows: list[dict]) -> str:
    texts = settings["texts"]
    lines = [f"# Bounded-memory conversions of SmolLM2-135M ({settings['windows']} windows of {settings['seq_len']} tokens per text)", "",
             "Generated by `benchmarks/convert_kvm.py` from its JSON; perplexity over every position, and the ratio to the original's.", "",
             "| model | method | " + " | ".join(f"{t} ppl (x original)" for t in texts) + " | cache at 8K (x original) |",
             "| --- | --- | " + " | ".join("---:" for _ in texts) + " | ---: |"]
    for row in rows:
        at8k = next((c["ratio"] for c in row["cache_bytes"] or [] if c["context"] == 8192), 1.0)
        cells = [f"{row['texts'][t]['ppl']:.2f} ({row['texts'][t]['ppl_vs_original']:.3f})" for t in texts]
        healed = row.get("healing")
        method = (row["method"] or "-") + (f", healed on {healed['tokens_seen']:,} tokens ({healed['train_seconds'] / 60:.0f} min)" if healed else "")
        lines.append(f"| {row['label']} | {method} | " + " | ".join(cells) + f" | {at8k:.3f} |")
    for text in texts:
        edges = [f"{b['start']}-{b['end']}" for b in rows[0]["texts"][text]["buckets"]]
        lines += ["", f"Mean NLL by position, {text}:", "", "| model | " + " | ".join(map(str, edges)) + " |", "| --- |" + " ---: |" * len(edges)]
        for row in rows:
            lines.append(f"| {row['label']} | " + " | ".join(f"{b['mean_nll']:.3f}" for b in row["texts"][text]["buckets"]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], texts: list[str], path: Path) -> None:
    fig, axes = new_figure(1, len(texts), figsize=(5.0 * len(texts), 3.6), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for row in rows:
            buckets = row["texts"][text]["buckets"]
            ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["mean_nll"] for b in buckets], marker="o", label=row["label"])
        ax.set_title(text)
        ax.set_xlabel("position")
        ax.set_ylabel("mean NLL (nats)")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def plot_state(rows: list[dict], path: Path) -> None:
    """float32 cache bytes against context, from each conversion's manifest: the original's line
    grows with the context, a bounded kind's stays flat."""
    fig, ax = new_figure(figsize=(6.0, 4.0))
    table = next(row["cache_bytes"] for row in rows if row["cache_bytes"])
    ax.plot([c["context"] for c in table], [c["original_bytes"] / 2**20 for c in table], marker="o", label="original")
    for row in rows:
        if row["cache_bytes"]:
            ax.plot([c["context"] for c in row["cache_bytes"]], [c["bytes"] / 2**20 for c in row["cache_bytes"]], marker=".", label=row["label"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("cache, float32 (MiB)")
    ax.set_title("SmolLM2-135M: cache against context", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
