"""Needles in prose that a small model can learn to retrieve: the ``needles`` recall task.

A document of ``seq_len`` tokens (docs/recall.md, "Needles in prose")::

    prose lines, with n_pairs needle lines at random line boundaries:
        "The magic number of{key} is {digits}.\\n"
    then every needle asked once, in random order, as the same line with the digits to fill in:
        "The magic number of{key} is " -> the digits are the answer

``key`` is a single-token word of the tokenizer (`` castle``); the value is ``digits`` decimal
digits (one token each in slimkv's byte-level BPE). Only the answer digits are trained on and
scored; an answer is recalled when all its digits are (what greedy decoding would write).

Why this shape, when the RULER-style needles of ``slimkv eval niah`` are not learned by the
small models trained here: one long needle and one question per document give a handful of
scored tokens per sequence, and a 7-digit value is hard to copy. Here every needle is asked,
values are short, and the training mixes documents with fewer needles (``with_pairs``), as the
MQAR recipe does. What remains is retrieval from prose: the needles sit between real lines.

Training documents take their prose from the dataset's train split; test documents
(``for_evaluation``) from the held-out val split. ``scaled(f)`` makes the haystack longer with
the same needles (the NIAH protocol: longer documents, the same question).
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from slimkv.common.checks import check_choice, check_int
from slimkv.common.paths import cache_dir
from slimkv.data.dataset import load_dataset
from slimkv.data.needles import line_end_ids
from slimkv.data.recall import IGNORE

PREFIX = "The magic number of"
SPLITS = ("train", "val")
MIN_KEYS = 2  # n_pairs is checked against the real count


@dataclass(frozen=True)
class NeedleSource:
    """What documents are made of, read once per dataset: the splits, the line ends, the key and
    digit token ids and the fixed pieces of a needle line."""

    splits: dict[str, np.ndarray]
    line_starts: dict[str, np.ndarray]  # per split: positions just after a newline token
    line_ends: np.ndarray
    vocab_size: int
    keys: np.ndarray  # single-token words
    digits: np.ndarray  # ids of "0".."9"
    prefix: list[int]  # "The magic number of"
    end: list[int]  # ".\n"


@functools.lru_cache(maxsize=4)
def _source(name: str, folder: Path) -> NeedleSource:
    dataset = load_dataset(name)
    vocabulary = dataset.tokenizer.get_vocab_size()
    words = [i for i in range(vocabulary) if re.fullmatch(r" [a-z]{4,}", dataset.tokenizer.decode([i], skip_special_tokens=False))]
    digits = [dataset.encode(str(d)) for d in range(10)]
    if len(words) < MIN_KEYS or any(len(d) != 1 for d in digits):
        raise ValueError(f"dataset {name!r}: its tokenizer needs >= {MIN_KEYS} single-token words and one token per digit for the needles task "
                         f"(it has {len(words)} words; digits take {[len(d) for d in digits]} tokens)")
    splits = {"train": np.asarray(dataset.train, dtype=np.int64), "val": np.asarray(dataset.val, dtype=np.int64)}
    line_ends = line_end_ids(dataset.tokenizer)
    return NeedleSource(
        splits=splits,
        line_starts={name: np.flatnonzero(np.isin(ids[:-1], line_ends)) + 1 for name, ids in splits.items()},
        line_ends=line_ends,
        vocab_size=dataset.vocab_size,
        keys=np.asarray(words, dtype=np.int64),
        digits=np.asarray([d[0] for d in digits], dtype=np.int64),
        prefix=dataset.encode(PREFIX),
        end=dataset.encode(".\n"),
    )


def needle_source(dataset: str) -> NeedleSource:
    """The ``NeedleSource`` of a prepared dataset (read once per cache folder and name)."""
    return _source(dataset, cache_dir())


@dataclass(frozen=True)
class NeedleTask:
    """Needles in prose. ``n_pairs`` needles per document (each asked once), ``digits`` per
    value, prose from ``split``. Same methods as ``slimkv.data.recall.RecallTask``."""

    name: ClassVar[str] = "needles"
    layout: ClassVar[int] = 2  # the document layout's version: runs made with another layout are not reused
    dataset: str = "shakespeare"
    seq_len: int = 256
    n_pairs: int = 4
    digits: int = 2
    split: str = "train"

    @property
    def source(self) -> NeedleSource:
        return needle_source(self.dataset)

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    @property
    def needle_tokens(self) -> int:
        source = self.source
        return len(source.prefix) + 1 + self.digits + len(source.end)

    def validate(self) -> NeedleTask:
        check_int("n_pairs", self.n_pairs, 1)
        check_int("digits", self.digits, 1, 9)
        check_int("seq_len", self.seq_len, 2)
        check_choice("split", self.split, SPLITS)
        source = self.source
        if self.n_pairs > len(source.keys):
            raise ValueError(f"n_pairs={self.n_pairs}: the tokenizer of {self.dataset!r} has {len(source.keys)} single-token keys")
        least = 2 * self.n_pairs * self.needle_tokens + 8
        if self.seq_len < least:
            raise ValueError(f"seq_len={self.seq_len} is too short for {self.n_pairs} needles and their questions "
                             f"({self.needle_tokens} tokens each); raise seq_len to >= {least}")
        return self

    def scaled(self, factor: int) -> NeedleTask:
        """A ``factor`` times longer document with the same needles (more prose)."""
        check_int("length factor", factor, 1)
        return replace(self, seq_len=self.seq_len * factor).validate()

    def with_pairs(self, n_pairs: int) -> NeedleTask:
        return replace(self, n_pairs=n_pairs).validate()

    def for_evaluation(self) -> NeedleTask:
        """Test documents take their prose from the held-out split."""
        return replace(self, split="val")

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.name, "layout": self.layout, **asdict(self)}

    def make_batch(self, batch: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch, seq_len) int64; targets hold the answer digits at the
        positions that predict them, ``IGNORE`` elsewhere."""
        self.validate()
        rows = [self._document(rng) for _ in range(batch)]
        return torch.tensor(np.stack([r[0] for r in rows])), torch.tensor(np.stack([r[1] for r in rows]))

    def _document(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        source = self.source
        keys = rng.choice(source.keys, size=self.n_pairs, replace=False)
        values = rng.integers(0, 10, size=(self.n_pairs, self.digits))
        values[:, 0] = rng.integers(1 if self.digits > 1 else 0, 10, size=self.n_pairs)
        head = [source.prefix + [int(k)] for k in keys]
        needles = [h + source.digits[v].tolist() + source.end for h, v in zip(head, values)]
        budget = self.seq_len - 2 * self.n_pairs * self.needle_tokens - 1
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
        for i in rng.permutation(self.n_pairs):
            ids += head[i]
            targets += [IGNORE] * len(head[i])
            for digit in source.digits[values[i]].tolist():
                targets.append(digit)  # the position before a digit predicts it
                ids.append(digit)
            targets += [IGNORE] * len(source.end)
            ids += source.end
        return np.asarray(ids, dtype=np.int64), np.asarray(targets[1:] + [IGNORE], dtype=np.int64)

    def gaps(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per answer: its question's key position minus the needle's key position."""
        source = self.source
        out = []
        for row, flags in enumerate((targets != IGNORE).tolist()):
            tokens = inputs[row].tolist()
            for position, flag in enumerate(flags):
                if flag and not (position > 0 and flags[position - 1]):
                    question = position  # the key predicts the first digit
                    out.append(question - _needle_position(tokens, tokens[question], source.prefix))
        return torch.tensor(out, dtype=torch.int64)


def _needle_position(tokens: list[int], key: int, prefix: list[int]) -> int:
    """Where ``key`` first follows the needle prefix (a key word may also occur in the prose)."""
    width = len(prefix)
    return next(p for p in range(width, len(tokens)) if tokens[p] == key and tokens[p - width : p] == prefix)
