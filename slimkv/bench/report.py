"""The report of a comparison: ``report.md`` and the PNGs, a pure function of ``report.json``
(``slimkv report report.json`` regenerates them)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from slimkv.bench.statistics import MIN_SEEDS_FOR_CLAIM
from slimkv.common.files import read_json, save_figure, write_text
from slimkv.common.plotting import new_figure

REPORT_FORMAT = 1
PLOT_BPB = "bpb_vs_cache.png"
PLOT_DECODE = "decode_vs_context.png"


def fmt_stat(stat: dict[str, Any] | None, digits: int = 4) -> str:
    """``mean ± std [min, max]``, or ``mean (1 seed)``."""
    if stat is None:
        return "-"
    if stat["n"] == 1:
        return f"{stat['mean']:.{digits}f} (1 seed)"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f} [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]"


def recipe_text(recipe: dict[str, Any]) -> str:
    return (
        f"{recipe['dataset']}, d_model {recipe['d_model']}, {recipe['n_layers']} layers, {recipe['n_heads']} heads, "
        f"seq_len {recipe['seq_len']}, batch {recipe['batch_size']}x{recipe['grad_accum']}, {recipe['steps']} steps, "
        f"lr {recipe['lr']}, {recipe['mlp']} MLP"
    )


def _options_text(entry: dict[str, Any]) -> str:
    parts = []
    for kind, options in entry["options"].items():
        text = ",".join(f"{k}={v}" for k, v in options.items()) or "-"
        parts.append(f"{kind}: {text}" if len(entry["options"]) > 1 else text)
    return "; ".join(parts)


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md`` from ``report.json`` alone (deterministic: the same JSON gives the same text)."""
    entries = {e["label"]: e for e in report["entries"]}
    contexts = report["decode"]["contexts"]
    top = str(contexts[-1]) if contexts else None
    seeds = report["seeds"]
    other = report.get("other_text")
    lines = [
        f"# {report['title']}",
        "",
        f"Recipe (identical for every entry; only the attention changes): {recipe_text(report['recipe'])}.",
        f"Seeds: {', '.join(map(str, seeds))} ({len(seeds)} per entry). Val = the dataset's held-out split, "
        f"{report['eval_tokens'] if report['eval_tokens'] else 'all'} tokens per run; BPB = total NLL / (ln 2 x UTF-8 bytes).",
        f"Cache measured from the cache tensors after prefilling {report['aggregate'][0]['cache']['context']} tokens "
        f"({report['aggregate'][0]['cache']['dtype']}, batch 1); ratio = to MHA of the same shape.",
        "",
        "| entry | options | params | cache B/token/layer | B/token (model) | vs MHA | val BPB mean ± std [min, max] | val CE (nats)"
        + (f" | {other} BPB (out of domain)" if other else "") + " | head diversity r_eff/H"
        + (f" | decode ms/token/layer @ {top}" if top else "") + " | train tok/s |",
        "|---|---|---:|---:|---:|---:|---|---|" + ("---|" if other else "") + "---|" + ("---:|" if top else "") + "---:|",
    ]
    for row in report["aggregate"]:
        cache = row["cache"]
        decode = f" | {report['decode']['per_entry'][row['label']][top]:.3f}" if top else ""
        speed = f"{row['train_tokens_per_s']['mean']:,.0f}" if row["train_tokens_per_s"] else "-"
        check = "" if cache["measured_equals_analytic"] else " (measured != analytic!)"
        lines.append(
            f"| {row['label']} | {_options_text(entries[row['label']])} | {row['parameters']:,} | {cache['bytes_per_token_per_layer']:.1f}{check} | "
            f"{cache['bytes_per_token_model']:.1f} | {cache['ratio_to_mha']:.3f} | {fmt_stat(row['val_bpb'])} | {fmt_stat(row['val_ce'])} | "
            + (f"{fmt_stat(row.get('other_bpb'))} | " if other else "")
            + f"{fmt_stat(row['r_eff_over_heads'], 3)}{decode} | {speed} |"
        )
    if report.get("busy_runs"):
        lines += ["", f"Left out (another process was training them): {', '.join(report['busy_runs'])}."]
    lines += ["", "## Differences in val BPB against the reference", ""]
    lines.append(
        f"A difference is claimed only with >= {MIN_SEEDS_FOR_CLAIM} seeds on both sides, non-overlapping seed ranges "
        "and |difference of means| > std(entry) + std(ref); otherwise no entry is called better."
    )
    lines.append("")
    lines.append("| entry | reference | mean difference | std(entry) + std(ref) | verdict |")
    lines.append("|---|---|---:|---:|---|")
    for c in report["comparisons"]:
        spread = "-" if c["sum_of_stds"] is None else f"{c['sum_of_stds']:.4f}"
        lines.append(f"| {c['a']} | {c['b']} | {c['delta_bpb']:+.4f} | {spread} | {c['verdict']} |")
    if report.get("comparisons_other"):
        lines += ["", f"Out of domain ({other} BPB), same rule:", "", "| entry | reference | mean difference | std(entry) + std(ref) | verdict |", "|---|---|---:|---:|---|"]
        for c in report["comparisons_other"]:
            spread = "-" if c["sum_of_stds"] is None else f"{c['sum_of_stds']:.4f}"
            lines.append(f"| {c['a']} | {c['b']} | {c['delta_bpb']:+.4f} | {spread} | {c['verdict']} |")
    if contexts:
        settings = report["decode"]["settings"]
        lines += [
            "",
            "## Decode latency (ms per token, one layer)",
            "",
            f"One layer per kind at the recipe's width ({settings['n_heads']} heads x {settings['head_dim']}, d_model {settings['d_model']}, "
            f"batch {settings['batch']}, {settings['dtype']}, {settings['device']}), untrained weights, cache filled with random inputs; "
            f"median of {settings['rounds']} interleaved rounds x {settings['repeats']} calls. A layer pattern shows the mean over its layers.",
            "",
            "| entry | " + " | ".join(f"@ {c}" for c in contexts) + " |",
            "|---|" + "---:|" * len(contexts),
        ]
        for label, per in report["decode"]["per_entry"].items():
            lines.append(f"| {label} | " + " | ".join(f"{per[str(c)]:.3f}" for c in contexts) + " |")
    lines += ["", "## Options of each entry", ""]
    for e in report["entries"]:
        defaults = "; ".join(f"{k}: {v}" for k, v in e["defaults"].items())
        lines.append(f"- **{e['label']}**: layers {'/'.join(e['kinds'])}; {_options_text(e)}" + (f" ({defaults})" if defaults else ""))
    lines += ["", "## Runs", "", "| entry | seed | val BPB | val CE | r_eff/H | run |", "|---|---:|---:|---:|---:|---|"]
    for r in report["runs"]:
        div = r["diversity"]["mean_r_eff_over_heads"]
        lines.append(f"| {r['label']} | {r['seed']} | {r['val_bpb']:.4f} | {r['val_ce']:.4f} | {'-' if div is None else f'{div:.3f}'} | {r['run_dir']} |")
    lines += ["", f"Plots: {PLOT_BPB}" + (f", {PLOT_DECODE}" if contexts else "") + "."]
    machine = report["machine"]
    lines.append(f"Machine: {machine.get('cpu_model', machine.get('processor'))}, {machine['cpu_count']} CPUs, torch {machine['torch']}, {machine['threads']} thread{'' if machine['threads'] == 1 else 's'}.")
    return "\n".join(lines) + "\n"


