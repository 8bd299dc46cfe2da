"""The one needle generator: RULER-style needles (their lines, keys and values, and where they sit
in a haystack), the needle documents built from them (one needle, one question) and the
training-data needle mixture. ``slimkv train --set needle_mix=...`` mixes these documents into
training, ``slimkv eval niah RUN_DIR`` asks them of trained runs, and the pretrained-model prompts
(``slimkv.retrieval.prompts``) draw their keys, values and needle places here too
(``random_keys``, ``random_value``, ``NeedleBuilder.place``). They are not the needles a small
model learns in ``slimkv eval recall --task needles`` (``slimkv.recall.prose_needles``). It sits
in ``data`` because training reads it.

A needle document is, in token ids::

    haystack[:cut] + needle + haystack[cut:] + question (+ answer, in training documents)

- needle: ``"One of the special magic numbers for {key} is: {value}.\\n"`` with a random word key
  and a 7-digit number (or a UUID) value;
- question: ``"\\nQuestion: What is the special magic number for {key}?\\nAnswer: The special
  magic number for {key} is:"`` so the value is the natural continuation;
- answer (training only): ``" {value}.\\n"``.

The haystack is a contiguous span of token ids from a source (the train split for training
documents; for evaluation whatever the caller chooses: repeated neutral sentences, held-out prose).
It starts at a line start and the needle is inserted at the line boundary closest to the requested
depth (0 = before the first line, 1 = after the last complete one), so the needle is a line of
its own. Lengths are exact: the haystack span is cut to fill ``length`` tokens.

``NeedleMixture`` replaces a fraction of each training batch by such documents built from the
TRAIN split only. Which rows are replaced and what they contain is a pure function of
``(seed, step, row)``, so there is no state to checkpoint and a resumed run sees the same data.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slimkv.common.checks import check_float, check_int

NEEDLE_LINE = "One of the special magic {noun}s for {key} is: {value}.\n"  # {noun}: number, word, uuid (the value's kind)
NEEDLE_TEMPLATE = NEEDLE_LINE.replace("{noun}", "number")  # the needle documents' line: "numbers" whatever the value
PASSKEY_LINE = "The pass key is {value}. Remember it. {value} is the pass key.\n"
QUESTION_TEMPLATE = "\nQuestion: What is the special magic number for {key}?\nAnswer: The special magic number for {key} is:"
ANSWER_TEMPLATE = " {value}.\n"
VALUE_KINDS = ("passkey", "number", "word", "uuid")

# Keys: plain, common English words (none is a special token of any tokenizer), disjoint from VALUE_WORDS.
KEY_WORDS = (
    "apple", "river", "candle", "garden", "window", "silver", "falcon", "harbor", "meadow", "lantern",
    "copper", "violet", "thunder", "pepper", "marble", "orchard", "anchor", "feather", "island", "saddle",
    "blanket", "cabinet", "dolphin", "engine", "forest", "glacier", "hammer", "jacket", "kettle", "ladder",
    "mirror", "needle", "oyster", "pillow", "quarry", "ribbon", "shovel", "tunnel", "velvet", "wagon",
    "yellow", "zebra", "basket", "castle", "desert", "fabric", "goblet", "helmet", "insect", "jungle",
    "kitten", "lemon", "magnet", "napkin", "object", "parrot", "rabbit", "spider", "tomato", "umbrella",
    "valley", "walnut", "bottle", "cotton",
)
PROMPT_KEY_WORDS = 27  # the pretrained-model prompts draw keys from the first 27 only: more would change every prompt of a seed
VALUE_WORDS = (
    "banana", "compass", "dragon", "emerald", "fountain", "giraffe", "horizon", "igloo", "jasmine", "kingdom", "lighthouse", "mountain",
    "notebook", "octopus", "penguin", "quartz", "rainbow", "sapphire", "telescope", "universe", "volcano", "whistle", "xylophone", "yogurt",
)

# The S1 haystack: a few neutral sentences, repeated (written for slimkv).
NEUTRAL_TEXT = "The grass is green and the sky is blue.\nThe sun is warm and the sea is calm.\nHere we go, and there we come back again.\n"


def random_key(rng: np.random.Generator) -> str:
    """A random word from ``KEY_WORDS``."""
    return KEY_WORDS[int(rng.integers(len(KEY_WORDS)))]


def random_keys(rng: np.random.Generator, count: int, pool: int = PROMPT_KEY_WORDS) -> list[str]:
    """``count`` distinct keys: the first of a permutation of the first ``pool`` ``KEY_WORDS``."""
    check_int("pool", pool, count, len(KEY_WORDS))
    return [KEY_WORDS[i] for i in rng.permutation(pool)[:count]]


def random_value(rng: np.random.Generator, kind: str) -> str:
    """A value of ``kind`` from ``rng``: a 5-digit pass key, a 7-digit number (no leading zero),
    a word of ``VALUE_WORDS`` or a version-4 UUID string."""
    if kind == "passkey":
        return str(int(rng.integers(10_000, 100_000)))
    if kind == "number":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    if kind == "word":
        return VALUE_WORDS[int(rng.integers(len(VALUE_WORDS)))]
    if kind == "uuid":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    raise ValueError(f"value kind {kind!r} is not allowed; allowed values: {', '.join(VALUE_KINDS)}")


def random_values(rng: np.random.Generator, kind: str, count: int) -> list[str]:
    """``count`` distinct values of ``kind``, drawn until they differ."""
    if kind == "word":
        check_int("count", count, 0, len(VALUE_WORDS))
    values: list[str] = []
    while len(values) < count:
        value = random_value(rng, kind)
        if value not in values:
            values.append(value)
    return values


def value_found(value: str, output: str) -> bool:
    """Whether ``value`` appears in ``output`` (case-insensitive) as a whole: not as a piece of a
    longer run of letters/digits (``1234567`` is not found in ``12345678``)."""
    pattern = r"(?<![0-9a-z])" + re.escape(value.lower()) + r"(?![0-9a-z])"
    return re.search(pattern, output.lower()) is not None


def line_end_ids(tokenizer: Any) -> np.ndarray:
    """Sorted ids whose text ends with a newline (a line boundary follows them)."""
    vocab = tokenizer.get_vocab_size()
    return np.asarray([i for i in range(vocab) if tokenizer.decode([i], skip_special_tokens=False).endswith("\n")], dtype=np.int64)


@dataclass
class NeedleDocument:
    """One document: ``ids`` (its tokens) with where the needle sits and what it says."""

    ids: list[int]
    key: str
    value: str
    needle_start: int  # index of the needle's first token in ids
    needle_tokens: int
    haystack_tokens: int
    depth: float  # needle_start / haystack_tokens: where the needle actually sits, 0..1
    prompt_tokens: int  # tokens up to and including the question (all of ids for an eval prompt)


class NeedleBuilder:
    """Builds needle documents from one tokenizer; ``encode(text) -> list[int]`` and the
    tokenizer's newline ids come from the dataset that trained (or will train) the model."""

    def __init__(self, encode, line_ends: np.ndarray) -> None:
        self.encode = encode
        self.line_ends = np.asarray(line_ends, dtype=np.int64)
        if self.line_ends.size == 0:
            raise ValueError("the tokenizer has no token ending with a newline; needle documents need line boundaries")

    @classmethod
    def for_dataset(cls, dataset: Any) -> NeedleBuilder:
        """A builder using ``dataset.encode`` and its tokenizer."""
        return cls(dataset.encode, line_end_ids(dataset.tokenizer))

    def pieces(self, key: str, value: str, *, answer: bool) -> tuple[list[int], list[int], list[int]]:
        """Token ids of (needle, question, answer or [])."""
        needle = self.encode(NEEDLE_TEMPLATE.format(key=key, value=value))
        question = self.encode(QUESTION_TEMPLATE.format(key=key))
        tail = self.encode(ANSWER_TEMPLATE.format(value=value)) if answer else []
        return needle, question, tail

    def build(self, source: np.ndarray, start: int, length: int, depth: float, key: str, value: str, *, answer: bool = False) -> NeedleDocument:
        """A document of exactly ``length`` tokens whose haystack is ``source`` from the first line
        start at or after ``start`` (wrapping around the end of ``source``).

        ``source``: 1-D token ids (a split, or the S1 neutral text repeated). ``depth`` in [0, 1].
        With ``answer`` the document ends with the answer (a training document).
        """
        check_float("depth", depth, 0.0, 1.0)
        needle, question, tail = self.pieces(key, value, answer=answer)
        budget = length - len(needle) - len(question) - len(tail)
        if budget < 1:
            raise ValueError(f"length={length} is too short: the needle, question and answer alone take {length - budget} tokens")
        haystack = self.haystack(source, start, budget)
        context, (cut,) = self.place(haystack, [needle], [depth])
        ids = context + question + tail
        return NeedleDocument(
            ids=ids,
            key=key,
            value=value,
            needle_start=cut,
            needle_tokens=len(needle),
            haystack_tokens=budget,
            depth=cut / budget,
            prompt_tokens=length - len(tail),
        )

    def haystack(self, source: np.ndarray, start: int, budget: int) -> np.ndarray:
        """``budget`` tokens of ``source`` from the first line start at or after ``start``."""
        source = np.asarray(source, dtype=np.int64)
        if len(source) < 2:
            raise ValueError("the haystack source is empty")
        start %= len(source)
        ends = np.flatnonzero(np.isin(source[start:], self.line_ends))
        first = start + int(ends[0]) + 1 if ends.size and start > 0 else start
        index = (first + np.arange(budget)) % len(source)  # wrap around a short source
        return source[index]

    def place(self, haystack: np.ndarray, needles: list[list[int]], depths: list[float]) -> tuple[list[int], list[int]]:
        """``haystack`` (1-D ids) with needle i inserted at the line start nearest ``depths[i]``
        (needles at one line start keep their order): (ids, each needle's cut in the haystack)."""
        cuts = [self.boundary_near(haystack, depth) for depth in depths]
        ids, last = [], 0
        for i in sorted(range(len(needles)), key=lambda i: (cuts[i], i)):
            ids += haystack[last : cuts[i]].tolist() + needles[i]
            last = cuts[i]
        return ids + haystack[last:].tolist(), cuts

    def boundary_near(self, haystack: np.ndarray, depth: float) -> int:
        """The line start (0, or an index just after a newline token) closest to
        ``depth * len(haystack)``; ties go to the earlier one. A last line cut short by the length
        is not a boundary: the needle never follows a partial line."""
        boundaries = np.concatenate(([0], np.flatnonzero(np.isin(haystack, self.line_ends)) + 1))
        target = depth * len(haystack)
        return int(boundaries[np.argmin(np.abs(boundaries - target))])


