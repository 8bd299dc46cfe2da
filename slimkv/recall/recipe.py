"""The recipe of a recall run (``RecallRecipe``): the task, the model's shape and the training,
one record for every entry of a sweep so that only the attention changes between them
(docs/recall.md). ``default_recall_recipe`` is where each task starts; ``model_config`` builds
the model of a recipe and an attention entry.

The attention comes from an ``AttentionSpec``, with the recipe's ``base_options`` (partial RoPE
and QK-norm by default: KVM needs a non-full RoPE and the recall circuit does not form within
budget without QK-norm) under the entry's own options. ``MAX_*`` bound the tensors a recipe may
ask for: recall models are small, and a typo should fail before it allocates tens of GB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slimkv.common.checks import check_int
from slimkv.common.spec import AttentionSpec
from slimkv.model import ModelConfig
from slimkv.model.config import MLP_KINDS
from slimkv.recall.mqar import MQARTask
from slimkv.recall.prose_needles import ProseNeedleTask
from slimkv.recall.registry import TASKS, task_from_dict
from slimkv.recall.task import RecallBatches, RecallTask
from slimkv.train.config import check_optimizer_settings

# Sizes a recall run may have (recall models are small; these keep a typo from asking for tens of GB):
MAX_SEQUENCE_TOKENS = 65_536  # one test sequence: seq_len x the largest length factor
MAX_BATCH_TOKENS = 1 << 20  # one training step: batch_size x grad_accum x seq_len
MAX_EVAL_TOKENS = 1 << 24  # one test set: eval_sequences x seq_len
MAX_LAYERS = 256  # layers of a recall model (its parameters are bounded by slimkv.recall.frontier.MAX_PARAMETERS once built on the meta device)


@dataclass
class RecallRecipe:
    """Model shape and training of a recall run (the defaults reach 100% with MHA in ~500 steps).

    ``train_pairs``: step i trains on ``train_pairs[i % len]`` pairs at ``task.seq_len`` (empty:
    the task's own); ``lengths``: the test-length factors; ``eval_sequences``: test sequences at
    1x (``eval_sequences / f`` at f x, at least 32)."""

    task: RecallTask = field(default_factory=MQARTask)
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


def default_recall_recipe(task: str = MQARTask.name) -> RecallRecipe:
    """The recipe a task starts from (ValueError naming the allowed tasks). Needles: 256-token
    documents of prose with 4 needles; documents with 1 to 6 needles are mixed in training."""
    if task == MQARTask.name:
        return RecallRecipe()
    if task == ProseNeedleTask.name:
        return RecallRecipe(task=ProseNeedleTask(), train_pairs=(1, 2, 4, 6), batch_size=32)
    raise ValueError(f"--task {task!r} is not allowed; allowed values: {', '.join(TASKS)}")


def model_config(spec: AttentionSpec, recipe: RecallRecipe) -> ModelConfig:
    """The model of a recall run: the recipe's shape, ``spec``'s attention over the base options."""
    fields = AttentionSpec(spec.kinds, {**recipe.base_options, **spec.shared}, spec.per_kind).to_fields()
    return ModelConfig(vocab_size=recipe.task.model_vocab_size, d_model=recipe.d_model, n_layers=recipe.n_layers, n_heads=recipe.n_heads,
                       head_dim=recipe.head_dim, mlp=recipe.mlp, tie_word_embeddings=True, **fields)
