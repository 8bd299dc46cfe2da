"""Language-model evaluation of a trained run (docs/evaluation.md, "Language-model quality").

* CE: mean next-token cross-entropy in nats on the val split (never used for training).
* BPB: total NLL / (ln 2 x UTF-8 bytes of the predicted tokens). Not CE / ln 2, which is bits
  per *token* and depends on the tokenizer.
* Cache: bytes of every layer's cache after prefilling ``context`` tokens, measured from the
  cache tensors (``nbytes()``) beside the analytic ``cache_bytes``, per token per layer, and the
  ratio to MHA of the same shape (same d_model, n_heads, head_dim, dtype).
* A sample continuation of a fixed prompt (the start of the val split), seeded.
* Optionally the same CE/BPB on another text (``other_text``, e.g. ``austen``: out of domain for
  a model trained on Shakespeare), tokenized with the run's tokenizer, same window protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slimkv.attention import build_attention
from slimkv.common.checks import check_float, check_int
from slimkv.common.files import check_file_target, write_json
from slimkv.data.texts import evaluation_text
from slimkv.scoring import eval_windows, lm_metrics, score_windows
from slimkv.train.checkpoint import load_run

EVAL_FILE = "eval.json"
SAMPLE_PROMPT_TOKENS = 24  # the fixed prompt: the first tokens of the val split
SAMPLE_NEW_TOKENS = 64


@torch.no_grad()
def cache_report(model: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Cache bytes of each layer after prefilling ``ids`` (1, T), measured and analytic, and the
    per-layer per-token figure beside MHA of the same shape."""
    cache = model.new_cache(ids.shape[0])
    model(ids, cache=cache)
    seq_len = cache.seq_len
    dtype = next(model.parameters()).dtype
    layers = []
    for index, (attn, layer_cache) in enumerate(zip(model.attention_layers, cache.layers)):
        measured, analytic = layer_cache.nbytes(), attn.cache_bytes(seq_len, dtype)
        layers.append({"layer": index, "kind": attn.kind, "measured_bytes": measured, "analytic_bytes": analytic, "bytes_per_token": measured / seq_len})
    config = model.config
    mha = build_attention("mha", config.d_model, config.n_heads, config.head_dim)
    mha_per_token = mha.cache_bytes(seq_len, dtype) / seq_len
    per_layer = sum(layer["measured_bytes"] for layer in layers) / len(layers) / seq_len
    return {
        "seq_len": seq_len,
        "dtype": str(dtype).replace("torch.", ""),
        "batch_size": ids.shape[0],
        "layers": layers,
        "bytes_per_token_per_layer": per_layer,
        "analytic_bytes_per_token_per_layer": sum(layer["analytic_bytes"] for layer in layers) / len(layers) / seq_len,
        "mha_bytes_per_token_per_layer": mha_per_token,
        "ratio_to_mha": per_layer / mha_per_token,
        "measured_equals_analytic": all(layer["measured_bytes"] == layer["analytic_bytes"] for layer in layers),
    }


MAX_NEW_TOKENS = 100_000  # a cap so a typo does not ask for a run that cannot finish (stream and stop with Ctrl-C instead)


