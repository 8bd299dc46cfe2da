"""One recall run: train a small model on a recall task (``slimkv.recall.task.RecallTask``: MQAR
or the prose needles) and measure its recall at the training length and longer, with the live
cache it needed (docs/recall.md).

The training reuses the training loop (``slimkv.train.trainer``): AdamW, warmup + cosine, NaN
stop, atomic checkpoints and exact resume, progress bar. The loss is the cross-entropy at the
queried positions only (the logits are computed there only). After training, on fixed test sets:

- accuracy (exact argmax match of the queried values) at ``seq_len`` x each length factor
  (factor f: the task's ``scaled(f)``, e.g. for MQAR f times the tokens, pairs and queries, so
  the key-to-query gaps grow f times),
  overall and per gap bucket (``GAP_EDGES``): capacity failures and learning failures look different;
- the cache measured on the live cache (``model.new_cache(1)``, one test sequence prefilled,
  ``cache.nbytes()``), per token, at every length: bounded-state kinds spread one state over more tokens.

``slimkv.recall.recipe.RecallRecipe`` is the whole recipe; ``train_recall`` reuses a finished
run and resumes an interrupted one, so a sweep (``slimkv.recall.frontier``) can be rerun.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from slimkv.common.files import folder_lock, read_json, write_json
from slimkv.common.spec import AttentionSpec
from slimkv.common.vocabulary import current_attention_fields
from slimkv.model import SlimKVForCausalLM
from slimkv.recall.recipe import RecallRecipe, model_config
from slimkv.recall.task import IGNORE, RecallBatches, answer_accuracy, eval_set, unpack
from slimkv.train.checkpoint import has_checkpoint
from slimkv.train.trainer import Trainer, make_optimizer, run_loop

RUN_FILE = "recall_run.json"  # a finished (trained + evaluated) recall run
RUN_CONFIG = "recall_config.json"
GAP_EDGES = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PROGRESS_SEQUENCES = 128  # the test sequences scored at each periodic evaluation


def recall_loss(model: torch.nn.Module, packed: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the queried values of a packed batch (``RecallBatches``)."""
    inputs, targets = unpack(packed)
    logits, wanted = scored_logits(model, inputs, targets)
    return F.cross_entropy(logits.float(), wanted)


