"""Perplexity of a pretrained (possibly compressed) causal LM on held-out text.

Protocol (evaluation.md, "Perplexity of pretrained models"): join documents with "\\n\\n",
tokenize once, cut into non-overlapping windows of ``seq_len`` tokens, and report
ppl = exp(total NLL / tokens predicted); each window predicts its tokens 2..n from their prefix
in the window. A window whose loss is not finite is an error, never skipped. For a compressed
model the uncompressed base model is evaluated in the same run and printed beside it.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm


class NonFiniteLossError(ValueError):
    """A perplexity window produced a NaN/inf loss (the model is broken there)."""


@torch.no_grad()
def perplexity_of_ids(model: nn.Module, ids: torch.Tensor, seq_len: int, *, progress: bool = False, desc: str = "ppl") -> dict[str, Any]:
    """Perplexity of a 1-D LongTensor of token ids, non-overlapping windows of ``seq_len``."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {ids.numel()}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll = 0.0
    predicted = 0
    starts = [s for s in range(0, ids.numel(), seq_len) if ids.numel() - s >= 2]
    t0 = time.perf_counter()
    for index, start in enumerate(tqdm(starts, desc=desc, disable=not progress, leave=False)):
        window = ids[start:start + seq_len].to(device).unsqueeze(0)
        logits = model(window, use_cache=False).logits[0, :-1].float()
        nll = F.cross_entropy(logits, window[0, 1:], reduction="sum").double().item()
        if not math.isfinite(nll):
            raise NonFiniteLossError(f"window {index} (tokens {start}..{start + window.shape[1]}) has a non-finite loss ({nll})")
        total_nll += nll
        predicted += window.shape[1] - 1
    model.train(was_training)
    return {
        "ppl": math.exp(total_nll / predicted),
        "nll_per_token": total_nll / predicted,
        "tokens_predicted": predicted,
        "tokens_used": int(min(ids.numel(), starts[-1] + seq_len)),
        "windows": len(starts),
        "seq_len": seq_len,
        "seconds": time.perf_counter() - t0,
    }


def perplexity(model: nn.Module, tokenizer, text: str, seq_len: int = 1024, max_tokens: int | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Perplexity of ``model`` on ``text`` (tokenized once; the first ``max_tokens`` tokens if given)."""
    from slimkv.compress.text import tokenize

    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    ids = torch.tensor(tokenize(tokenizer, text), dtype=torch.long)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return perplexity_of_ids(model, ids, seq_len, progress=progress)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``slimkv eval ppl``."""
    parser.add_argument("--model", required=True, help="`smollm2`, a local transformers folder, or a `slimkv compress` output folder")
    parser.add_argument("--text", default="shakespeare-val", help="`shakespeare-val` (held-out plays) or a local text file/folder (default: shakespeare-val)")
    parser.add_argument("--seq-len", type=int, default=1024, help="window length in tokens (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Handler of ``slimkv eval ppl``: prints a table (compressed beside dense) and optional JSON."""
    from slimkv.compress.models import load_pretrained
    from slimkv.compress.text import evaluation_text, text_sha256

    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    text = evaluation_text(args.text)
    loaded = load_pretrained(args.model)
    rows = []
    compressed = loaded.identity.get("compressed")
    if compressed is not None:
        if compressed.get("calibration_text_sha256") == text_sha256(text):
            raise ValueError(f"--text {args.text!r} is the text this model was calibrated on; evaluate on held-out text")
        base = load_pretrained(loaded.identity["name"])
        rows.append(("dense (" + loaded.identity["name"] + ")", perplexity(base.model, base.tokenizer, text, args.seq_len, args.max_tokens, progress=True)))
        del base
        label = f"{compressed['method']} ratio {compressed['ratio']} (achieved {compressed['achieved_ratio']:.4f})"
    else:
        label = f"dense ({args.model})"
    rows.append((label, perplexity(loaded.model, loaded.tokenizer, text, args.seq_len, args.max_tokens, progress=True)))
    print(f"perplexity on {args.text!r}, {args.seq_len}-token windows")
    print("| model | ppl | tokens predicted | windows |\n| --- | ---: | ---: | ---: |")
    for name, result in rows:
        print(f"| {name} | {result['ppl']:.3f} | {result['tokens_predicted']} | {result['windows']} |")
    if args.json:
        from pathlib import Path

        from slimkv.files import write_json

        write_json(Path(args.json), {"text": args.text, "text_sha256": text_sha256(text), "model": loaded.identity, "results": [{"model": n, **r} for n, r in rows]})
    return 0
