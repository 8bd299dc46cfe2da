"""Multi-query associative recall (MQAR, after the Zoology work): sequences of key-value pairs
followed by queries of earlier keys; a model must answer each query with the key's value.

Layout of one sequence of ``seq_len`` tokens (docs/recall.md)::

    position 0          BOS
    1 .. 2N             k_1 v_1 k_2 v_2 ... k_N v_N          the context: N key-value pairs
    2N+1 .. T-1         filler, with Q query slots "k_i v_i" (a key of the context, then its value)

Vocabulary: 0 = BOS, 1 = filler, then ``n_keys`` key ids, then value ids. Keys of one sequence
are distinct; values are drawn independently, so a value never identifies its key. Each query
asks a different pair. A query slot starts at an even offset of the query region; the Q slots
are drawn without replacement with weights ``(s + 1) ** (power_a - 1)`` over slot index s
(``gap="power"``: most queries come soon after the context, with a long tail of far ones) or
uniformly (``gap="uniform"``). ``query_start`` moves the first slot later (a minimum gap).

Targets hold the value id at the position of the query key (whose next-token prediction is the
value) and ``IGNORE`` (-100) elsewhere: only the queried values are trained on and scored.

Every batch is a pure function of ``(seed, step)`` (``slimkv.recall.task.RecallBatches``), so a
run resumes exactly without saving a data position, and the test sets (``eval_set``) are fixed
per length. ``MQARTask`` is one of the two ``slimkv.recall.task.RecallTask`` implementations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from slimkv.common.checks import check_choice, check_float, check_int
from slimkv.recall.task import IGNORE

BOS, FILLER = 0, 1
FIRST_KEY = 2
GAP_KINDS = ("power", "uniform")
MAX_MODEL_VOCAB = 65_536  # token ids of a recall model (vocab_size + haystack_tokens): each is an embedding row and a logit


@dataclass(frozen=True)
class MQARTask:
    """One MQAR task. ``n_queries`` None = one query per pair; ``query_start`` None = right after
    the context. Field names are also the command-line option names (``--n-pairs``)."""

    name: ClassVar[str] = "mqar"
    vocab_size: int = 130
    seq_len: int = 64
    n_pairs: int = 8
    n_queries: int | None = None
    gap: str = "power"
    power_a: float = 0.01
    query_start: int | None = None
    haystack_tokens: int = 0  # > 0: every filler is a random one of this many extra token ids (a diverse haystack)

    @property
    def model_vocab_size(self) -> int:
        """Token ids a model of this task needs: the task's vocabulary and the haystack's ids after it."""
        return self.vocab_size + self.haystack_tokens

    @property
    def n_keys(self) -> int:
        return (self.vocab_size - FIRST_KEY) // 2

    @property
    def first_value(self) -> int:
        return FIRST_KEY + self.n_keys

    @property
    def n_values(self) -> int:
        return self.vocab_size - self.first_value

    @property
    def queries(self) -> int:
        return self.n_pairs if self.n_queries is None else self.n_queries

    @property
    def first_slot(self) -> int:
        return 2 * self.n_pairs + 1 if self.query_start is None else self.query_start

    @property
    def n_slots(self) -> int:
        return (self.seq_len - self.first_slot) // 2

    def validate(self) -> MQARTask:
        """The task itself; ValueError naming the option when it cannot be built."""
        check_int("vocab_size", self.vocab_size, FIRST_KEY + 4)
        check_int("seq_len", self.seq_len, 4)
        check_int("n_pairs", self.n_pairs, 1)
        if self.n_queries is not None:
            check_int("n_queries", self.n_queries, 1, self.n_pairs)
        check_choice("gap", self.gap, GAP_KINDS)
        check_float("power_a", self.power_a, 0.0, 1.0)
        check_int("haystack_tokens", self.haystack_tokens, 0)
        if self.model_vocab_size > MAX_MODEL_VOCAB:
            raise ValueError(f"vocab_size={self.vocab_size} + haystack_tokens={self.haystack_tokens} (--vocab-size, --haystack-tokens) make "
                             f"{self.model_vocab_size} token ids, more than the {MAX_MODEL_VOCAB} a recall model may have (each is an embedding "
                             f"row and a logit); use haystack_tokens <= {max(0, MAX_MODEL_VOCAB - self.vocab_size)} and vocab_size <= {MAX_MODEL_VOCAB}")
        if self.n_keys < self.n_pairs:
            raise ValueError(f"n_pairs={self.n_pairs} needs at least {self.n_pairs} key ids; vocab_size={self.vocab_size} has {self.n_keys} "
                             f"(raise vocab_size to >= {FIRST_KEY + 2 * self.n_pairs})")
        if self.query_start is not None:
            check_int("query_start", self.query_start, 2 * self.n_pairs + 1, self.seq_len - 2)
        if self.n_slots < self.queries:
            raise ValueError(f"seq_len={self.seq_len} leaves {max(0, self.n_slots)} query slots after the context for {self.queries} queries; "
                             f"raise seq_len to >= {self.first_slot + 2 * self.queries}")
        return self

    def scaled(self, factor: int) -> MQARTask:
        """The task ``factor`` times longer with ``factor`` times the pairs and queries: the same
        density, longer gaps (the length-generalisation test)."""
        check_int("length factor", factor, 1)
        return replace(
            self,
            seq_len=self.seq_len * factor,
            n_pairs=self.n_pairs * factor,
            n_queries=None if self.n_queries is None else self.n_queries * factor,
            query_start=None if self.query_start is None else self.query_start * factor,
        ).validate()

    def with_pairs(self, n_pairs: int) -> MQARTask:
        """The task with ``n_pairs`` pairs (a training mixture entry), one query per pair."""
        return replace(self, n_pairs=n_pairs, n_queries=None).validate()

    def for_evaluation(self) -> MQARTask:
        """The task the test sets are drawn from (the same: its tokens are synthetic)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """The task's fields; ``haystack_tokens`` only when set, so runs made before it existed still match."""
        fields = asdict(self)
        if not fields["haystack_tokens"]:
            del fields["haystack_tokens"]
        return {"task": self.name, **fields}

    def make_batch(self, batch: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch, seq_len) int64, drawn from ``rng``."""
        return make_batch(self, batch, rng)

    def gaps(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Key-to-query distance of every answer (``answer_index`` order)."""
        return query_gaps(inputs, targets)


