"""Scoring a causal LM on token ids: the two window protocols, shared by training, evaluation,
compression and conversion (docs/evaluation.md).

* Training runs (``score_windows`` over ``eval_windows``): windows of T + 1 tokens at stride T,
  so every token after the first is predicted exactly once; CE in nats and BPB = total NLL /
  (ln 2 x UTF-8 bytes of the predicted tokens), never CE / ln 2 (bits per token).
* Pretrained models (``perplexity_of_ids``): non-overlapping windows of ``seq_len`` tokens, each
  predicting its tokens 2..n from their prefix in the window; ppl = exp(total NLL / tokens
  predicted). A window whose loss is not finite is an error, never skipped.
* ``wilson``: the 95% interval of a fraction of prompts answered, for every retrieval report.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from slimkv.common.checks import check_int


def eval_windows(tokens: np.ndarray, context: int, max_windows: int | None = None) -> torch.Tensor:
    """(n, context + 1) windows of ``tokens`` cut at stride ``context``, so every token after the
    first is predicted exactly once (a tail shorter than a window is left out). With more windows
    than ``max_windows``, an evenly spaced subset spread over the whole split."""
    check_int("context", context, 1)
    total = (len(tokens) - 1) // context
    if total < 1:
        raise ValueError(f"the split has {len(tokens)} tokens, too few for a context of {context}; lower the context")
    index = torch.arange(total)
    if max_windows is not None and max_windows < total:
        index = torch.linspace(0, total - 1, max(1, max_windows)).round().long()
    ids = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    return ids[index[:, None] * context + torch.arange(context + 1)]


@torch.no_grad()
def score_windows(
    model: torch.nn.Module,
    windows: torch.Tensor,
    token_bytes: torch.Tensor,
    *,
    batch_size: int,
    amp_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> tuple[float, int, int]:
    """(sum of next-token NLL in nats, tokens predicted, their UTF-8 bytes) for ``windows``
    (n, T + 1): positions 1..T are predicted from the ones before them. The sum is float64."""
    if len(windows) == 0:
        return 0.0, 0, 0
    device = next(model.parameters()).device
    nll = 0.0
    for chunk in tqdm(windows.split(batch_size), desc="eval", unit="batch", disable=not progress, leave=False):
        ids = chunk.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(ids[:, :-1]).logits
        nll += float(F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").double())
    targets = windows[:, 1:]
    return nll, targets.numel(), int(token_bytes[targets].sum())


def lm_metrics(nll_sum: float, tokens: float, n_bytes: float) -> dict[str, float]:
    """CE (nats/token) and BPB (bits/byte, bytes denominator) from the totals."""
    if tokens <= 0 or n_bytes <= 0:
        raise ValueError("nothing was evaluated (0 tokens); the val split is too short for this context")
    return {"ce": nll_sum / tokens, "bpb": nll_sum / (math.log(2) * n_bytes), "tokens": int(tokens), "bytes": int(n_bytes)}


class NonFiniteLossError(ValueError):
    """A perplexity window produced a NaN/inf loss (the model is broken there)."""


@torch.no_grad()
def perplexity_of_ids(model: nn.Module, ids: torch.Tensor, seq_len: int, *, progress: bool = False, desc: str = "ppl",
                      cache_chunk: int | None = None) -> dict[str, Any]:
    """Perplexity of a 1-D LongTensor of token ids, non-overlapping windows of ``seq_len``. With
    ``cache_chunk`` (a slimkv model), each window is fed through the model's own cache in calls of
    that many tokens, so the scores see the cache as it is stored (a quantized cache's codes)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {ids.numel()}")
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else None
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"the tokenizer produced ids up to {int(ids.max())} but the model has {vocab} embeddings; the tokenizer does not belong to this model")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll = 0.0
    predicted = 0
    starts = [s for s in range(0, ids.numel(), seq_len) if ids.numel() - s >= 2]
    t0 = time.perf_counter()
    for index, start in enumerate(tqdm(starts, desc=desc, disable=not progress, leave=False)):
        window = ids[start:start + seq_len].to(device).unsqueeze(0)
        if cache_chunk is None:
            logits = model(window, use_cache=False).logits[0, :-1].float()
        else:
            cache = model.new_cache(1)
            logits = torch.cat([model(part, cache=cache).logits[0] for part in window.split(cache_chunk, dim=1)])[:-1].float()
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
        "through_cache_in_calls_of": cache_chunk,
        "seconds": time.perf_counter() - t0,
    }


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion hits / n."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-prompt scores in [0, 1] (partial credit,
    where ``wilson`` of the fully answered prompts says little); seeded, so a report regenerates
    byte for byte. (0, 1) for no values."""
    if not values:
        return 0.0, 1.0
    scores = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(scores), size=(resamples, len(scores)))
    means = scores[picks].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))
