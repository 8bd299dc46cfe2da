"""Position-wise loss: mean next-token NLL per position bucket on val sequences longer than the
training length (docs/evaluation.md), to show length extrapolation.

Windows of ``length + 1`` tokens are cut from the run's val split (never used for training), evenly
spread over it. Position p (0-based) is the prediction of token p + 1 from the p + 1 tokens before
it, so position p has context p + 1. Positions [0, length) are split into ``buckets`` contiguous
ranges of (nearly) equal size; each bucket reports the mean NLL in nats over every window and
position in it. Writes ``positions.json`` and ``positions.png`` (loss vs position, with the
training length marked) and prints a table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from slimkv.common.checks import check_int
from slimkv.common.files import report_folder, save_figure, write_json
from slimkv.common.plotting import new_figure
from slimkv.scoring import eval_windows
from slimkv.train.checkpoint import load_run

RESULT_FILE = "positions.json"
PLOT_FILE = "positions.png"


def parse_length(text: str, train_len: int) -> int:
    """``"4x"`` -> 4 x the training length; ``"1024"`` -> 1024 tokens."""
    text = str(text).strip()
    try:
        length = round(float(text[:-1]) * train_len) if text.lower().endswith("x") else int(text)
    except (ValueError, OverflowError):  # infx, 1e999k: no integer
        raise ValueError(f"--length must be a token count or a multiple like 4x of the training length, got {text!r}") from None
    check_int("--length", length, 2)
    return length


@torch.no_grad()
def position_nll(model: torch.nn.Module, windows: torch.Tensor, *, batch_size: int, progress: bool = False) -> torch.Tensor:
    """(n, T) float64 next-token NLL in nats of ``windows`` (n, T + 1), one full forward per window."""
    device = next(model.parameters()).device
    rows = []
    for chunk in tqdm(windows.split(batch_size), desc="positions", unit="batch", disable=not progress, leave=False):
        ids = chunk.to(device)
        logits = model(ids[:, :-1]).logits.float()
        rows.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").double().cpu())
    return torch.cat(rows)


def bucket_edges(length: int, buckets: int) -> list[int]:
    """``buckets + 1`` increasing edges from 0 to ``length`` (bucket i = positions [e_i, e_i+1))."""
    check_int("buckets", buckets, 1)
    if buckets > length:
        raise ValueError(f"--buckets={buckets} is more than the {length} positions; use at most {length}")
    return np.linspace(0, length, buckets + 1).round().astype(int).tolist()


def bucket_means(nll: torch.Tensor, buckets: int) -> list[dict[str, Any]]:
    """Per bucket of positions: its range, the tokens in it (windows x positions) and the mean NLL."""
    edges = bucket_edges(nll.shape[1], buckets)
    out = []
    for start, end in zip(edges[:-1], edges[1:]):
        part = nll[:, start:end]
        out.append({"start": start, "end": end, "tokens": part.numel(), "mean_nll": float(part.mean())})
    return out


def positions_report(run_dir: str | Path, *, length: str, buckets: int, max_sequences: int, batch_size: int, out_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Evaluate a run directory; writes ``positions.json`` and ``positions.png`` into ``out_dir`` (default RUN_DIR)."""
    check_int("--max-sequences", max_sequences, 1)
    check_int("--batch-size", batch_size, 1)
    run_dir = Path(run_dir)
    target = report_folder(run_dir, out_dir, (RESULT_FILE, PLOT_FILE))
    model, cfg, dataset = load_run(run_dir)
    total = parse_length(length, cfg.seq_len)
    bucket_edges(total, buckets)
    windows = eval_windows(dataset.val, total, max_sequences)
    nll = position_nll(model, windows, batch_size=batch_size, progress=progress)
    inside, beyond = nll[:, : min(cfg.seq_len, total)], nll[:, cfg.seq_len :]
    report = {
        "run_dir": str(run_dir),
        "attention": cfg.attention,
        "attention_options": cfg.attention_options,
        "train_seq_len": cfg.seq_len,
        "dataset": cfg.dataset,
        "split": "val",
        "length": total,
        "length_multiple": total / cfg.seq_len,
        "sequences": len(windows),
        "buckets": bucket_means(nll, buckets),
        "mean_nll": float(nll.mean()),
        "mean_nll_within_train_len": float(inside.mean()),
        "mean_nll_beyond_train_len": float(beyond.mean()) if beyond.numel() else None,
        "position_convention": "position p predicts token p+1 from the p+1 tokens before it",
    }
    target.mkdir(parents=True, exist_ok=True)
    write_json(target / RESULT_FILE, report)
    plot_positions([report], target / PLOT_FILE)
    return report


def plot_positions(reports: list[dict[str, Any]], path: Path) -> None:
    """Mean NLL vs position (bucket centres), one line per report, training length(s) dashed."""
    fig, ax = new_figure(figsize=(7, 4))
    for report in reports:
        centres = [(b["start"] + b["end"] - 1) / 2 for b in report["buckets"]]
        kind = report["attention"] if isinstance(report["attention"], str) else "/".join(report["attention"])
        ax.plot(centres, [b["mean_nll"] for b in report["buckets"]], marker="o", label=f"{kind} ({report['sequences']} seqs)")
    for train_len in sorted({r["train_seq_len"] for r in reports}):
        ax.axvline(train_len, color="grey", linestyle="--", linewidth=1)
        ax.text(train_len, ax.get_ylim()[1], f" train length {train_len}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel("mean next-token NLL (nats)")
    ax.set_title(f"Position-wise val loss ({reports[0]['dataset']})", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def format_table(report: dict[str, Any]) -> str:
    kind = report["attention"] if isinstance(report["attention"], str) else "/".join(report["attention"])
    lines = [
        f"position-wise val NLL, {kind} ({report['run_dir']}): {report['sequences']} {report['dataset']} val sequences of "
        f"{report['length']} tokens ({report['length_multiple']:g}x the training length {report['train_seq_len']})",
        f"  {'positions':>13} {'tokens':>8} {'mean NLL':>9}",
    ]
    for bucket in report["buckets"]:
        marker = "  (beyond training length)" if bucket["start"] >= report["train_seq_len"] else ""
        lines.append(f"  {bucket['start']:>6}-{bucket['end'] - 1:<6} {bucket['tokens']:>8} {bucket['mean_nll']:>9.4f}{marker}")
    lines.append(f"  mean NLL within the training length {report['mean_nll_within_train_len']:.4f}")
    if report["mean_nll_beyond_train_len"] is not None:
        lines.append(f"  mean NLL beyond the training length {report['mean_nll_beyond_train_len']:.4f}")
    return "\n".join(lines)


