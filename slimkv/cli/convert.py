"""``slimkv convert``: give a pretrained model a smaller KV cache (docs/conversion.md)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from slimkv.common.checks import check_int
from slimkv.convert.heal import CHECKPOINTING_FROM, CHECKPOINTING_SETTINGS, HEAL_DIR, PARAMETER_SETS, HealConfig, check_resumable
from slimkv.convert.manifest import read_manifest, same_method, stored_options
from slimkv.convert.methods import CONVERSIONS, with_setting
from slimkv.convert.pipeline import (
    EXPORTS,
    ConvertOptions,
    budget_plan,
    conversion_fingerprint,
    convert_pretrained,
    heal_converted,
    read_shape,
)
from slimkv.eval.models import conversion_method


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
            "methods:\n" + "\n".join(f"  {name:<12} {c.description}" for name, c in CONVERSIONS.items()) + "\n\n"
            "method options (--to NAME:KEY=VALUE,...; defaults):\n"
            + "\n".join(f"  {name:<12} " + ", ".join(f"{k}={v}" for k, v in c.settings.items()) for name, c in CONVERSIONS.items() if c.settings)
            + "\n\n"
            "examples:\n"
            "  slimkv convert --model smollm2 --to mla --cache-ratio 0.5 --out runs/smollm2-mla50\n"
            "  slimkv convert --model smollm2 --to mla --cache-ratio 0.25 --heal-tokens 500000 --out runs/smollm2-mla25\n"
            "  slimkv convert --model smollm2 --to mla-prefix --cache-ratio 0.5 --export deepseek --out runs/smollm2-ds50\n"
            "  slimkv convert --model smollm2 --to latent --cache-ratio 0.5 --out runs/smollm2-latent50   # exact RoPE, slower long decode\n"
            "  slimkv convert --model smollm2 --to kvm:chunk_size=128,sink_len=4 --out runs/smollm2-kvm   # the recipe docs/conversion.md measured\n"
            "  slimkv convert --out runs/smollm2-mla25 --resume        # continue an interrupted healing (with its options)\n"
            "  slimkv eval cache --model runs/smollm2-mla50 --context 4096\n"
            "  slimkv eval ppl --model runs/smollm2-mla50"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="`smollm2` or a local transformers folder (Llama/Mistral/Qwen2)")
    p.add_argument("--to", dest="method", metavar="METHOD[:KEY=VALUE,...]",
                   help=f"the conversion method ({', '.join(CONVERSIONS)}; see below), with its own options where it has any (listed below)")
    p.add_argument("--cache-ratio", type=float,
                   help="kept fraction of the original KV-cache elements per token, in (0, 1), e.g. 0.5 (not for kvm, rope-partial and streaming: their cache is set by their own options; for mla-kvm: the width of its latent rows, whose state is bounded)")
    p.add_argument("--cache-storage", default=None, metavar="full|int8|int4[:group=G,residual=R,block=B]|weighed",
                   help="how the converted model's cache holds its rows (default full): int8 / int4 codes in groups of 32 channels with a "
                        "full-precision window of the newest 128 tokens; stacks with --cache-ratio (latent 0.5 x int4 keeps about 0.16 of the bytes); "
                        "with --cache-budget, 'weighed' builds each candidate that fits (storage, and window with --budget-windows) and keeps the one that copies best (docs/conversion.md)")
    p.add_argument("--cache-budget", type=float, default=None, metavar="B",
                   help="plan a hybrid conversion holding at most B of the bfloat16 original's cache bytes at --at tokens: the storage and "
                        "the exact KV heads are chosen from measured head roles (slimkv.convert.budget); --to defaults to hybrid")
    p.add_argument("--at", type=int, default=None, help="the context the budget is measured at (default min(8192, the model's positions)); "
                                                        "the same as --to hybrid:at=N")
    p.add_argument("--budget-windows", type=_windows, default=None, metavar="W[,W...]",
                   help="with --cache-budget: the windows the plan may give the bounded KV heads (default: the method's window, 256); "
                        "the plan takes the one that keeps the most heads exact, or with --cache-storage weighed the one that copies best")
    p.add_argument("--out", required=True, help="output folder (must be empty, new, or an earlier conversion)")
    p.add_argument("--calib", default=None, help="calibration text: `shakespeare` (the training plays), `kjv`, `devil`, `pydoc`, `handbook`, a comma-separated mix of them (equal shares) "
                   f"or a text file/folder (default: {ConvertOptions.calib})")
    p.add_argument("--calib-tokens", type=int, default=None, help=f"calibration tokens (default {ConvertOptions.calib_tokens}; at most what the text holds)")
    p.add_argument("--calib-seq-len", type=int, default=None, help=f"calibration window length (default {ConvertOptions.calib_seq_len})")
    p.add_argument("--seed", type=int, default=None, help="seed of calibration sampling and healing (default 0)")
    p.add_argument("--export", choices=EXPORTS, default=None,
                   help="also write OUT/deepseek_v3: the model as transformers' DeepseekV3ForCausalLM (needs --to mla-prefix and a source without query biases)")
    heal = p.add_argument_group("healing (distillation from the original; off unless --heal-tokens)")
    heal.add_argument("--heal-tokens", type=int, default=None, help="training tokens of healing (default 0: no healing)")
    heal.add_argument("--heal-text", default=None, help=f"healing text, as --calib (default: {HealConfig.text}); never the evaluation text")
    heal.add_argument("--heal-params", choices=PARAMETER_SETS, default=None, help="what healing trains (default: what the conversion changed)")
    heal.add_argument("--heal-lr", type=float, default=None, help=f"peak learning rate (default {HealConfig.lr:g})")
    heal.add_argument("--heal-seq-len", type=int, default=None, help=f"healing window length (default {HealConfig.seq_len})")
    heal.add_argument("--heal-batch-size", type=int, default=None, help=f"windows per step (default {HealConfig.batch_size})")
    heal.add_argument("--heal-copy-fraction", type=float, default=None,
                      help="share of healing windows that repeat a span shown earlier (word lists, JSON records, prose; never an evaluation's "
                           f"template), to teach long-range copying back (default {HealConfig.copy_fraction:g})")
    heal.add_argument("--heal-activation-checkpointing", choices=CHECKPOINTING_SETTINGS, default=None,
                      help=f"recompute each block's activations in the backward pass instead of keeping them: less memory on long windows, more "
                           f"time, the same weights (default auto: on from steps of {CHECKPOINTING_FROM} tokens, --heal-seq-len x --heal-batch-size; docs/conversion.md)")
    heal.add_argument("--resume", action="store_true",
                      help="continue the interrupted healing of the conversion in --out, with the options it was started with (any given must match)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_convert)


# --heal-* option -> HealConfig field
HEAL_FLAGS = {"heal_tokens": "tokens", "heal_text": "text", "heal_params": "params", "heal_lr": "lr", "heal_seq_len": "seq_len",
              "heal_batch_size": "batch_size", "heal_copy_fraction": "copy_fraction", "heal_activation_checkpointing": "activation_checkpointing",
              "seed": "seed"}
# conversion option -> ConvertOptions field (checked against the manifest on --resume)
CONVERT_FLAGS = {"method": "method", "cache_ratio": "cache_ratio", "calib": "calib", "calib_tokens": "calib_tokens", "calib_seq_len": "calib_seq_len",
                 "seed": "seed", "export": "export", "cache_storage": "cache_storage", "cache_budget": "cache_budget",
                 "budget_windows": "budget_windows"}


def _windows(text: str) -> list[int]:
    """``--budget-windows 256,128,64`` -> [256, 128, 64]; argparse's error names the option."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected window lengths separated by commas, e.g. 256,128,64; got {text!r}") from None


