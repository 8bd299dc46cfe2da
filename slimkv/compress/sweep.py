"""Methods x ratios in one run: perplexity, parameters, analytic FLOPs and measured CPU latency.

Every compressed model is calibrated on the same calibration windows and evaluated on the same
held-out tokens as the dense model, whose numbers come from the same run. Writes a markdown table,
a JSON file and a PNG (perplexity against ratio per method, log scale: the shape of the
LatentLLM paper's Table 2).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from slimkv.common.checks import close_matches
from slimkv.common.files import write_text
from slimkv.common.plotting import new_figure
from slimkv.common.timing import write_results
from slimkv.compress.cost import cost_summary, prefill_latency
from slimkv.compress.methods import METHODS
from slimkv.compress.options import CompressOptions
from slimkv.compress.workflow import DEFAULT_CALIB, DEFAULT_CALIB_SEQ_LEN, DEFAULT_CALIB_TOKENS, calibration_set, compress_loaded
from slimkv.data.texts import AUSTEN, EVAL_SHAKESPEARE, evaluation_text, text_sha256, tokenize
from slimkv.pretrained import SMOLLM2, LoadedModel, fetch_smollm2, load_pretrained
from slimkv.scoring import perplexity_of_ids

# Method labels a sweep accepts: the four methods plus latentllm with one component switched off.
VARIANTS: dict[str, tuple[str, dict[str, bool]]] = {
    **{name: (name, {}) for name in METHODS},
    "latentllm-no-joint-qk": ("latentllm", {"joint_qk": False}),
    "latentllm-no-joint-mlp": ("latentllm", {"joint_mlp": False}),
    "latentllm-no-identity-block": ("latentllm", {"identity_block": False}),
    "latentllm-rope-blind-qk": ("latentllm", {"rope_aware_qk": False}),
}

# In-domain text first (the held-out plays), then the out-of-domain one (Austen's novels).
DEFAULT_TEXTS = (EVAL_SHAKESPEARE, AUSTEN)


def variant(label: str) -> tuple[str, dict[str, Any]]:
    """(method, CompressOptions overrides) of a sweep label: a name in ``VARIANTS``, optionally
    followed by ``+field=value`` settings (``latentllm+cov_shrinkage=0.1+rank_allocation=spectrum``).
    ValueError naming the label, the field or the value."""
    name, *settings = label.split("+")
    if name not in VARIANTS:
        raise ValueError(f"--methods: unknown {name!r} in {label!r}{close_matches(name, VARIANTS)}; choose from {', '.join(VARIANTS)}")
    method, overrides = VARIANTS[name]
    overrides = dict(overrides)
    types = {f.name: f.type for f in fields(CompressOptions) if f.name not in ("method", "ratio")}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or key not in types:
            raise ValueError(f"--methods {label!r}: {setting!r} is not FIELD=VALUE with a CompressOptions field; fields: {', '.join(types)}")
        kind = types[key]
        try:
            if kind == "bool":
                if value not in ("true", "false"):
                    raise ValueError
                overrides[key] = value == "true"
            else:
                overrides[key] = {"int": int, "float": float, "str": str}[kind](value)
        except ValueError:
            raise ValueError(f"--methods {label!r}: {key}={value!r} is not a {kind}" + (" (true or false)" if kind == "bool" else "")) from None
    CompressOptions(method=method, ratio=0.5, **overrides).validate()
    return method, overrides


def parse_methods(text: str) -> list[str]:
    """``--methods``: comma-separated sweep labels (``variant``), checked."""
    labels = [m.strip() for m in text.split(",") if m.strip()]
    if not labels:
        raise ValueError(f"--methods: no method in {text!r}; choose from {', '.join(VARIANTS)}")
    for label in labels:
        variant(label)
    return labels


def parse_ratios(text: str) -> list[float]:
    try:
        ratios = [float(r) for r in text.split(",") if r.strip()]
    except ValueError as err:
        raise ValueError(f"--ratios must be comma-separated numbers in (0, 1); got {text!r}") from err
    if not ratios or any(not 0.0 < r < 1.0 for r in ratios):
        raise ValueError(f"--ratios must be comma-separated numbers in (0, 1) (0 removes nothing); got {text!r}")
    return ratios


def parse_texts(text: str) -> list[str]:
    """``--texts``: comma-separated evaluation texts, the first one in domain (a PATH holding a
    comma counts as one text when it exists)."""
    if Path(text).expanduser().exists():
        return [text]
    texts = [t.strip() for t in text.split(",") if t.strip()]
    if not texts or len(set(texts)) != len(texts):
        raise ValueError(f"--texts must be distinct comma-separated evaluation texts (e.g. {EVAL_SHAKESPEARE},{AUSTEN}); got {text!r}")
    return texts


def _measure(model: torch.nn.Module, eval_ids: dict[str, torch.Tensor], seq_len: int, prefill_len: int, repeats: int,
             dense: torch.nn.Module | None = None, progress: bool = True) -> dict[str, Any]:
    """Perplexity on every evaluation text, costs and prefill latency. ``ppl`` is the first (in-domain)
    text's. With ``dense``, the dense model is timed right before (``dense_latency``) so the speedup
    compares measurements taken under the same machine load."""
    evals = {name: perplexity_of_ids(model, ids, seq_len, progress=progress) for name, ids in eval_ids.items()}
    latency = dense_latency = None
    if repeats > 0:
        dense_latency = prefill_latency(dense, prefill_len, repeats=repeats) if dense is not None else None
        latency = prefill_latency(model, prefill_len, repeats=repeats)
    first = next(iter(evals.values()))
    return {"ppl": first["ppl"], "eval": first, "ppl_by_text": {name: e["ppl"] for name, e in evals.items()}, "eval_by_text": evals,
            **cost_summary(model, prefill_len), "latency": latency, "dense_latency": dense_latency,
            "speedup": dense_latency["median_s"] / latency["median_s"] if dense_latency else None}


def run_sweep(base: LoadedModel, methods: list[str], ratios: list[float], *, calib: str = DEFAULT_CALIB, calib_tokens: int = DEFAULT_CALIB_TOKENS,
              calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN, texts: tuple[str, ...] = DEFAULT_TEXTS, seq_len: int = 1024, max_tokens: int | None = 16384,
              prefill_len: int = 512, repeats: int = 5, seed: int = 0, options: dict[str, Any] | None = None,
              dense: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Compress copies of ``base`` with every method label at every ratio; measure each and the dense model.

    Perplexity is measured on the first ``max_tokens`` tokens of each of ``texts`` (the first is the
    in-domain text; the others must not be calibration text). ``options`` overrides CompressOptions
    fields for every row (a variant's own overrides win). ``dense``: the dense model's measurement
    from an earlier call with the same texts and settings (skips measuring it again).
    """
    texts = tuple(texts)
    calibration = calibration_set(base, calib, calib_tokens, calib_seq_len, seed)
    overlap = set(calibration[1]["sources"]) & set(texts)
    if overlap:
        raise ValueError(f"--texts {', '.join(sorted(overlap))}: also in --calib {calib!r}; a model is never evaluated on its calibration text")
    eval_texts = {name: evaluation_text(name) for name in texts}
    eval_ids = {name: torch.tensor(tokenize(base.tokenizer, text), dtype=torch.long)[:max_tokens] for name, text in eval_texts.items()}
    print(f"dense model: evaluating {', '.join(f'{ids.numel()} tokens of {name!r}' for name, ids in eval_ids.items())} ...", flush=True)
    if dense is None or set(dense["ppl_by_text"]) != set(texts):
        dense = _measure(base.model, eval_ids, seq_len, prefill_len, repeats, progress=progress)
    rows = []
    for label in methods:
        method, overrides = variant(label)
        for ratio in ratios:
            row_options = CompressOptions(method=method, ratio=ratio, **{**(options or {}), **overrides})
            model = LoadedModel(copy.deepcopy(base.model), base.tokenizer, dict(base.identity))
            t0 = time.perf_counter()
            manifest = compress_loaded(model, row_options, calib, calib_tokens, calib_seq_len=calib_seq_len, seed=seed, calibration=calibration,
                                       progress=progress)
            compress_s = time.perf_counter() - t0
            measured = _measure(model.model, eval_ids, seq_len, prefill_len, repeats, dense=base.model, progress=progress)
            row = {"method": label, "ratio": ratio, "achieved_ratio": manifest["achieved_ratio"], "compress_seconds": compress_s, **measured,
                   "budget": manifest["budget"], "options": manifest["options"], "allocation": manifest.get("allocation")}
            rows.append(row)
            print(format_row(row, dense), flush=True)
            del model
    return {
        "model": base.identity,
        "calibration": calibration[1],
        "eval": {"texts": {name: {"text_sha256": text_sha256(text), "tokens": int(eval_ids[name].numel())} for name, text in eval_texts.items()},
                 "in_domain": texts[0], "seq_len": seq_len},
        "prefill_len": prefill_len,
        "threads": torch.get_num_threads(),
        "dense": dense,
        "rows": rows,
    }


