"""What a converted model's cache holds, by context: analytic for full storage, measured on a live
cache for quantized storage (the table every conversion's manifest records as ``cache_bytes``)."""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from slimkv.common.buffer import dtype_bytes
from slimkv.convert.source import Shape
from slimkv.model import SlimKVForCausalLM

MEASURED_CONTEXT = 8192  # the longest context a quantized cache is measured at during conversion (a prefill of that many tokens)
MEASURE_CHUNK = 1024


def cache_bytes_table(model: SlimKVForCausalLM, shape: Shape, *, progress: bool = False) -> list[dict[str, Any]]:
    """Cache bytes of the converted model and of the original at contexts from 1K to the model's
    position limit. Full storage: float32, analytic (the state of a bounded kind stops growing
    here). Quantized storage: bfloat16 (the dtype it is served in; its scales are stored in it),
    measured on the model's live cache prefilled in 1K chunks up to 8K, its floating elements
    counted at bfloat16's size (``measured_cache_bytes``: the bytes a bfloat16 cache holds)."""
    contexts = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if n <= shape.max_position_embeddings] or [shape.max_position_embeddings]
    if model.config.cache_storage == "full":
        rows = [(n, model.cache_bytes(n), n * shape.cache_elements * shape.n_layers * 4) for n in contexts]
        dtype, measured = "float32", False
    else:
        sizes = measured_cache_bytes(model, [n for n in contexts if n <= MEASURED_CONTEXT] or contexts[:1], torch.bfloat16, progress)
        rows = [(n, size, n * shape.cache_elements * shape.n_layers * 2) for n, size in sizes.items()]
        dtype, measured = "bfloat16", True
    return [{"context": n, "bytes": size, "original_bytes": original, "ratio": size / original, "dtype": dtype, "measured": measured}
            for n, size, original in rows]


@torch.no_grad()
def measured_cache_bytes(model: SlimKVForCausalLM, contexts: list[int], dtype: torch.dtype, progress: bool = False) -> dict[int, int]:
    """Live cache bytes of ``model`` served in ``dtype`` after each of ``contexts`` tokens: one
    prefill of token 0 in chunks, in the model's own dtype, with the cache's floating elements
    counted at ``dtype``'s size (``SlimKVCache.nbytes(float_size)``: the codes and the row counts
    do not depend on the dtype; tests/attention/test_storage.py checks the count against a live
    ``dtype`` cache on every kind). A float32 prefill is 2-5x faster than a bfloat16 one on a CPU
    without bfloat16 arithmetic."""
    cache = model.new_cache(1)
    sizes, seen = {}, 0
    for n in tqdm(sorted(contexts), desc="measure the cache", disable=not progress, leave=False):
        while seen < n:
            step = min(MEASURE_CHUNK, n - seen)
            model(torch.zeros(1, step, dtype=torch.long), cache=cache, logits_to_keep=1)
            seen += step
        sizes[n] = cache.nbytes(float_size=dtype_bytes(dtype))
    return sizes