def _flag(name: str) -> str:
    return "--to" if name == "method" else f"--{name.replace('_', '-')}"


def _given(args: argparse.Namespace, names) -> dict[str, object]:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _heal_config(args: argparse.Namespace) -> HealConfig | None:
    given = _given(args, HEAL_FLAGS)
    if not given.get("heal_tokens"):
        extra = sorted(_flag(name) for name in given if name not in ("heal_tokens", "seed"))
        if extra:
            raise ValueError(f"{', '.join(extra)} set(s) up healing, which runs only with --heal-tokens N (N > 0)")
        return None
    cfg = HealConfig(**{HEAL_FLAGS[name]: value for name, value in given.items()})
    cfg.validate()
    return cfg


def _resume(args: argparse.Namespace) -> dict:
    """``--resume``: the options given must be those of the conversion and healing in --out."""
    out = Path(args.out).expanduser()
    manifest = read_manifest(out)
    stored = stored_options(manifest)  # the --to text spelled as today, for a folder converted before the renames
    differences = [f"{_flag(name)}: {out} has {stored[CONVERT_FLAGS[name]]!r}, given {value!r}" for name, value in _given(args, CONVERT_FLAGS).items()
                   if CONVERT_FLAGS[name] in stored and not (stored[CONVERT_FLAGS[name]] == value or name == "method" and same_method(stored["method"], value))]
    base = (manifest.get("base_model") or {}).get("name")
    if args.model is not None and args.model != base and str(Path(args.model).expanduser().resolve()) != base:
        differences.insert(0, f"--model: {out} was converted from {base!r}, given {args.model!r}")
    if differences:
        raise ValueError(f"--resume continues the healing of the conversion in {out}, which was made with other options ({'; '.join(differences)}); "
                         "give the same options or none")
    requested = None
    if _given(args, HEAL_FLAGS):
        stored_cfg = check_resumable(out / HEAL_DIR, None, conversion_fingerprint(out, manifest))
        requested = replace(stored_cfg, **{HEAL_FLAGS[name]: value for name, value in _given(args, HEAL_FLAGS).items()})
    return heal_converted(out, requested, resume=True, progress=not args.no_progress)