def make_batch(task: MQARTask, batch: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the MQAR task, both (batch, seq_len) int64, drawn from ``rng``."""
    task.validate()
    n, t, q = task.n_pairs, task.seq_len, task.queries
    keys = np.argpartition(rng.random((batch, task.n_keys)), n - 1, axis=1)[:, :n] + FIRST_KEY
    values = rng.integers(0, task.n_values, size=(batch, n)) + task.first_value
    inputs = np.full((batch, t), FILLER, dtype=np.int64)
    inputs[:, 0] = BOS
    inputs[:, 1 : 2 * n + 1 : 2] = keys
    inputs[:, 2 : 2 * n + 2 : 2] = values
    slot = np.arange(task.n_slots, dtype=np.float64)
    weights = np.zeros_like(slot) if task.gap == "uniform" else (task.power_a - 1.0) * np.log1p(slot)
    scores = weights[None, :] + rng.gumbel(size=(batch, task.n_slots))  # Gumbel top-q = sampling without replacement
    slots = np.argpartition(-scores, q - 1, axis=1)[:, :q]
    positions = task.first_slot + 2 * slots
    asked = np.argsort(rng.random((batch, n)), axis=1)[:, :q]
    rows = np.arange(batch)[:, None]
    inputs[rows, positions] = keys[rows, asked]
    inputs[rows, positions + 1] = values[rows, asked]
    targets = np.full((batch, t), IGNORE, dtype=np.int64)
    targets[rows, positions] = values[rows, asked]
    if task.haystack_tokens:
        filler = inputs == FILLER
        inputs[filler] = rng.integers(task.vocab_size, task.model_vocab_size, size=int(filler.sum()))
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def query_gaps(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Key-to-query distance of every scored position, in the order of ``targets != IGNORE``
    (row-major): the query key's position minus its context key's position."""
    rows, positions = torch.nonzero(targets != IGNORE, as_tuple=True)
    queried = inputs[rows, positions]
    odd = inputs[rows, 1::2]  # context keys sit at odd positions; the first match is the context key (queries come later)
    index = torch.argmax((odd == queried[:, None]).int(), dim=1)
    return positions - (1 + 2 * index)
