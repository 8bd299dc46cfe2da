"""Needles in prose that a small model can learn to retrieve: the ``needles`` recall task
(``ProseNeedleTask``; not the RULER-style needles of ``slimkv.data.ruler_needles``).

A document of ``seq_len`` tokens (docs/recall.md, "Needles in prose")::

    prose lines, with n_pairs needle lines at random line boundaries:
        "The magic word of{key}{value}.\n"             e.g. "The magic word of enem rans."
    then every needle asked once, in random order, as the same line with the value to fill in:
        "The magic word of{key}" -> the value is the answer

``key`` and ``value`` are single-token words of the tokenizer, from two disjoint sets of the
words rarest in the training prose (a key that also occurs in the prose is a distractor). With
``values="digits"`` the value is ``digits`` decimal digits instead ("The magic number of
enem42."), one token each. The value follows its key directly and a question ends on its key,
so the answer is found by looking up the one earlier occurrence of the current token: with a
separator (" is ") every needle would end in the same tokens and the lookup would need the token
two back, which small models did not learn within budget; a second digit needs the same.
Only the answer tokens are trained on and scored; an answer is recalled when all its tokens are
(what greedy decoding would write).

Why this shape, when the RULER-style needles of ``slimkv eval niah`` are not learned by the
small models trained here: one long needle and one question per document give a handful of
scored tokens per sequence, and a 7-digit value is hard to copy. Here every needle is asked,
values are one token, and the training mixes documents with fewer needles (``with_pairs``), as
the MQAR recipe does. What remains is retrieval from prose: the needles sit between real lines.

Training documents take their prose from the dataset's train split; test documents
(``for_evaluation``) from the held-out val split. ``scaled(f)`` makes the haystack longer with
the same needles (the NIAH protocol: longer documents, the same question).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from slimkv.common.checks import check_choice, check_int
from slimkv.common.paths import cache_dir
from slimkv.data.dataset import load_dataset
from slimkv.data.ruler_needles import line_end_ids
from slimkv.recall.task import IGNORE

PREFIXES = {"words": "The magic word of", "digits": "The magic number of"}
VALUE_KINDS = tuple(PREFIXES)
NEEDLE_PREFIXES = ("sentence", "none")  # "none": a needle line is just key, value, ".\n" (and a question just the key)
SPLITS = ("train", "val")
MIN_WORDS = 4  # keys and values are checked against the real count


@dataclass(frozen=True)
class NeedleSource:
    """What documents are made of, read once per dataset: the splits, the line ends, the key and
    digit token ids and the fixed pieces of a needle line."""

    splits: dict[str, np.ndarray]
    line_starts: dict[str, np.ndarray]  # per split: positions just after a newline token
    line_ends: np.ndarray
    vocab_size: int
    words: np.ndarray  # single-token words, rarest in the train split first
    digits: np.ndarray  # ids of "0".."9"
    prefixes: dict[str, list[int]]  # PREFIXES, tokenized
    end: list[int]  # ".\n"


@functools.lru_cache(maxsize=4)
def _source(name: str, folder: Path) -> NeedleSource:
    dataset = load_dataset(name)
    vocabulary = dataset.tokenizer.get_vocab_size()
    words = [i for i in range(vocabulary) if re.fullmatch(r" [a-z]{4,}", dataset.tokenizer.decode([i], skip_special_tokens=False))]
    digits = [dataset.encode(str(d)) for d in range(10)]
    if len(words) < MIN_WORDS or any(len(d) != 1 for d in digits):
        raise ValueError(f"dataset {name!r}: its tokenizer needs >= {MIN_WORDS} single-token words and one token per digit for the needles task "
                         f"(it has {len(words)} words; digits take {[len(d) for d in digits]} tokens)")
    splits = {"train": np.asarray(dataset.train, dtype=np.int64), "val": np.asarray(dataset.val, dtype=np.int64)}
    counts = np.bincount(splits["train"], minlength=vocabulary)
    words = sorted(words, key=lambda i: (counts[i], i))  # rare words first: a key should rarely occur in the prose
    line_ends = line_end_ids(dataset.tokenizer)
    return NeedleSource(
        splits=splits,
        line_starts={name: np.flatnonzero(np.isin(ids[:-1], line_ends)) + 1 for name, ids in splits.items()},
        line_ends=line_ends,
        vocab_size=dataset.vocab_size,
        words=np.asarray(words, dtype=np.int64),
        digits=np.asarray([d[0] for d in digits], dtype=np.int64),
        prefixes={kind: dataset.encode(text) for kind, text in PREFIXES.items()},
        end=dataset.encode(".\n"),
    )


def needle_source(dataset: str) -> NeedleSource:
    """The ``NeedleSource`` of a prepared dataset (read once per cache folder and name)."""
    return _source(dataset, cache_dir())


@dataclass(frozen=True)
class ProseNeedleTask:
    """Needles in prose. ``n_pairs`` needles per document (each asked once); keys drawn from the
    ``keys`` single-token words rarest in the train split, values from the next ``value_words``
    (``values="words"``) or ``digits`` decimal digits (``values="digits"``); prose from
    ``split``. ``n_queries`` (default: every needle) asks only that many of them, so that the
    last answer cannot be inferred by elimination. ``needle_prefix="none"`` drops the sentence
    before each key: a needle line is the key, its value and ".\n", a question the key alone.
    A ``slimkv.recall.task.RecallTask``."""

    name: ClassVar[str] = "needles"
    layout: ClassVar[int] = 5  # the document layout's version: runs made with another layout are not reused
    dataset: str = "shakespeare"
    seq_len: int = 256
    n_pairs: int = 4
    n_queries: int | None = None
    values: str = "words"
    keys: int = 64
    value_words: int = 64
    digits: int = 2
    split: str = "train"
    needle_prefix: str = "sentence"

    @property
    def source(self) -> NeedleSource:
        return needle_source(self.dataset)

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    @property
    def model_vocab_size(self) -> int:
        """Token ids a model of this task needs: the tokenizer's vocabulary."""
        return self.vocab_size

    @property
    def queries(self) -> int:
        return self.n_pairs if self.n_queries is None else min(self.n_queries, self.n_pairs)

    @property
    def prefix(self) -> list[int]:
        """The tokens before each key in a needle and a question (none with ``needle_prefix="none"``)."""
        return self.source.prefixes[self.values] if self.needle_prefix == "sentence" else []

    @property
    def answer_tokens(self) -> int:
        return 1 if self.values == "words" else self.digits

    @property
    def needle_tokens(self) -> int:
        return len(self.prefix) + 1 + self.answer_tokens + len(self.source.end)

    def validate(self) -> ProseNeedleTask:
        check_int("n_pairs", self.n_pairs, 1)
        if self.n_queries is not None:
            check_int("n_queries", self.n_queries, 1)
        check_int("digits", self.digits, 1, 9)
        check_int("seq_len", self.seq_len, 2)
        check_choice("values", self.values, VALUE_KINDS)
        check_choice("needle_prefix", self.needle_prefix, NEEDLE_PREFIXES)
        check_choice("split", self.split, SPLITS)
        source = self.source
        check_int("keys", self.keys, self.n_pairs)
        check_int("value_words", self.value_words, 2)
        used = self.keys + (self.value_words if self.values == "words" else 0)
        if used > len(source.words):
            raise ValueError(f"keys={self.keys}" + (f" + value_words={self.value_words}" if self.values == "words" else "")
                             + f" need {used} single-token words; the tokenizer of {self.dataset!r} has {len(source.words)}")
        least = (self.n_pairs + self.queries) * self.needle_tokens + 8
        if self.seq_len < least:
            raise ValueError(f"seq_len={self.seq_len} is too short for {self.n_pairs} needles and their questions "
                             f"({self.needle_tokens} tokens each); raise seq_len to >= {least}")
        return self

    def scaled(self, factor: int) -> ProseNeedleTask:
        """A ``factor`` times longer document with the same needles (more prose)."""
        check_int("length factor", factor, 1)
        return replace(self, seq_len=self.seq_len * factor).validate()

    def with_pairs(self, n_pairs: int) -> ProseNeedleTask:
        return replace(self, n_pairs=n_pairs).validate()

    def for_evaluation(self) -> ProseNeedleTask:
        """Test documents take their prose from the held-out split."""
        return replace(self, split="val")

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.name, "layout": self.layout, **asdict(self)}

    def make_batch(self, batch: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch, seq_len) int64; targets hold the answer tokens at the
        positions that predict them, ``IGNORE`` elsewhere."""
        self.validate()
        rows = [self._document(rng) for _ in range(batch)]
        return torch.tensor(np.stack([r[0] for r in rows])), torch.tensor(np.stack([r[1] for r in rows]))

    def _document(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        source = self.source
        keys = rng.choice(source.words[: self.keys], size=self.n_pairs, replace=False)
        if self.values == "words":
            answers = source.words[self.keys : self.keys + self.value_words][rng.integers(0, self.value_words, size=(self.n_pairs, 1))]
        else:
            digits = rng.integers(0, 10, size=(self.n_pairs, self.digits))
            digits[:, 0] = rng.integers(1 if self.digits > 1 else 0, 10, size=self.n_pairs)
            answers = source.digits[digits]
        head = [self.prefix + [int(k)] for k in keys]
        needles = [h + a.tolist() + source.end for h, a in zip(head, answers)]
        budget = self.seq_len - (self.n_pairs + self.queries) * self.needle_tokens - 1
        prose, starts = source.splits[self.split], source.line_starts[self.split]
        first = int(starts[rng.integers(len(starts))]) if len(starts) else 0
        haystack = prose[(first + np.arange(budget)) % len(prose)]  # from a line start; wraps around a short split
        boundaries = np.concatenate(([0], np.flatnonzero(np.isin(haystack, source.line_ends)) + 1))
        cuts = np.sort(rng.choice(boundaries, size=self.n_pairs, replace=len(boundaries) < self.n_pairs))
        ids: list[int] = []
        start = 0
        for cut, needle in zip(cuts, needles):
            ids += haystack[start:cut].tolist() + needle
            start = cut
        ids += haystack[start:].tolist() + source.end[-1:]  # the questions start on a line of their own
        targets = [IGNORE] * len(ids)
        for i in rng.permutation(self.n_pairs)[: self.queries]:
            ids += head[i]
            targets += [IGNORE] * len(head[i])
            for token in answers[i].tolist():
                targets.append(token)  # shifted below: the position before an answer token predicts it
                ids.append(token)
            targets += [IGNORE] * len(source.end)
            ids += source.end
        return np.asarray(ids, dtype=np.int64), np.asarray(targets[1:] + [IGNORE], dtype=np.int64)

    def gaps(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per answer: its question's key position minus the needle's key position."""
        out, line_ends = [], set(self.source.line_ends.tolist())
        for row, flags in enumerate((targets != IGNORE).tolist()):
            tokens = inputs[row].tolist()
            for position, flag in enumerate(flags):
                if flag and not (position > 0 and flags[position - 1]):
                    question = position  # the key predicts the answer's first token
                    out.append(question - _needle_position(tokens, tokens[question], self.prefix, line_ends))
        return torch.tensor(out, dtype=torch.int64)


def _needle_position(tokens: list[int], key: int, prefix: list[int], line_ends: Collection[int]) -> int:
    """Where ``key`` first follows the needle prefix (a key word may also occur in the prose);
    without a prefix, where it first starts a line (needles sit at line boundaries)."""
    width = len(prefix)
    if width == 0:
        return next(p for p in range(len(tokens)) if tokens[p] == key and (p == 0 or tokens[p - 1] in line_ends))
    return next(p for p in range(width, len(tokens)) if tokens[p] == key and tokens[p - width : p] == prefix)
