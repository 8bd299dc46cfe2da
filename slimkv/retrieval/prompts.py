"""Long-context retrieval prompts for pretrained models (RULER-style; ``slimkv eval niah --model``;
docs/evaluation.md, "Long-context retrieval on pretrained models"). Needle lines, line
boundaries and values come from the training needles' ``slimkv.data.ruler_needles.NeedleBuilder``.

A prompt is plain text, no chat template, cut to exactly ``length`` tokens of the model's own
tokenizer::

    preamble + haystack with needle lines + question        (context_ids + question_ids)

The question ends where the answer should begin (``"... The pass key is"``), so a model that
remembers continues with the value. The haystack is filler text repeated (``passkey``) or prose
(the held-out plays by default); needle lines sit at the line boundary nearest their depth, so a
needle is always a line of its own. What each task asks is a ``RetrievalTask`` in ``TASKS``; the
needles themselves (their lines, keys, values and places) come from the one needle generator,
``slimkv.data.ruler_needles``.

Everything random (keys, values, the haystack's start, the other needles' depths) is drawn from
``(seed, task, length, sample)``: across depths only the asked needle's place changes, and the
same arguments give the same prompts on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from slimkv.common.checks import check_float, check_int
from slimkv.data.ruler_needles import (
    NEEDLE_LINE,
    PASSKEY_LINE,
    NeedleBuilder,
    line_end_ids,
    random_keys,
    random_value,
    random_values,
)
from slimkv.retrieval.grid import parse_tasks as grid_tasks

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
PREAMBLE = "Some special magic {noun}s are hidden within the following text. Make sure to memorize them. I will quiz you about the {noun}s afterwards.\n"
QUESTION_ONE = "\nWhat is the special magic {noun} for {key} mentioned in the provided text? The special magic {noun} for {key} mentioned in the provided text is"
QUESTION_ALL = "\nWhat are all the special magic {noun}s for {key} mentioned in the provided text? The special magic {noun}s for {key} mentioned in the provided text are"


@dataclass(frozen=True)
class RetrievalTask:
    """One retrieval task: where the needles hide and what is asked.

    ``haystack``: ``"filler"`` (``PASSKEY_FILLER`` repeated) or ``"prose"`` (the ``--haystack``
    text). ``value``: a value kind of ``slimkv.data.ruler_needles.random_value``. ``needles``: needle lines in the haystack; ``asked``:
    ``"one"`` (the first needle's key is asked; the others are distractors with other keys) or
    ``"all"`` (every needle shares one key and all values are asked). The first needle sits at
    the cell's depth, the others at depths drawn from the sample's generator."""

    name: str
    description: str
    haystack: str
    value: str
    needles: int = 1
    asked: str = "one"

    @property
    def noun(self) -> str:
        return {"passkey": "pass key", "number": "number", "word": "word", "uuid": "uuid"}[self.value]


TASKS: dict[str, RetrievalTask] = {
    task.name: task
    for task in (
        RetrievalTask("passkey", "a 5-digit pass key in repeated filler sentences", "filler", "passkey"),
        RetrievalTask("needle-number", "one 7-digit magic number in prose", "prose", "number"),
        RetrievalTask("needle-word", "one magic word in prose", "prose", "word"),
        RetrievalTask("needle-uuid", "one magic UUID in prose", "prose", "uuid"),
        RetrievalTask("multikey", "4 magic numbers under 4 keys in prose; one key asked", "prose", "number", needles=4),
        RetrievalTask("multivalue", "4 magic numbers under one key in prose; all asked (score: the fraction found)", "prose", "number", needles=4, asked="all"),
    )
}


@dataclass
class RetrievalPrompt:
    """One prompt: ``context_ids`` (preamble + haystack with needles) then ``question_ids``;
    ``answers`` are the values a correct continuation contains."""

    id: str
    task: str
    length: int
    depth: float
    sample: int
    context_ids: list[int]
    question_ids: list[int]
    answers: list[str]
    depth_actual: float  # where the asked needle starts, as a fraction of the haystack
    max_new_tokens: int

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "task": self.task, "length": self.length, "depth": self.depth, "sample": self.sample, "context_ids": self.context_ids,
                "question_ids": self.question_ids, "answers": self.answers, "depth_actual": self.depth_actual, "max_new_tokens": self.max_new_tokens}


class PromptBuilder:
    """Builds ``RetrievalPrompt``s with one transformers tokenizer over two haystack sources:
    ``filler`` and ``prose`` (1-D token ids each). Haystack spans and line boundaries are the
    training needles' (``slimkv.data.ruler_needles.NeedleBuilder``)."""

    def __init__(self, tokenizer: Any, prose: str) -> None:
        self.tokenizer = tokenizer
        self.lines = NeedleBuilder(self.encode, line_end_ids(tokenizer.backend_tokenizer))
        self.sources = {"filler": np.asarray(self.encode(PASSKEY_FILLER * 64), dtype=np.int64), "prose": np.asarray(self.encode(prose), dtype=np.int64)}
        if len(self.sources["prose"]) < 2:
            raise ValueError("the prose haystack text has no tokens")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def pieces(self, task: RetrievalTask, rng: np.random.Generator) -> tuple[list[int], list[list[int]], list[int], list[str]]:
        """(preamble ids, needle ids per needle, question ids, answers) of one sample."""
        if task.value == "passkey":
            value = random_value(rng, "passkey")
            needle = self.encode(PASSKEY_LINE.format(value=value))
            return self.encode("There is a pass key hidden in the following text. Find it and memorize it.\n"), [needle], self.encode("\nWhat is the pass key? The pass key is"), [value]
        keys = random_keys(rng, task.needles)
        values = random_values(rng, task.value, task.needles)
        if task.asked == "all":
            keys = [keys[0]] * task.needles
        needles = [self.encode(NEEDLE_LINE.format(noun=task.noun, key=key, value=value)) for key, value in zip(keys, values)]
        question = (QUESTION_ALL if task.asked == "all" else QUESTION_ONE).format(noun=task.noun, key=keys[0])
        answers = values if task.asked == "all" else values[:1]
        return self.encode(PREAMBLE.format(noun=task.noun)), needles, self.encode(question), answers

    def build(self, task: RetrievalTask, length: int, depth: float, sample: int, seed: int) -> RetrievalPrompt:
        """The prompt of one (task, length, depth, sample) cell entry: exactly ``length`` tokens."""
        check_int("length", length, 1)
        check_float("depth", depth, 0.0, 1.0)
        rng = np.random.default_rng([seed, list(TASKS).index(task.name), length, sample])
        preamble, needles, question, answers = self.pieces(task, rng)
        other_depths = rng.random(len(needles) - 1).tolist()
        start = int(rng.integers(len(self.sources[task.haystack])))
        budget = length - len(preamble) - sum(map(len, needles)) - len(question)
        if budget < 1:
            raise ValueError(f"--lengths {length} is too short for task {task.name}: its preamble, needles and question alone take {length - budget} tokens")
        haystack = self.lines.haystack(self.sources[task.haystack], start, budget)
        if depth > 0 and not np.isin(haystack, self.lines.line_ends).any():
            raise ValueError(f"--haystack: the {len(haystack)}-token haystack of a {length}-token {task.name} prompt holds no line break, and needles sit "
                             f"at line starts: every depth would be 0; give a --haystack text with lines")
        placed, cuts = self.lines.place(haystack, needles, [depth, *other_depths])
        context = list(preamble) + placed
        new_tokens = len(self.encode(" " + ", ".join(answers))) + 8
        return RetrievalPrompt(f"{task.name}/{length}/{depth:.2f}/{sample}", task.name, length, depth, sample, context, question, answers,
                               depth_actual=cuts[0] / budget, max_new_tokens=new_tokens)


def parse_tasks(text: str) -> list[RetrievalTask]:
    """``"passkey,multikey"`` -> tasks; ``all`` = every task (``grid.parse_tasks``: errors name the option and the choices)."""
    return [TASKS[name] for name in grid_tasks(text, TASKS)]
