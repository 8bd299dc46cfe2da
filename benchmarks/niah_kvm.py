"""Needle retrieval at 1x, 2x and 4x the training length: KVM (sqrt, fixed) vs full attention vs SWA.

One recipe, only the attention changes: small models trained on Shakespeare with the needle
mixture (a fraction of training sequences replaced by synthetic needle documents built from the
train plays, ``TrainConfig.needle_mix``), so what is measured is the retrieval mechanism, not model
scale. Each model is then scored on the NIAH tasks (``slimkv.retrieval.runs``; prose haystacks from
the held-out val plays) at T, 2T and 4T tokens, and its position-wise val loss out to 4T
(``slimkv.eval.positions``). KVM uses chunks of 32 so that at 4T most of the context lives in the
compressed state: fixed keeps 32 rows (+ a window of 33..64 exact keys); sqrt grows as
4 sqrt(ctx) rows (64 at T=256, 128 at 4T). SWA's window (64) equals KVM's largest window, so
SWA vs KVM isolates the state.

    .venv/bin/python benchmarks/niah_kvm.py [--steps 300] [--seq-len 256] [--kinds kvm-sqrt kvm-fixed mha swa]

Runs are kept in ``<cache>/runs/niah_kvm/<kind>`` (finished ones are reused; interrupted ones
resume). Results: ``benchmarks/results/niah/niah_kvm.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from slimkv.common.paths import cache_dir
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.eval.positions import positions_report
from slimkv.retrieval.grid import DEPTHS_SYNTAX, parse_depths
from slimkv.retrieval.runs import evaluate_niah, parse_tasks
from slimkv.train import TrainConfig, load_run, train

CHUNK = 32
KINDS = {
    "kvm-sqrt": ("kvm", {"chunk_size": CHUNK, "schedule": "sqrt", "min_rows": CHUNK, "sqrt_coef": 4.0}),
    "kvm-fixed": ("kvm", {"chunk_size": CHUNK, "schedule": "fixed", "min_rows": CHUNK}),
    "mha": ("mha", {}),
    "swa": ("swa", {"window": 2 * CHUNK}),
}


def recipe(args: argparse.Namespace) -> dict:
    """The shared training recipe (everything but the attention)."""
    return {
        **TrainConfig().to_dict(),
        "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "steps": args.steps, "lr": args.lr, "warmup_steps": max(1, args.steps // 10), "needle_mix": args.needle_mix, "needle_seed": 0,
        "seed": args.seed, "eval_every": 0, "checkpoint_every": max(1, args.steps // 4), "log_every": 10,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256, help="training length T (NIAH at T, 2T, 4T)")
    parser.add_argument("--d-model", type=int, default=96)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--needle-mix", type=float, default=0.5)
    parser.add_argument("--tasks", default="s1,s2", help="NIAH tasks (s3's UUIDs need ~40 new tokens; add it with --tasks s1,s2,s3)")
    parser.add_argument("--samples", type=int, default=8, help="prompts per (length, depth) cell")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help=f"needle depths: {DEPTHS_SYNTAX}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs-dir", default=None, help="where the runs go (default <cache>/runs/niah_kvm)")
    parser.add_argument("--name", default="niah_kvm", help="result file name under benchmarks/results/niah/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs_dir = Path(args.runs_dir) if args.runs_dir else cache_dir() / "runs" / "niah_kvm"
    tasks = parse_tasks(args.tasks)
    lengths = [args.seq_len, 2 * args.seq_len, 4 * args.seq_len]
    depths = parse_depths(args.depths)
    max_new_tokens = 48 if "s3" in tasks else 16

    rows, positions = {}, []
    for label in args.kinds:
        kind, options = KINDS[label]
        cfg = TrainConfig.from_dict({**recipe(args), "attention": kind, "attention_options": options})
        run_dir = runs_dir / label
        started = time.perf_counter()
        summary = train(cfg, run_dir, resume=(run_dir / "train_config.json").is_file())
        train_s = time.perf_counter() - started
        model, _, dataset = load_run(run_dir)
        started = time.perf_counter()
        niah = evaluate_niah(model, dataset, tasks=tasks, lengths=lengths, depths=depths, samples=args.samples, max_new_tokens=max_new_tokens, seed=args.seed)
        niah_s = time.perf_counter() - started
        report = positions_report(run_dir, length="4x", buckets=16, max_sequences=16, batch_size=8, progress=False)
        positions.append(report)
        rows[label] = {
            "attention": kind, "options": options, "val_ce": summary.get("val_ce"), "parameters": summary.get("parameters"),
            "train_seconds_this_call": train_s, "niah_seconds": niah_s,
            "niah": {t: {"mean_per_length": r["mean_per_length"], "accuracy": r["accuracy"], "value_token_accuracy_per_length": r["value_token_accuracy_per_length"],
                         "value_token_nll_per_length": r["value_token_nll_per_length"], "examples": r["examples"][:3]} for t, r in niah.items()},
            "position_nll_buckets": report["buckets"], "mean_nll_within_train_len": report["mean_nll_within_train_len"],
            "mean_nll_beyond_train_len": report["mean_nll_beyond_train_len"],
        }
        print(f"{label}: val CE {summary.get('val_ce'):.3f}, trained in {train_s:.0f}s, NIAH in {niah_s:.0f}s: "
              + "; ".join(f"{t} " + "/".join(f"{m:.2f}" for m in r["mean_per_length"]) + " (value tokens " + "/".join(f"{m:.2f}" for m in r["value_token_accuracy_per_length"]) + ")"
                          for t, r in niah.items()))

    print(f"\nNIAH accuracy (mean over depths, {args.samples} samples per cell) at {'/'.join(map(str, lengths))} tokens; "
          f"trained at T={args.seq_len} with needle_mix {args.needle_mix}, {args.steps} steps, d_model {args.d_model}, {args.n_layers} layers")
    print("exact match of the greedy continuation | teacher-forced value-token accuracy (the ' {value}' tokens; with the Shakespeare BPE a "
          "7-digit value is a space token + 7 digit tokens, so guessing digits scores about (1 + 7 * 0.1) / 8 = 0.21)")
    print(f"{'kind':<10} " + " ".join(f"{t + '@' + m:>9}" for t in tasks for m in ('1T', '2T', '4T')) + " |"
          + " ".join(f"{'tok' + t + '@' + m:>11}" for t in tasks for m in ('1T', '2T', '4T')) + f" {'NLL<=T':>7} {'NLL>T':>7}")
    for label, row in rows.items():
        cells = " ".join(f"{v:>9.2f}" for t in tasks for v in row["niah"][t]["mean_per_length"])
        token_cells = " ".join(f"{v:>11.2f}" for t in tasks for v in row["niah"][t]["value_token_accuracy_per_length"])
        print(f"{label:<10} {cells} |{token_cells} {row['mean_nll_within_train_len']:>7.3f} {row['mean_nll_beyond_train_len']:>7.3f}")

    fig, axes = new_figure(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 3.6))
    for ax, task in zip(axes, tasks):
        for index, (label, row) in enumerate(rows.items()):
            color = f"C{index}"
            ax.plot([n / args.seq_len for n in lengths], row["niah"][task]["mean_per_length"], marker="o", color=color, label=f"{label} exact")
            ax.plot([n / args.seq_len for n in lengths], row["niah"][task]["value_token_accuracy_per_length"], marker="x", linestyle="--", color=color,
                    label=f"{label} value tokens")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4], ["1T", "2T", "4T"])
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"NIAH {task} (T={args.seq_len})", fontsize=10)
        ax.set_xlabel("prompt length")
        ax.set_ylabel("accuracy (mean over depths)")
        ax.legend(fontsize=8)
    for label, report in zip(rows, positions):
        axes[-1].plot([(b["start"] + b["end"] - 1) / 2 for b in report["buckets"]], [b["mean_nll"] for b in report["buckets"]], marker=".", label=label)
    axes[-1].axvline(args.seq_len, color="grey", linestyle="--", linewidth=1)
    axes[-1].set_title("val NLL by position (to 4T)", fontsize=10)
    axes[-1].set_xlabel("position")
    axes[-1].set_ylabel("nats")
    axes[-1].legend(fontsize=8)
    settings = {**{k: v for k, v in vars(args).items() if k != "kinds"}, "kinds": args.kinds, "lengths": lengths, "max_new_tokens": max_new_tokens,
                "recipe": recipe(args), "note": "models trained with the needle mixture: the retrieval mechanism, not model scale, is measured"}
    path = write_results(args.name, {"settings": settings, "results": rows}, results_dir(Path(__file__).resolve().parent / "results", args.name), figure=fig)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