def format_row(row: dict, dense: dict) -> str:
    """One markdown row: perplexity and its ratio to dense for every evaluation text, then costs."""
    latency = row.get("latency")
    speed = f"{row['speedup']:.2f}x" if row.get("speedup") else ("1.00x" if row.get("method") == "dense" and latency else "-")
    lat = f"{latency['median_s'] * 1e3:.0f}" if latency else "-"
    ppl = " | ".join(f"{value:.2f} | {value / dense['ppl_by_text'][name]:.2f}x" for name, value in row["ppl_by_text"].items())
    return (f"| {row['method']} | {row['ratio']:.2f} | {row['achieved_ratio']:.4f} | {ppl} | "
            f"{row['parameters'] / 1e6:.2f} | {row['flops_per_token'] / 1e6:.1f} ({row['flops_per_token'] / dense['flops_per_token']:.3f}) | "
            f"{lat} | {speed} | {row.get('compress_seconds', 0):.0f} |")


def markdown_table(result: dict) -> str:
    dense = result["dense"]
    ev = result["eval"]
    texts = list(ev["texts"])
    described = ", ".join(f"{info['tokens']} tokens of {name!r}" + (" (in domain)" if name == ev["in_domain"] else " (out of domain)")
                          for name, info in ev["texts"].items())
    lines = [
        f"Perplexity on {described} ({ev['seq_len']}-token windows); calibration: {result['calibration'].get('tokens')} tokens "
        f"of {result['calibration'].get('source')!r}; FLOPs per token and latency for a {result['prefill_len']}-token prefill, {result['threads']} CPU thread(s); "
        "speedup = dense prefill time measured right before each row / that row's (median of repeats).",
        "",
        "| method | ratio | achieved | " + " | ".join(f"ppl {name} | vs dense" for name in texts)
        + " | params (M) | FLOPs/token (M, vs dense) | prefill ms | speedup | compress s |",
        "| --- | ---: | ---: |" + " ---: | ---: |" * len(texts) + " ---: | ---: | ---: | ---: | ---: |",
        format_row({"method": "dense", "ratio": 0.0, "achieved_ratio": 0.0, **dense}, dense),
    ]
    lines += [format_row(row, dense) for row in result["rows"]]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    """Perplexity against ratio per method (log y), one panel per evaluation text, dense dashed; returns the figure."""
    texts = list(result["eval"]["texts"])
    fig, axes = new_figure(1, len(texts), figsize=(5.6 * len(texts), 4.4), squeeze=False)
    axes = list(axes[0])
    for ax, name in zip(axes, texts):
        for label in dict.fromkeys(row["method"] for row in result["rows"]):
            rows = sorted((r for r in result["rows"] if r["method"] == label), key=lambda r: r["ratio"])
            ax.plot([r["ratio"] for r in rows], [r["ppl_by_text"][name] for r in rows], marker="o", label=label)
        dense_ppl = result["dense"]["ppl_by_text"][name]
        ax.axhline(dense_ppl, color="black", linestyle="--", linewidth=1, label=f"dense ({dense_ppl:.1f})")
        ax.set_yscale("log")
        ax.set_xlabel("compression ratio (weights removed from the block projections)")
        ax.set_ylabel("perplexity (log scale)")
        domain = "in domain" if name == result["eval"]["in_domain"] else "out of domain"
        ax.set_title(f"{result['model'].get('name')}: {name} ({domain})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_sweep(result: dict, name: str, out_dir: str | Path) -> Path:
    """``<name>.json`` + ``<name>.png`` (via ``write_results``) and ``<name>.md`` under ``out_dir``."""
    out_dir = Path(out_dir)
    path = write_results(name, result, out_dir, figure=plot(result))
    write_text(out_dir / f"{name}.md", markdown_table(result))
    return path


def demo_compression(out_dir: str | Path, *, model: str = "smollm2", ratio: float = 0.2, methods: tuple[str, ...] = ("rootcov", "latentllm"),
                     calib_tokens: int = 2560, calib_seq_len: int = 512, eval_tokens: int = 4096, seq_len: int = 1024, seed: int = 0,
                     progress: bool = True) -> dict[str, Any]:
    """The ``make demo`` step: compress SmolLM2 at ``ratio`` with each method, print perplexities beside
    the dense model's (same run, same held-out tokens), write ``compression_demo.{json,md,png}``.

    Small on purpose (a few minutes on 2 CPU cores): ``calib_tokens`` calibration tokens in
    ``calib_seq_len`` windows (five windows: one per source of the default mix) and the first
    ``eval_tokens`` tokens of each evaluation text; the full sweep (``slimkv compress-sweep``) uses more.
    """
    if model == SMOLLM2:
        fetch_smollm2()
    base = load_pretrained(model)
    print(f"compression demo: {model} at ratio {ratio} with {', '.join(methods)}; calibration {calib_tokens} tokens of {DEFAULT_CALIB!r}, "
          f"evaluation on the first {eval_tokens} tokens of the held-out plays (in domain) and of Austen's novels (out of domain; small so it runs in minutes on a CPU; "
          f"`slimkv compress-sweep` measures more)", flush=True)
    result = run_sweep(base, list(methods), [ratio], calib_tokens=calib_tokens, calib_seq_len=calib_seq_len, seq_len=seq_len,
                       max_tokens=eval_tokens, repeats=0, seed=seed, progress=progress)
    table = markdown_table(result)
    print(table)
    rows = {row["method"]: row["ppl_by_text"] for row in result["rows"]}
    if "rootcov" in rows and "latentllm" in rows:
        for name, dense_ppl in result["dense"]["ppl_by_text"].items():
            if math.isfinite(rows["rootcov"][name]):
                change = 100 * (rows["latentllm"][name] / rows["rootcov"][name] - 1)
                print(f"{name}: latentllm perplexity is {abs(change):.1f}% {'below' if change < 0 else 'above'} rootcov's at the same ratio "
                      f"(dense {dense_ppl:.2f}, latentllm {rows['latentllm'][name] / dense_ppl:.2f}x dense; one calibration set, "
                      f"{result['eval']['texts'][name]['tokens']} evaluation tokens)")
    write_sweep(result, "compression_demo", Path(out_dir))
    return result