def plot_bpb_vs_cache(report: dict[str, Any]):
    """Val BPB (mean, error bar = std over seeds) against the cache ratio to MHA; variants of one
    kind are joined by a line in order of cache size."""
    entries = {e["label"]: e for e in report["entries"]}
    fig, ax = new_figure(figsize=(7, 4.8))
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for row in report["aggregate"]:
        x, stat = row["cache"]["ratio_to_mha"], row["val_bpb"]
        ax.errorbar(x, stat["mean"], yerr=stat["std"] or 0.0, fmt="o", capsize=4, label=row["label"])
        ax.annotate(row["label"], (x, stat["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        kinds = entries[row["label"]]["kinds"]
        if len(kinds) == 1:
            by_kind.setdefault(kinds[0], []).append((x, stat["mean"]))
    for points in by_kind.values():
        if len(points) > 1:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, color="grey", linewidth=0.8, alpha=0.6)
    n = len(report["seeds"])
    ax.set_xlabel(f"cache bytes per token / MHA's (after {report['aggregate'][0]['cache']['context']} tokens)")
    ax.set_ylabel("val bits per byte (lower is better)")
    ax.set_title("\n".join(textwrap.wrap(f"{report['title']}: {recipe_text(report['recipe'])}; mean ± std over {n} seed(s)", 90)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_decode(report: dict[str, Any]):
    """Decode ms per token per layer against context, one line per entry."""
    contexts = report["decode"]["contexts"]
    fig, ax = new_figure(figsize=(7, 4.5))
    for label, per in report["decode"]["per_entry"].items():
        ax.plot(contexts, [per[str(c)] for c in contexts], marker="o", label=label)
    s = report["decode"]["settings"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("ms per decoded token (one layer, median)")
    ax.set_title(f"{s['n_heads']}x{s['head_dim']} heads, d_model {s['d_model']}, batch {s['batch']}, {s['dtype']}, {s['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report_files(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.md and the PNGs of ``report`` into ``out_dir``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    write_text(md, render_markdown(report))
    written = [md]
    save_figure(plot_bpb_vs_cache(report), out_dir / PLOT_BPB, tight=False)
    written.append(out_dir / PLOT_BPB)
    if report["decode"]["contexts"]:
        save_figure(plot_decode(report), out_dir / PLOT_DECODE, tight=False)
        written.append(out_dir / PLOT_DECODE)
    return written


def load_report(path: str | Path) -> dict[str, Any]:
    """A ``report.json`` written by ``run_compare``."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the report.json inside it")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; create it with `slimkv compare --kinds ... --out DIR`")
    report = read_json(path)
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT or "aggregate" not in report:
        raise ValueError(f"{path} is not a report.json of `slimkv compare` (format {REPORT_FORMAT})")
    return report
