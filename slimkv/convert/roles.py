"""Head roles, measured: which KV heads of a pretrained model copy from far back (retrieval heads)
and which are served by attention sinks and a recent window (Wu et al. 2024's retrieval heads;
DuoAttention, Xiao et al. 2024).

The measurement runs the original model on long synthetic contexts in which a span of text is
shown once and repeated much later ``[prose | SOURCE | prose | SOURCE]``, in formats that are not
any evaluation's (no pass key, no "magic number" needle, no RULER template): a list of random
words, JSON records of random names and numbers, and a paragraph of the calibration prose. While
the model reads the repeat, a head that retrieves attends to the first copy, far outside any
window. Two scores per (layer, KV head), averaged over the contexts and the head's query heads:

* ``copy_mass``: the attention mass the head puts on the first copy while reading the repeat;
* ``window_loss``: the relative change of the head's contribution to the residual stream (its
  query heads' outputs through W_o, over the repeat) when it sees only ``sink_len`` sinks and the
  newest ``window`` tokens (its softmax renormalised over them), DuoAttention's criterion measured
  layer by layer with the original's inputs.

Shapes: a context is (T,) token ids; scores are (layers, KV heads) lists of floats.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from slimkv.common.files import save_figure
from slimkv.common.plotting import new_figure
from slimkv.data.texts import tokenize

FORMATS = ("word-list", "json-records", "paragraph")
SCORES = ("window_loss", "copy_mass")
MIN_WORDS = 48


@dataclass(frozen=True)
class CopyContext:
    """One measurement context: ids (T,), the first copy ``source`` and the repeat ``copy`` (slices of positions)."""

    format: str
    ids: torch.Tensor
    source: slice
    copy: slice


def copy_words(documents: list[str], rng: random.Random) -> list[str]:
    """Distinct lowercase words of the prose (letters only, 4-10 long), in order of appearance; made-up
    words of random syllables when the prose has fewer than ``MIN_WORDS``."""
    seen: dict[str, None] = {}
    for document in documents:
        for raw in document.split():
            word = raw.strip(string.punctuation).lower()
            if 4 <= len(word) <= 10 and word.isalpha():
                seen.setdefault(word)
    while len(seen) < MIN_WORDS:
        seen.setdefault("".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4))))
    return list(seen)


def source_text(fmt: str, words: list[str], documents: list[str], rng: random.Random) -> str:
    """The span that is shown and later repeated, in format ``fmt``."""
    if fmt == "word-list":
        return "Words: " + ", ".join(rng.sample(words, 24)) + "."
    if fmt == "json-records":
        rows = [f'{{"id": {rng.randrange(1000, 99999)}, "name": "{rng.choice(words)}", "city": "{rng.choice(words)}", '
                f'"count": {rng.randrange(10, 999)}}}' for _ in range(5)]
        return "[\n" + ",\n".join(rows) + "\n]"
    document = rng.choice([d for d in documents if len(d) > 600] or documents)
    start = rng.randrange(0, max(1, len(document) - 400))
    return " ".join(document[start:start + 400].split()[1:-1])


def copy_contexts(tokenizer: Any, documents: list[str], length: int, per_format: int, seed: int) -> list[CopyContext]:
    """``per_format`` contexts of ``length`` tokens in each of ``FORMATS``: prose, the source at a
    depth of 5-25%, prose, and the source again ending the context (the repeat starts at least
    ``length / 2`` tokens after the source). ValueError when the prose is too short."""
    rng = random.Random(seed)
    prose = tokenize(tokenizer, "\n\n".join(documents))
    words = copy_words(documents, rng)
    if len(prose) < 2 * length:
        raise ValueError(f"the calibration text is too short to build {length}-token role-measurement contexts (it has {len(prose)} tokens; "
                         f"it needs {2 * length})")
    contexts = []
    for fmt in FORMATS:
        for _ in range(per_format):
            source = tokenize(tokenizer, "\n" + source_text(fmt, words, documents, rng) + "\n")[: length // 8]
            depth = int(length * rng.uniform(0.05, 0.25))
            gap = length - depth - 2 * len(source)
            offset = rng.randrange(0, len(prose) - depth - gap)
            ids = [*prose[offset:offset + depth], *source, *prose[offset + depth:offset + depth + gap], *source]
            contexts.append(CopyContext(fmt, torch.tensor(ids, dtype=torch.long), slice(depth, depth + len(source)),
                                        slice(length - len(source), length)))
    return contexts


def streaming_visible(rows: torch.Tensor, length: int, sink_len: int, window: int) -> torch.Tensor:
    """(rows, length) bool: what a query at each position in ``rows`` sees with sinks + a window (causal)."""
    keys = torch.arange(length)[None, :]
    rows = rows[:, None]
    return (keys <= rows) & ((keys < sink_len) | (keys > rows - window))


def layer_scores(weights: torch.Tensor, values: torch.Tensor, o_weight: torch.Tensor, context: CopyContext, sink_len: int, window: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(copy_mass, window_loss) per KV head of one layer on one context. weights: the softmax
    probabilities (H, T, T); values (G, T, d); o_weight (d_model, H d)."""
    n_heads, length = weights.shape[0], weights.shape[-1]
    n_kv, head_dim = values.shape[0], values.shape[-1]
    group = n_heads // n_kv
    rows = torch.arange(length)[context.copy]
    probs = weights[:, context.copy].double()  # (H, Q, T)
    copy_mass = probs[:, :, context.source].sum(-1).mean(-1).view(n_kv, group).mean(-1)
    visible = streaming_visible(rows, length, sink_len, window)
    bounded = probs * visible
    bounded = bounded / bounded.sum(-1, keepdim=True).clamp_min(1e-30)
    v = values.double().repeat_interleave(group, dim=0)  # (H, T, d)
    full_out, bounded_out = probs @ v, bounded @ v  # (H, Q, d)
    w_o = o_weight.double().view(o_weight.shape[0], n_heads, head_dim)  # (d_model, H, d)
    contribution = torch.einsum("mhd,hqd->hqm", w_o, full_out).view(n_kv, group, -1, o_weight.shape[0]).sum(1)
    change = torch.einsum("mhd,hqd->hqm", w_o, full_out - bounded_out).view(n_kv, group, -1, o_weight.shape[0]).sum(1)
    window_loss = change.square().sum((-1, -2)) / contribution.square().sum((-1, -2)).clamp_min(1e-30)
    return copy_mass.float(), window_loss.float()


