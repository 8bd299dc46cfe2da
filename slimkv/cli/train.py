"""``slimkv train``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slimkv.train.checkpoint import read_run_config
from slimkv.train.config import attention_overrides, load_config, parse_override
from slimkv.train.trainer import TrainingDiverged, train

# direct flags for the common knobs: flag -> TrainConfig key (--attention is an entry, see overrides_from_args)
DIRECT_FLAGS = {
    "--dataset": "dataset",
    "--steps": "steps",
    "--lr": "lr",
    "--batch-size": "batch_size",
    "--seq-len": "seq_len",
    "--seed": "seed",
    "--d-model": "d_model",
    "--n-layers": "n_layers",
    "--n-heads": "n_heads",
    "--device": "device",
}


def add_commands(subparsers) -> None:
    """Register ``train`` on the top-level ``slimkv`` parser."""
    p = subparsers.add_parser(
        "train",
        help="train a small LM with one attention kind",
        description=(
            "Train a small LM on a prepared dataset (`slimkv data prepare shakespeare`). Options come from the "
            "defaults, then --config FILE.yaml, then the flags below and --set key=value. Under "
            "`torchrun --nproc_per_node=N` the same command trains data-parallel (DDP) with the same global batch."
        ),
        epilog=(
            "examples:\n"
            "  slimkv train --attention gqa:n_kv_heads=2 --out runs/gqa\n"
            "  slimkv train --attention swa+kvm:swa.window=64,kvm.schedule=sqrt --out runs/hybrid\n"
            "  slimkv train --attention swa --set attention_options.window=64 --steps 300 --out runs/swa\n"
            "  slimkv train --out runs/gqa --resume            # continue a run exactly where its checkpoint left off\n"
            "  torchrun --nproc_per_node=2 -m slimkv train --attention mha --out runs/ddp"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--attention", metavar="ENTRY", help="attention kind with options, e.g. lrkv:rank=8 or a per-layer pattern swa+kvm:swa.window=64 (the older swa,mha also works)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of training options (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set any training option; values are YAML (e.g. --set lr=1e-3, --set attention_options.window=64)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory (must be empty unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR from its last checkpoint (same options)")
    p.add_argument("--dataset", help="prepared dataset name (default shakespeare)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch (global batch = batch size x grad_accum)")
    p.add_argument("--seq-len", type=int, help="tokens per training sequence")
    p.add_argument("--seed", type=int, help="seed of the initialisation and the batch sampler")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--n-layers", type=int, help="number of layers")
    p.add_argument("--n-heads", type=int, help="query heads per layer")
    p.add_argument("--device", help="auto (CUDA if available), cpu, cuda or cuda:N")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)



def overrides_from_args(args: argparse.Namespace) -> dict:
    """``--attention`` first, then the direct flags, then ``--set`` entries (later ones win)."""
    overrides = attention_overrides(args.attention) if args.attention is not None else {}
    for flag, key in DIRECT_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[key] = value
    for text in args.overrides:
        key, value = parse_override(text)
        overrides[key] = value
    return overrides


def _train(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    out = Path(args.out)
    if args.resume and args.config is None and not overrides:
        cfg = read_run_config(out)  # plain `--resume`: the stored options
    else:
        cfg = load_config(args.config, overrides)
    try:
        summary = train(cfg, out, resume=args.resume, progress=not args.no_progress)
    except TrainingDiverged as err:
        print(f"slimkv train: {err}", file=sys.stderr)
        return 1
    if summary.get("val_bpb") is not None:
        print(
            f"finished {summary['step']} steps in {out}: val CE {summary['val_ce']:.4f} nats, BPB {summary['val_bpb']:.4f}; "
            f"evaluate with `slimkv eval {out}`"
        )
    return 0
