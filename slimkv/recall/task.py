"""What a learned recall task is (the ``RecallTask`` protocol) and what every task shares: the
scoring convention, answers, fixed test sets and stateless training batches.

A recall task makes sequences whose *targets* hold the tokens a model must recall at the
positions that predict them and ``IGNORE`` (-100) everywhere else: only those tokens are trained
on and scored. An *answer* is a run of consecutive scored positions of one row (one token for
MQAR, the digits of a value for the prose needles); it counts as recalled when all its tokens are
(what greedy decoding would write). Two tasks implement the protocol:
``slimkv.recall.mqar.MQARTask`` (synthetic key-value pairs) and
``slimkv.recall.prose_needles.ProseNeedleTask`` (needles in prose); ``slimkv.recall.registry``
names them for ``--task`` and for the ``to_dict()`` records in run folders and reports.

The protocol is what the recipe, the run and the sweep use of a task, so a third task is one
frozen dataclass with these members and one line in the registry.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import numpy as np
import torch

IGNORE = -100
EVAL_STREAM = 7_919  # keeps test sets apart from every training stream (those are keyed by (seed, step))


class RecallTask(Protocol):
    """A learned recall task: a frozen dataclass whose fields are its options (and the
    command-line option names, ``n_pairs`` -> ``--n-pairs``)."""

    name: ClassVar[str]  # the ``--task`` name and the "task" of ``to_dict()``

    @property
    def seq_len(self) -> int:
        """Tokens per sequence (the training length)."""

    @property
    def n_pairs(self) -> int:
        """Key-value pairs (needles) per sequence."""

    @property
    def model_vocab_size(self) -> int:
        """Token ids a model of this task needs (its embedding rows and logits)."""

    def validate(self) -> RecallTask:
        """The task itself; ValueError naming the option when it cannot be built."""

    def scaled(self, factor: int) -> RecallTask:
        """The task at ``factor`` times the length (the length-generalisation test), validated."""

    def with_pairs(self, n_pairs: int) -> RecallTask:
        """The task with ``n_pairs`` pairs (an entry of the training mixture), validated."""

    def for_evaluation(self) -> RecallTask:
        """The task the fixed test sets are drawn from."""

    def to_dict(self) -> dict[str, Any]:
        """``{"task": name, **fields}``: what run folders and reports record (read by ``registry.task_from_dict``)."""

    def make_batch(self, batch: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch, seq_len) int64, drawn from ``rng``."""

    def gaps(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Key-to-question distance of every answer (``answer_index`` order)."""


def answer_index(targets: torch.Tensor) -> torch.Tensor:
    """For every scored position (order of ``targets != IGNORE``), the index of its answer: runs
    of consecutive scored positions in one row are one answer."""
    scored = targets != IGNORE
    starts = scored & ~torch.nn.functional.pad(scored[:, :-1], (1, 0), value=False)
    return torch.cumsum(starts.flatten(), 0)[scored.flatten()] - 1


def answer_accuracy(correct: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per answer, 1.0 when every one of its tokens is correct (``correct``: per scored position)."""
    index = answer_index(targets)
    wrong = torch.zeros(int(index.max()) + 1 if index.numel() else 0).index_add_(0, index, (~correct.bool()).float())
    return (wrong == 0).float()


def eval_set(task: RecallTask, sequences: int, seed: int = 0, factor: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed test set of ``task`` (already scaled by ``factor``), the same for every model."""
    return task.for_evaluation().make_batch(sequences, np.random.default_rng([EVAL_STREAM, seed, factor]))


class RecallBatches:
    """Training batches (a ``BatchSource`` of the training loop): step ``step`` draws from
    ``(seed, step)`` with ``n_pairs = train_pairs[step % len(train_pairs)]`` (a mixture of
    easier and harder sequences of the same length), packed as (n, 2 seq_len): inputs, then
    targets. Every batch is a pure function of ``(seed, step)``, so a run resumes exactly
    without saving a data position."""

    def __init__(self, task: RecallTask, seed: int, train_pairs: tuple[int, ...] = ()) -> None:
        self.tasks = [task.with_pairs(p) for p in train_pairs] or [task.validate()]
        self.seed = seed

    def sample(self, step: int, n: int) -> torch.Tensor:
        task = self.tasks[step % len(self.tasks)]
        inputs, targets = task.make_batch(n, np.random.default_rng([self.seed, step]))
        return torch.cat([inputs, targets], dim=1)

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore: batches depend on (seed, step) only."""


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a ``RecallBatches`` batch (n, 2 seq_len)."""
    half = packed.shape[-1] // 2
    return packed[..., :half], packed[..., half:]
