"""``slimkv analyze diversity``: head diversity of a trained model."""

from __future__ import annotations

import argparse
from pathlib import Path

from slimkv.common.files import write_json
from slimkv.eval.diversity import format_table, model_diversity
from slimkv.model import load_model_folder


def model_folder(path: Path) -> Path:
    """The saved model folder of a run directory (RUN_DIR/model) or the path itself if it is one."""
    if (path / "model" / "config.json").is_file():
        return path / "model"
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"no saved model in {path} (looked for {path / 'model' / 'config.json'} and {path / 'config.json'}); "
        "train one with `slimkv train` or pass a folder written by save_pretrained"
    )


def run_diversity(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    folder = model_folder(run_dir)
    model = load_model_folder(folder)
    rows = model_diversity(model)
    print(f"head diversity of {folder} (centred operator Gram; ceiling = (H-1)/H)")
    print(format_table(rows))
    out = Path(args.out) if args.out else run_dir / "diversity.json"
    write_json(out, {"model": str(folder), "metric": "exp(entropy) of eigenvalues of J G J, G = cosine Gram of W^Q_h W^K_h^T", "layers": rows})
    print(f"wrote {out}")
    return 0


def add_commands(subparsers) -> None:
    """``slimkv analyze diversity RUN_DIR``."""
    analyze = subparsers.add_parser("analyze", help="analyse a trained model")
    sub = analyze.add_subparsers(dest="analysis", metavar="ANALYSIS")
    analyze.set_defaults(func=lambda args: analyze.print_help() or 2)
    div = sub.add_parser("diversity", help="per-layer head diversity (effective rank of the query-key operators)")
    div.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (with model/) or a saved model folder")
    div.add_argument("--out", default=None, help="JSON output path (default RUN_DIR/diversity.json)")
    div.set_defaults(func=run_diversity)