@torch.no_grad()
def measure_head_roles(model: nn.Module, contexts: list[CopyContext], *, sink_len: int, window: int, progress: bool = True) -> dict[str, Any]:
    """Both scores (module docstring) of every (layer, KV head) of a transformers Llama-family
    ``model`` on ``contexts``: per score a (layers, KV heads) list, its mean per format, and what
    was measured. The model runs with eager attention (for the probabilities) and is restored."""
    layers = model.model.layers
    totals = {name: {fmt: torch.zeros(len(layers), model.config.num_key_value_heads) for fmt in FORMATS} for name in SCORES}
    counts = dict.fromkeys(FORMATS, 0)
    current: list[CopyContext] = []

    def hook(index: int, attn: nn.Module):
        def after(_module, _args, kwargs, output):
            out, weights = output
            hidden = kwargs["hidden_states"]
            values = attn.v_proj(hidden)[0].view(hidden.shape[1], -1, attn.head_dim).transpose(0, 1)
            copy_mass, window_loss = layer_scores(weights[0], values, attn.o_proj.weight, current[0], sink_len, window)
            totals["copy_mass"][current[0].format][index] += copy_mass
            totals["window_loss"][current[0].format][index] += window_loss
            return out, None
        return after

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    handles = [layer.self_attn.register_forward_hook(hook(i, layer.self_attn), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for context in tqdm(contexts, desc="head roles", unit="context", disable=not progress):
            current[:] = [context]
            model(context.ids[None], use_cache=False)
            counts[context.format] += 1
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    result: dict[str, Any] = {"sink_len": sink_len, "window": window, "contexts": {fmt: counts[fmt] for fmt in FORMATS},
                              "seq_len": int(contexts[0].ids.numel()), "formats": list(FORMATS)}
    for name in SCORES:
        per_format = {fmt: totals[name][fmt] / max(counts[fmt], 1) for fmt in FORMATS}
        result[name] = torch.stack(list(per_format.values())).mean(0).tolist()
        result[f"{name}_by_format"] = {fmt: value.tolist() for fmt, value in per_format.items()}
    return result


@torch.no_grad()
def copy_accuracy(model: nn.Module, contexts: list[CopyContext], *, storage: str | None = None, chunk: int = 64,
                  progress: bool = True) -> dict[str, Any]:
    """Teacher-forced next-token accuracy over each context's repeat (its first token left out: nothing says a repeat
    starts there): how much of a span seen thousands of tokens earlier the model still copies, a retrieval measure in
    formats no evaluation uses. ``model`` is a transformers causal LM (its ``model`` the decoder) or a slimkv one; with
    ``storage`` (a slimkv model's cache storage, e.g. ``int4``) the repeat is read through a cache of that storage in
    calls of ``chunk`` tokens after a prefill of the rest, so quantized rows are what it attends to. Returns the mean
    per format, over all contexts, and each context's accuracy."""
    per_context = []
    for context in tqdm(contexts, desc="copy accuracy", unit="context", disable=not progress):
        ids = context.ids[None]
        first, stop = context.copy.start + 1, context.copy.stop - 1  # positions whose next token is a repeated one
        if storage is None:
            out = model.model(input_ids=ids)
            hidden = (out if isinstance(out, torch.Tensor) else out.last_hidden_state)[0, first:stop]
        else:
            cache = model.new_cache(1, storage=storage)
            model.model(input_ids=ids[:, :first], cache=cache)
            hidden = torch.cat([model.model(input_ids=ids[:, s:min(s + chunk, stop)], cache=cache)[0] for s in range(first, stop, chunk)])
        predicted = model.lm_head(hidden).argmax(-1)
        per_context.append({"format": context.format, "accuracy": float((predicted == context.ids[first + 1:stop + 1]).float().mean())})
    formats = list(dict.fromkeys(c["format"] for c in per_context))
    by_format = {f: sum(c["accuracy"] for c in per_context if c["format"] == f) / sum(c["format"] == f for c in per_context) for f in formats}
    return {"mean": sum(c["accuracy"] for c in per_context) / len(per_context), "by_format": by_format, "contexts": per_context,
            "storage": storage}


def plot_head_roles(roles: dict[str, Any], path: Any) -> None:
    """A layer x KV head heatmap of each score, side by side, saved as PNG at ``path``."""
    n_layers, n_kv = len(roles[SCORES[0]]), len(roles[SCORES[0]][0])
    fig, axes = new_figure(1, len(SCORES), figsize=(3 + 1.5 * len(SCORES) * n_kv, 0.22 * n_layers + 2), layout="constrained")
    for ax, name in zip(axes, SCORES):
        image = ax.imshow(torch.tensor(roles[name]).numpy(), aspect="auto", cmap="viridis")
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"head roles: {roles['seq_len']}-token copy contexts, {roles['sink_len']} sinks + window {roles['window']}")
    save_figure(fig, path)
