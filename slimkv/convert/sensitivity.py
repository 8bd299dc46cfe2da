"""Measured per-layer sensitivity of a conversion: how much the model's next-token distribution
moves when ONE layer's attention is the converted one and every other layer is the original's.

``layer_sensitivity`` swaps each converted attention module into the exact copy in turn and
measures KL(exact || swapped) per token on calibration windows. Layers that are cheap to
compress show a small KL and can give up cache to the ones that are not (``latent``'s
``allocation=sensitivity``); the values are recorded in the manifest either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from slimkv.model import SlimKVForCausalLM

SEQ_LEN = 512  # tokens of each calibration window the measurement reads (the first ones)
WINDOWS = 2  # calibration windows it reads (the first ones): 1,024 tokens, one forward pass per layer and probe


def _log_probs_from(model: SlimKVForCausalLM, start: int, h: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the model run from layer ``start`` on, given that layer's input ``h``."""
    for block in model.model.layers[start:]:
        h = block(h)
    return F.log_softmax(model.lm_head(model.model.norm(h)).float(), dim=-1)


@torch.no_grad()
def layer_sensitivity(exact: SlimKVForCausalLM, converted: SlimKVForCausalLM, windows: torch.Tensor, *,
                      seq_len: int = SEQ_LEN, count: int = WINDOWS, progress: bool = True) -> list[float]:
    """Per layer i: the mean per-token KL(exact || exact with layer i's attention from
    ``converted``), in nats, over the first ``seq_len`` tokens of the first ``count`` rows of
    ``windows`` (n, T). The layers before i are not rerun (their outputs are the exact model's).
    Both models must have the same number of layers; ``exact`` is restored afterwards, whatever happens."""
    layers = exact.model.layers
    if len(layers) != len(converted.model.layers):
        raise ValueError(f"the models have {len(layers)} and {len(converted.model.layers)} layers")
    ids = windows[:count, :seq_len]
    inputs: list[torch.Tensor] = []  # every layer's input in the exact model, then the final normed state
    teacher = F.log_softmax(exact.lm_head(exact.model(input_ids=ids, hidden_states=inputs)).float(), dim=-1)
    totals = []
    for i, block in enumerate(tqdm(layers, desc="layer sensitivity", unit="layer", disable=not progress)):
        kept = block.attn
        block.attn = converted.model.layers[i].attn
        try:
            student = _log_probs_from(exact, i, inputs[i])
        finally:
            block.attn = kept
        totals.append(float(F.kl_div(student, teacher, log_target=True, reduction="sum")))
    return [max(0.0, total / ids.numel()) for total in totals]  # a KL; float rounding can leave -1e-8