class TokenStreamer:
    """A transformers generation streamer that hands each new token id to ``on_token`` as soon as
    it is generated (the prompt, which ``generate`` also puts, is skipped)."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


@torch.no_grad()
def generate_ids(model: Any, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40, seed: int = 0,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
    """New token ids continuing ``prompt_ids`` (transformers ``generate()`` through the model's
    own caches); temperature 0 = greedy. Seeded without touching the caller's RNG state.
    ``on_token(id)`` is called for each new token as it is generated (streaming)."""
    check_int("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    check_float("temperature", temperature, 0.0)
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give some text (--prompt)")
    device = next(model.parameters()).device
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k or 0} if temperature > 0 else {"do_sample": False}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        streamer = TokenStreamer(on_token) if on_token is not None else None
        out = model.generate(prompt, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0, streamer=streamer, **sampling)
    return out[0, len(prompt_ids) :].tolist()


def evaluate_run(
    run_dir: str | Path,
    *,
    max_tokens: int | None = None,
    context: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    other_text: str | None = None,
    progress: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """Evaluate a run directory on its dataset's val split; writes ``RUN_DIR/eval.json``.

    ``context``: tokens per window (default: the training ``seq_len``). ``max_tokens``: evaluate
    about this many tokens, in windows spread over the split (default: the whole split).
    ``other_text``: also score this text (``slimkv.data.texts.evaluation_text``), as ``other``.
    """
    run_dir = Path(run_dir)
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, 1)
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
    if context is not None:
        check_int("context", context, 1)
    model, cfg, dataset = load_run(run_dir)
    check_file_target(run_dir / EVAL_FILE, "RUN_DIR")  # a folder in its place fails now, not after the work
    context = cfg.seq_len if context is None else context
    check_int("context", context, 1)
    batch_size = batch_size or cfg.batch_size
    windows = eval_windows(dataset.val, context, None if max_tokens is None else max(1, max_tokens // context))
    token_bytes = torch.as_tensor(dataset.token_bytes, dtype=torch.int64)
    quality = lm_metrics(*score_windows(model, windows, token_bytes, batch_size=batch_size, progress=progress))
    other = None
    if other_text is not None:
        other_ids = np.asarray(dataset.encode(evaluation_text(other_text)), dtype=np.int64)
        other_windows = eval_windows(other_ids, context, None if max_tokens is None else max(1, max_tokens // context))
        other = {"text": other_text, **lm_metrics(*score_windows(model, other_windows, token_bytes, batch_size=batch_size, progress=progress))}
    cache = cache_report(model, windows[:1, :context].to(next(model.parameters()).device))
    prompt_ids = dataset.val[:SAMPLE_PROMPT_TOKENS].tolist()
    sample_settings = {"max_new_tokens": SAMPLE_NEW_TOKENS, "temperature": 0.8, "top_k": 40, "seed": seed}
    continuation = generate_ids(model, prompt_ids, **sample_settings)
    result = {
        "run_dir": str(run_dir),
        "attention": cfg.attention,
        "attention_options": cfg.attention_options,
        "kind_options": cfg.kind_options,
        "shape": {"d_model": model.config.d_model, "n_layers": model.config.n_layers, "n_heads": model.config.n_heads, "head_dim": model.config.head_dim},
        "parameters": sum(p.numel() for p in model.parameters()),
        "dataset": cfg.dataset,
        "split": "val",
        "context": context,
        "windows": len(windows),
        "val_ce": quality["ce"],
        "val_bpb": quality["bpb"],
        "val_tokens": quality["tokens"],
        "val_bytes": quality["bytes"],
        "other": other,
        "cache": cache,
        "sample": {"prompt": dataset.decode(prompt_ids), "continuation": dataset.decode(continuation), **sample_settings},
    }
    write_json(run_dir / EVAL_FILE, result)
    if verbose:
        print(format_report(result))
    return result


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table of an ``evaluate_run`` result."""
    cache, shape = result["cache"], result["shape"]
    kind = result["attention"] if isinstance(result["attention"], str) else "/".join(result["attention"])
    lines = [
        f"run {result['run_dir']}: {kind}, {shape['n_layers']} layers, d_model {shape['d_model']}, "
        f"{shape['n_heads']} heads x {shape['head_dim']}, {result['parameters']:,} parameters",
        f"{result['dataset']} val split: {result['val_tokens']:,} tokens ({result['val_bytes']:,} bytes) in {result['windows']} windows of {result['context']} tokens",
        f"  val CE   {result['val_ce']:.4f} nats/token",
        f"  val BPB  {result['val_bpb']:.4f} bits/byte (total NLL / (ln 2 x bytes))",
        f"cache after prefilling {cache['seq_len']} tokens ({cache['dtype']}, batch {cache['batch_size']}):",
        f"  {'layer':>5}  {'kind':<6} {'measured B':>11} {'analytic B':>11} {'B/token':>9}",
    ]
    for layer in cache["layers"]:
        lines.append(f"  {layer['layer']:>5}  {layer['kind']:<6} {layer['measured_bytes']:>11,} {layer['analytic_bytes']:>11,} {layer['bytes_per_token']:>9.1f}")
    lines.append(
        f"  per layer per token: {cache['bytes_per_token_per_layer']:.1f} B; MHA of the same shape: "
        f"{cache['mha_bytes_per_token_per_layer']:.1f} B; ratio to MHA {cache['ratio_to_mha']:.3f}"
        + ("" if cache["measured_equals_analytic"] else "  (WARNING: measured != analytic)")
    )
    sample = result["sample"]
    lines.append(f"sample prompt (the start of the val split):\n{sample['prompt']}")
    lines.append(f"continuation ({sample['max_new_tokens']} tokens, seed {sample['seed']}, temperature {sample['temperature']}, top-k {sample['top_k']}):\n{sample['continuation']}")
    return "\n".join(lines)
