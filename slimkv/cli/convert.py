"""``slimkv convert``: give a pretrained model a smaller KV cache (docs/conversion.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from slimkv.common.checks import check_int
from slimkv.convert.heal import PARAMETER_SETS, HealConfig
from slimkv.convert.methods import CONVERSIONS
from slimkv.convert.pipeline import (
    CONVERTED_FOLDER,
    EXPORTS,
    ConvertOptions,
    check_before_work,
    convert_pretrained,
    heal_converted,
)


def add_commands(subparsers) -> None:
    """Register ``convert`` on the top-level ``slimkv`` parser."""
    p = subparsers.add_parser(
        "convert",
        help="give a pretrained model a smaller KV cache (GQA -> MLA / LRKV / fewer KV heads), optionally healed",
        description=(
            "Convert every attention layer of a pretrained Llama/Mistral/Qwen2 model into one of slimkv's compact kinds so that "
            "generate() decodes from a smaller cache; activation-aware (one calibration pass of the original model), optionally "
            "healed by distillation from the original. The output folder is a transformers model (AutoModelForCausalLM after "
            "`import slimkv`) with slimkv_conversion.json describing the conversion."
        ),
        epilog=(
            "methods:\n" + "\n".join(f"  {name:<10} {c.description}" for name, c in CONVERSIONS.items()) + "\n\n"
            "examples:\n"
            "  slimkv convert --model smollm2 --to mla --cache-ratio 0.5 --out runs/smollm2-mla50\n"
            "  slimkv convert --model smollm2 --to mla --cache-ratio 0.25 --heal-tokens 500000 --out runs/smollm2-mla25\n"
            "  slimkv convert --model smollm2 --to mla-prefix --cache-ratio 0.5 --export deepseek --out runs/smollm2-ds50\n"
            "  slimkv convert --out runs/smollm2-mla25 --resume        # continue an interrupted healing\n"
            "  slimkv eval cache --model runs/smollm2-mla50 --context 4096\n"
            "  slimkv eval ppl --model runs/smollm2-mla50"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="`smollm2` or a local transformers folder (Llama/Mistral/Qwen2)")
    p.add_argument("--to", dest="method", choices=list(CONVERSIONS), help="the conversion method (see below)")
    p.add_argument("--cache-ratio", type=float, help="kept fraction of the original KV-cache elements per token, in (0, 1), e.g. 0.5")
    p.add_argument("--out", required=True, help="output folder (must be empty, new, or an earlier conversion)")
    p.add_argument("--calib", default="shakespeare", help="calibration text: `shakespeare` (the training plays) or a text file/folder")
    p.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--calib-seq-len", type=int, default=1024, help="calibration window length (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of calibration sampling and healing (default 0)")
    p.add_argument("--export", choices=EXPORTS, default=None,
                   help="also write OUT/deepseek_v3: the model as transformers' DeepseekV3ForCausalLM (needs --to mla-prefix and a source without query biases)")
    heal = p.add_argument_group("healing (distillation from the original; off unless --heal-tokens)")
    heal.add_argument("--heal-tokens", type=int, default=0, help="training tokens of healing (0 = no healing)")
    heal.add_argument("--heal-text", default="shakespeare", help="healing text (default: the training plays); never the evaluation text")
    heal.add_argument("--heal-params", choices=PARAMETER_SETS, default="changed", help="what healing trains (default: what the conversion changed)")
    heal.add_argument("--heal-lr", type=float, default=HealConfig.lr, help=f"peak learning rate (default {HealConfig.lr:g})")
    heal.add_argument("--heal-seq-len", type=int, default=HealConfig.seq_len, help=f"healing window length (default {HealConfig.seq_len})")
    heal.add_argument("--heal-batch-size", type=int, default=HealConfig.batch_size, help=f"windows per step (default {HealConfig.batch_size})")
    heal.add_argument("--resume", action="store_true", help="continue the interrupted healing of the conversion in --out (same options)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_convert)


def _heal_config(args: argparse.Namespace) -> HealConfig | None:
    if not args.heal_tokens:
        return None
    return HealConfig(tokens=args.heal_tokens, text=args.heal_text, params=args.heal_params, lr=args.heal_lr, seq_len=args.heal_seq_len,
                      batch_size=args.heal_batch_size, seed=args.seed)


def _convert(args: argparse.Namespace) -> int:
    if args.threads is not None:
        check_int("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    heal_cfg = _heal_config(args)
    if heal_cfg is not None:
        heal_cfg.validate()
    if args.resume:
        if heal_cfg is None:
            raise ValueError("--resume continues a healing: give the same --heal-tokens (and other --heal-* options) as the interrupted run")
        CONVERTED_FOLDER.check(args.out)
        manifest = heal_converted(Path(args.out), heal_cfg, resume=True, progress=not args.no_progress)
    else:
        missing = [flag for flag, value in (("--model", args.model), ("--to", args.method), ("--cache-ratio", args.cache_ratio)) if value is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or --resume to continue a healing)")
        options = ConvertOptions(args.method, args.cache_ratio, args.calib, args.calib_tokens, args.calib_seq_len, args.seed, args.export)
        check_before_work(args.model, options, args.out, heal_cfg)
        _, manifest = convert_pretrained(args.model, options, args.out, heal_cfg=heal_cfg, progress=not args.no_progress)
    before, after = (sum(manifest["cache_elements_per_token_per_layer"][k]) for k in ("before", "after"))
    print(f"converted {manifest['base_model']['name']} to {manifest['kind']} ({manifest['method']}): cache {before:.0f} -> {after:.0f} elements per "
          f"token (ratio {manifest['achieved_cache_ratio']:.4f}, asked {manifest['cache_ratio']}); {manifest['allocation']}")
    if manifest.get("healing"):
        h = manifest["healing"]
        print(f"healed {h['step']} steps ({h['tokens_seen']:,} tokens, {h['trainable_parameters']:,} parameters trained): held-out KL {h.get('val_kl', float('nan')):.4f}")
    if manifest.get("export"):
        e = manifest["export"]
        print(f"exported {e['format']} to {Path(args.out) / e['folder']} (max |logit difference| {e['max_abs_logit_difference']:.2e})")
    print(f"saved to {args.out}; evaluate with `slimkv eval ppl --model {args.out}` and `slimkv eval cache --model {args.out} --context 4096`")
    return 0