def _with_at(method: str | None, at: int) -> str:
    """``--at N`` as the hybrid method's ``at`` option."""
    if method is None or not method.startswith("hybrid"):
        raise ValueError(f"--at sets where a hybrid conversion's budget is measured; it needs --to hybrid or --cache-budget, not --to {method}")
    return with_setting(method, "at", at, f"--at {at}")


def _convert(args: argparse.Namespace) -> int:
    if args.threads is not None:
        check_int("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    if args.resume:
        manifest = _resume(args)
    else:
        heal_cfg = _heal_config(args)
        if args.method is None and args.cache_budget is not None:
            args.method = "hybrid"
        if args.at is not None:
            args.method = _with_at(args.method, args.at)
        missing = [flag for flag, value in (("--model", args.model), ("--to", args.method)) if value is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or --resume to continue a healing)")
        options = ConvertOptions(**{CONVERT_FLAGS[name]: value for name, value in _given(args, CONVERT_FLAGS).items()})
        if options.cache_budget is not None:  # the plan is said before any weights load (convert_pretrained checks the rest first)
            options.validate()
            plan = budget_plan(options, read_shape(args.model))
            window = f" (window {plan.window})" if options.budget_windows else ""
            settled = "" if plan.to_weigh else f" --cache-ratio {plan.cache_ratio:.4f} --cache-storage {plan.storage}{window}"
            print(f"plan for --cache-budget {options.cache_budget} at {plan.at} tokens: --to {options.method}{settled}: {plan.why}")
        _, manifest = convert_pretrained(args.model, options, args.out, heal_cfg=heal_cfg, progress=not args.no_progress)
        if (manifest.get("budget_plan") or {}).get("weighing"):
            print(f"weighed: {manifest['budget_plan']['why']}")
    if manifest.get("cache_elements_per_token_per_layer"):
        before, after = (sum(manifest["cache_elements_per_token_per_layer"][k]) for k in ("before", "after"))
        print(f"converted {manifest['base_model']['name']} to {manifest['kind']} ({conversion_method(manifest)}): cache {before:.0f} -> {after:.0f} elements per "
              f"token (ratio {manifest['achieved_cache_ratio']:.4f}, asked {manifest['cache_ratio']}); {manifest['allocation']}")
    elif manifest.get("cache_storage", "full") == "full":
        sizes = ", ".join(f"{row['context']}: {row['bytes'] / 2**20:.1f} MiB ({row['ratio']:.3f})" for row in manifest["cache_bytes"])
        print(f"converted {manifest['base_model']['name']} to {manifest['kind']} ({conversion_method(manifest)}): {manifest['allocation']}\n"
              f"cache (float32) by context, and as a fraction of the original's: {sizes}")
    else:
        sizes = ", ".join(f"{row['context']}: {row['bytes'] / 2**20:.2f} MiB ({row['ratio']:.4f})" for row in manifest["cache_bytes"])
        print(f"converted {manifest['base_model']['name']} to {manifest['kind']} ({conversion_method(manifest)}): {manifest['allocation']}\n"
              f"cache storage {manifest['cache_storage']}: live bfloat16 cache by context, and as a fraction of the bfloat16 original's: {sizes}")
    transfer = (manifest.get("refinement") or {}).get("layers")
    if transfer:
        before = sum(t["relative_error_before"] for t in transfer) / len(transfer)
        after = sum(t["relative_error_after"] for t in transfer) / len(transfer)
        print(f"attention transfer: mean relative output error per layer {before:.4f} -> {after:.4f}")
    if manifest.get("healing"):
        h = manifest["healing"]
        print(f"healed {h['step']} steps ({h['tokens_seen']:,} tokens, {h['trainable_parameters']:,} parameters trained): held-out KL {h.get('val_kl', float('nan')):.4f}")
    if manifest.get("export"):
        e = manifest["export"]
        print(f"exported {e['format']} to {Path(args.out) / e['folder']} (max |logit difference| {e['max_abs_logit_difference']:.2e})")
    context = min(4096, max(row["context"] for row in manifest["cache_bytes"]))  # a context the model has positions for
    print(f"saved to {args.out}; evaluate with `slimkv eval ppl --model {args.out}` and `slimkv eval cache --model {args.out} --context {context}`")
    return 0
