"""One recall run: train a small model on MQAR (``slimkv.data.recall``) and measure its recall at
the training length and longer, with the live cache it needed (docs/recall.md).

The training reuses the training loop (``slimkv.train.trainer``): AdamW, warmup + cosine, NaN
stop, atomic checkpoints and exact resume, progress bar. The loss is the cross-entropy at the
queried positions only (the logits are computed there only). After training, on fixed test sets:

- accuracy (exact argmax match of the queried values) at ``seq_len`` x each length factor
  (factor f: f times the tokens, pairs and queries, so the key-to-query gaps grow f times),
  overall and per gap bucket (``GAP_EDGES``): capacity failures and learning failures look different;
- the cache measured on the live cache (``model.new_cache(1)``, one test sequence prefilled,
  ``cache.nbytes()``), per token, at every length: bounded-state kinds spread one state over more tokens.

``RecallRecipe`` is the whole recipe; the attention comes from an ``AttentionSpec``, with the
recipe's ``base_options`` (partial RoPE and QK-norm by default: KVM needs a non-full RoPE and
the recall circuit does not form within budget without QK-norm) under the entry's own options.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from slimkv.common.checks import check_int
from slimkv.common.files import folder_lock, read_json, write_json
from slimkv.common.spec import AttentionSpec
from slimkv.data.needle_recall import NeedleTask
from slimkv.data.recall import IGNORE, RecallBatches, RecallTask, answer_accuracy, eval_set, unpack
from slimkv.model import ModelConfig, SlimKVForCausalLM
from slimkv.model.config import MLP_KINDS
from slimkv.train.checkpoint import has_checkpoint
from slimkv.train.config import check_optimizer_settings
from slimkv.train.trainer import Trainer, make_optimizer, run_loop

RUN_FILE = "recall_run.json"  # a finished (trained + evaluated) recall run
RUN_CONFIG = "recall_config.json"
GAP_EDGES = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PROGRESS_SEQUENCES = 128  # the test sequences scored at each periodic evaluation
TASKS = {task.name: task for task in (RecallTask, NeedleTask)}  # what ``--task`` may name
# Sizes a recall run may have (recall models are small; these keep a typo from asking for tens of GB):
MAX_SEQUENCE_TOKENS = 65_536  # one test sequence: seq_len x the largest length factor
MAX_BATCH_TOKENS = 1 << 20  # one training step: batch_size x grad_accum x seq_len
MAX_EVAL_TOKENS = 1 << 24  # one test set: eval_sequences x seq_len
MAX_LAYERS = 256  # layers of a recall model (its parameters are bounded by slimkv.bench.recall.MAX_PARAMETERS once built on the meta device)


def task_from_dict(data: dict[str, Any]) -> Any:
    """A recall task from its ``to_dict()`` (ValueError naming the allowed tasks)."""
    values = dict(data)
    name = values.pop("task", RecallTask.name)
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not allowed; allowed values: {', '.join(TASKS)}")
    layout = values.pop("layout", None)
    if layout is not None and layout != getattr(TASKS[name], "layout", None):
        raise ValueError(f"task {name!r} with layout {layout} was made by another version of slimkv (this one writes layout {TASKS[name].layout})")
    return TASKS[name](**values)


@dataclass
class RecallRecipe:
    """Model shape and training of a recall run (the defaults reach 100% with MHA in ~500 steps).

    ``train_pairs``: step i trains on ``train_pairs[i % len]`` pairs at ``task.seq_len`` (empty:
    the task's own); ``lengths``: the test-length factors; ``eval_sequences``: test sequences at
    1x (``eval_sequences / f`` at f x, at least 32)."""

    task: Any = field(default_factory=RecallTask)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int | None = None
    mlp: str = "swiglu"
    base_options: dict[str, Any] = field(default_factory=lambda: {"rope": "partial", "qk_norm": True})
    train_pairs: tuple[int, ...] = (2, 4, 8, 12)
    steps: int = 1500
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    lengths: tuple[int, ...] = (1, 2, 4)
    eval_sequences: int = 512
    eval_seed: int = 0
    eval_every: int = 250
    log_every: int = 50
    checkpoint_every: int = 500
    grad_accum: int = 1

    @property
    def seq_len(self) -> int:
        return self.task.seq_len

    def validate(self) -> RecallRecipe:
        """The recipe itself (with its task and every scaled task checked); ValueError naming the option."""
        self.task.validate()
        for name in ("d_model", "n_layers", "n_heads", "steps", "batch_size", "eval_sequences", "log_every", "grad_accum"):
            check_int(name, getattr(self, name), 1)
        for name in ("eval_every", "checkpoint_every", "eval_seed"):
            check_int(name, getattr(self, name), 0)
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim, 1)
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp={self.mlp!r} is not allowed; allowed values: {', '.join(MLP_KINDS)}")
        check_optimizer_settings(self)
        if not self.lengths or len(set(self.lengths)) != len(self.lengths) or 1 not in self.lengths:
            raise ValueError(f"lengths must be distinct factors including 1 (e.g. 1,2,4), got {list(self.lengths)}")
        self.check_sizes()
        for factor in self.lengths:
            self.task.scaled(factor)
        RecallBatches(self.task, 0, self.train_pairs)
        return self

    def check_sizes(self) -> None:
        """The tensors a run builds stay within ``MAX_*`` (ValueError naming the options and the limit)."""
        seq_len = self.task.seq_len
        check_int("seq_len", seq_len, 1)
        for factor in self.lengths:
            check_int("length factor", factor, 1)
        limits = [
            (seq_len * max(self.lengths), MAX_SEQUENCE_TOKENS, f"seq_len={seq_len} x the largest length factor {max(self.lengths)} (--seq-len, --lengths)",
             "tokens in one test sequence"),
            (self.batch_size * self.grad_accum * seq_len, MAX_BATCH_TOKENS,
             f"batch_size={self.batch_size} x grad_accum={self.grad_accum} x seq_len={seq_len} (--batch-size, --seq-len)", "tokens in one training step"),
            (self.eval_sequences * seq_len, MAX_EVAL_TOKENS, f"eval_sequences={self.eval_sequences} x seq_len={seq_len} (--eval-sequences, --seq-len)",
             "tokens in the test set"),
        ]
        if self.n_layers > MAX_LAYERS:
            raise ValueError(f"n_layers={self.n_layers} (--n-layers) is more than the {MAX_LAYERS} layers a recall model may have; lower it")
        for value, limit, what, unit in limits:
            if value > limit:
                raise ValueError(f"{what} = {value:,} {unit}, more than the {limit:,} a recall run may have; lower them")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "task": self.task.to_dict(), "betas": list(self.betas), "train_pairs": list(self.train_pairs), "lengths": list(self.lengths)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecallRecipe:
        values = dict(data)
        values["task"] = task_from_dict(values.get("task", {}))
        for name in ("betas", "train_pairs", "lengths"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


def default_recall_recipe(task: str = RecallTask.name) -> RecallRecipe:
    """The recipe a task starts from (ValueError naming the allowed tasks). Needles: 256-token
    documents of prose with 4 needles; documents with 1 to 6 needles are mixed in training."""
    if task == RecallTask.name:
        return RecallRecipe()
    if task == NeedleTask.name:
        return RecallRecipe(task=NeedleTask(), train_pairs=(1, 2, 4, 6), batch_size=32)
    raise ValueError(f"--task {task!r} is not allowed; allowed values: {', '.join(TASKS)}")


def model_config(spec: AttentionSpec, recipe: RecallRecipe) -> ModelConfig:
    """The model of a recall run: the recipe's shape, ``spec``'s attention over the base options."""
    fields = AttentionSpec(spec.kinds, {**recipe.base_options, **spec.shared}, spec.per_kind).to_fields()
    return ModelConfig(vocab_size=recipe.task.model_vocab_size, d_model=recipe.d_model, n_layers=recipe.n_layers, n_heads=recipe.n_heads,
                       head_dim=recipe.head_dim, mlp=recipe.mlp, tie_word_embeddings=True, **fields)


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
    """Per answer (``slimkv.data.recall.answer_index`` order): 1.0 where the argmax is right at
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
            if stored.get("request") == request:
                return stored["result"], True
            raise ValueError(f"{marker} holds a finished run of another configuration; use another --out or remove that run folder yourself")
        resume = has_checkpoint(run_dir)
        if resume and read_json(run_dir / RUN_CONFIG, expect=dict) != request:
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