class NeedleMixture:
    """Replace a fraction of training sequences by needle documents made from the TRAIN split.

    Per optimizer step, ``floor(fraction * n)`` rows (one more with probability equal to the
    remainder) of the (n, seq_len + 1) batch are replaced. Everything is drawn from a generator
    seeded by ``(seed, step)`` and ``(seed, step, row)``: deterministic, stateless, resume-exact.
    Values are 7-digit numbers, or UUIDs for a ``uuid_fraction`` of the documents (when one fits).
    """

    def __init__(self, dataset: Any, seq_len: int, fraction: float, seed: int, *, uuid_fraction: float = 0.25) -> None:
        check_float("needle_mix", fraction, 0.0, 1.0)
        check_int("needle_seed", seed, 0)
        check_int("seq_len", seq_len, 1)
        check_float("uuid_fraction", uuid_fraction, 0.0, 1.0)
        self.train = np.asarray(dataset.train, dtype=np.int64)  # the train split only, never val
        self.builder = NeedleBuilder.for_dataset(dataset)
        self.length = seq_len + 1
        longest = max(sum(map(len, self.builder.pieces(key, "9" * 7, answer=True))) for key in KEY_WORDS)
        if self.length <= longest:
            raise ValueError(f"needle_mix needs seq_len >= {longest} with this tokenizer (a needle, question and answer take up to {longest} tokens); got seq_len={seq_len}")
        self.fraction = fraction
        self.seed = seed
        self.uuid_fraction = uuid_fraction

    def rows(self, step: int, n: int) -> list[int]:
        """Which rows of step ``step``'s batch of ``n`` are needle documents (sorted)."""
        rng = np.random.default_rng([self.seed, step])
        exact = self.fraction * n
        count = int(exact) + int(rng.random() < exact - int(exact))
        return sorted(rng.choice(n, size=count, replace=False).tolist())

    def document(self, step: int, row: int) -> NeedleDocument:
        """The needle document of row ``row`` at step ``step`` (``seq_len + 1`` tokens, with answer)."""
        rng = np.random.default_rng([self.seed, step, row, 1])
        kind = "uuid" if rng.random() < self.uuid_fraction else "number"
        key, value = random_key(rng), random_value(rng, kind)
        start, depth = int(rng.integers(len(self.train))), float(rng.random())
        try:
            return self.builder.build(self.train, start, self.length, depth, key, value, answer=True)
        except ValueError:  # a UUID does not fit a very short sequence: use a number instead
            value = random_value(rng, "number")
            return self.builder.build(self.train, start, self.length, depth, key, value, answer=True)

    def apply(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        """``batch`` (n, seq_len + 1) with the chosen rows replaced (a new tensor; same dtype/device)."""
        if batch.shape[-1] != self.length:
            raise ValueError(f"batch rows have {batch.shape[-1]} tokens, the mixture builds {self.length}")
        rows = self.rows(step, batch.shape[0])
        if not rows:
            return batch
        out = batch.clone()
        for row in rows:
            out[row] = torch.tensor(self.document(step, row).ids, dtype=batch.dtype, device=batch.device)
        return out