def scored_logits(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at the queried positions (n, vocab), their values (n,))."""
    causal_lm = getattr(model, "module", model)  # DDP wraps the model
    hidden = causal_lm.model(input_ids=inputs)
    scored = targets != IGNORE
    return causal_lm.lm_head(hidden[scored]), targets[scored]


@torch.no_grad()
def recall_accuracy(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, batch_tokens: int = 16384) -> torch.Tensor:
    """Per answer (``slimkv.recall.task.answer_index`` order): 1.0 where the argmax is right at
    every one of its positions, i.e. greedy decoding would produce the answer."""
    rows = max(1, batch_tokens // inputs.shape[1])
    correct = []
    for start in range(0, inputs.shape[0], rows):
        logits, wanted = scored_logits(model, inputs[start : start + rows], targets[start : start + rows])
        correct.append(logits.argmax(-1) == wanted)
    return answer_accuracy(torch.cat(correct), targets)


def accuracy_by_gap(hits: torch.Tensor, gaps: torch.Tensor) -> dict[str, dict[str, float]]:
    """{"lo-hi": {"accuracy", "count"}} over the ``GAP_EDGES`` buckets that hold queries."""
    buckets = {}
    for low, high in zip(GAP_EDGES[:-1], GAP_EDGES[1:]):
        chosen = (gaps >= low) & (gaps < high)
        if chosen.any():
            buckets[f"{low}-{high}"] = {"accuracy": float(hits[chosen].mean()), "count": int(chosen.sum())}
    return buckets


@torch.no_grad()
def measured_cache(model: SlimKVForCausalLM, inputs: torch.Tensor) -> dict[str, Any]:
    """Live cache after prefilling one sequence: total bytes, bytes per token, and the analytic figure."""
    model.eval()
    cache = model.new_cache(1)
    model(inputs[:1], cache=cache)
    tokens = inputs.shape[1]
    live = cache.nbytes()
    return {"tokens": tokens, "bytes": live, "bytes_per_token": live / tokens, "analytic_bytes": model.cache_bytes(tokens)}


def evaluate_recall(model: SlimKVForCausalLM, recipe: RecallRecipe) -> dict[str, Any]:
    """Accuracy (overall, per gap bucket) and the measured cache at every length factor."""
    model.eval()
    out = {}
    for factor in recipe.lengths:
        task = recipe.task.scaled(factor)
        inputs, targets = eval_set(task, max(32, recipe.eval_sequences // factor), recipe.eval_seed, factor)
        hits = recall_accuracy(model, inputs, targets)
        out[f"{factor}x"] = {
            "seq_len": task.seq_len,
            "n_pairs": task.n_pairs,
            "sequences": int(inputs.shape[0]),
            "queries": int(hits.numel()),
            "accuracy": float(hits.mean()),
            "by_gap": accuracy_by_gap(hits, task.gaps(inputs, targets)),
            "cache": measured_cache(model, inputs),
        }
    return out


def stored_request(request: Any) -> Any:
    """A run's stored request with the layer options renamed since it was written spelled as today's
    (``slimkv.common.vocabulary.current_attention_fields``), so a run made before a rename is still its configuration."""
    if isinstance(request, dict) and isinstance(request.get("attention"), dict):
        return {**request, "attention": current_attention_fields(request["attention"])}
    return request


def train_recall(spec: AttentionSpec, recipe: RecallRecipe, seed: int, run_dir: str | Path, *, label: str = "recall", progress: bool = True,
                 stop_after: int | None = None) -> tuple[dict[str, Any], bool]:
    """(result, reused): train ``spec`` on the recall task into ``run_dir`` and evaluate it.

    A run whose ``recall_run.json`` matches the request is reused; one with a checkpoint of the
    same configuration resumes; anything else in the folder is refused (nothing is overwritten).
    FolderBusyError when another process holds the folder."""
    recipe.validate()
    config = model_config(spec, recipe)
    request = {"attention": spec.to_fields(), "recipe": recipe.to_dict(), "seed": seed}
    run_dir = Path(run_dir)
    with folder_lock(run_dir, "recall run"):
        marker = run_dir / RUN_FILE
        if marker.is_file():
            stored = read_json(marker, expect=dict)
            if stored_request(stored.get("request")) == request:
                return stored["result"], True
            raise ValueError(f"{marker} holds a finished run of another configuration; use another --out or remove that run folder yourself")
        resume = has_checkpoint(run_dir)
        if resume and stored_request(read_json(run_dir / RUN_CONFIG, expect=dict)) != request:
            raise ValueError(f"{run_dir} holds a checkpoint of another configuration ({run_dir / RUN_CONFIG}); use another --out")
        if not resume:
            leftovers = sorted(p.name for p in run_dir.iterdir() if p.name not in (RUN_CONFIG, "metrics.jsonl", "summary.json"))
            if leftovers:
                raise ValueError(f"{run_dir} holds files of something else ({', '.join(leftovers)}); use another --out")
            write_json(run_dir / RUN_CONFIG, request)
        torch.manual_seed(seed)
        model = SlimKVForCausalLM(config)
        progress_set = eval_set(recipe.task, min(PROGRESS_SEQUENCES, recipe.eval_sequences), recipe.eval_seed, 1)

        def periodic() -> dict[str, Any]:
            return {"accuracy": float(recall_accuracy(model, *progress_set).mean())}

        trainer = Trainer(recipe, run_dir, model, make_optimizer(model, recipe), RecallBatches(recipe.task, seed, recipe.train_pairs), periodic,
                          model.save_pretrained, {"config": request}, objective=recall_loss, label=label)
        if resume:
            trainer.restore()
        summary = run_loop(trainer, progress=progress, stop_after=stop_after)
        if summary["status"] != "finished":
            return summary, False
        result = {
            "seed": seed,
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_loss": _last_train_loss(run_dir),
            "curve": _curve(run_dir),
            "train_seconds": summary["train_seconds"],
            "threads": summary["threads"],
            "lengths": evaluate_recall(model, recipe),
        }
        write_json(marker, {"request": request, "result": result})
        return result, False


def _records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return [r for r in records if r.get("type") == kind]


def _last_train_loss(run_dir: Path) -> float | None:
    records = _records(run_dir, "train")
    return records[-1]["loss"] if records else None


def _curve(run_dir: Path) -> list[dict[str, float]]:
    """(step, accuracy on the progress set) of the periodic evaluations: when recall formed."""
    return [{"step": r["step"], "accuracy": r["accuracy"]} for r in _records(run_dir, "eval") if math.isfinite(r.get("accuracy", math.nan))]
