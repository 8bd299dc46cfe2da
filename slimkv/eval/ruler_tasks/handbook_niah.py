"""lm-eval's essay-haystack RULER tasks on a local haystack (the ``*_handbook.yaml`` tasks here).

lm-eval 0.4.13's ``niah_single_2``, ``niah_single_3``, ``niah_multikey_1``, ``niah_multivalue`` and
``niah_multiquery`` hide their needles in Paul Graham's essays, which it downloads from the hub.
These tasks call the same generator (``prepare_niah.generate_samples``: its needles, depths, seed,
template and sizing) with the same needle settings, over the text of a local file instead: slimkv
passes the held-out pages of the Debian Administrator's Handbook (``handbook-val``, never
calibration text) as ``haystack_file`` in the task metadata. Scoring is lm-eval's own
(``common_utils.process_results``). One difference, named here and in docs/ruler.md: lm-eval
splits the essay into sentences with nltk's pretrained Punkt model (``punkt_tab``, a download);
these tasks split with nltk's Punkt algorithm trained on the haystack itself.

lm-eval imports this file by its path (``!function``) in slimkv's environment and in kvpress's, so it
imports lm-eval, nltk and the standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lm_eval.tasks.ruler import prepare_niah
from lm_eval.tasks.ruler.common_utils import (
    DEFAULT_SEQ_LENGTHS,
    aggregate_metrics,
    get_tokenizer,
    process_results,
    resolve_tokenizer_name,
)
from lm_eval.tasks.ruler.niah_utils import TEMPLATE, download_dataset
from nltk.tokenize.punkt import PunktSentenceTokenizer

__all__ = ["aggregate_metrics", "process_results", "niah_single_2_handbook", "niah_single_3_handbook", "niah_multikey_1_handbook",
           "niah_multivalue_handbook", "niah_multiquery_handbook"]

SAMPLES = 500  # prompts per length, as lm-eval's tasks generate


def haystack_words(path: str) -> list[str]:
    """The haystack file's words, whitespace collapsed as lm-eval does for its essays."""
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"the local-haystack RULER tasks need metadata haystack_file naming a text file; got {path!r}")
    return re.sub(r"\s+", " ", Path(path).read_text(encoding="utf-8")).strip().split(" ")


def essay_samples(kwargs: dict[str, Any], **needles: Any) -> dict[str, Any]:
    """lm-eval's essay-haystack samples of every requested length, ``needles`` as its task sets them,
    over ``kwargs['haystack_file']``'s words, sentences split by Punkt trained on that text."""
    seq_lengths = kwargs.pop("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    words = haystack_words(kwargs.pop("haystack_file", ""))
    tokenizer = get_tokenizer(resolve_tokenizer_name(kwargs))
    splitter = PunktSentenceTokenizer(" ".join(words))
    pretrained = prepare_niah.sent_tokenize
    prepare_niah.sent_tokenize = splitter.tokenize
    prepare_niah.cached_sent_tokenize.cache_clear()
    try:
        rows = [prepare_niah.generate_samples(words, max_seq_length=length, template=TEMPLATE, type_haystack="essay", num_samples=SAMPLES,
                                              TOKENIZER=tokenizer, **needles) for length in seq_lengths]
    finally:
        prepare_niah.sent_tokenize = pretrained
        prepare_niah.cached_sent_tokenize.cache_clear()
    return download_dataset(rows)


def niah_single_2_handbook(**kwargs: Any) -> dict[str, Any]:
    """niah_single_2: one word key, one 7-digit number."""
    return essay_samples(kwargs, type_needle_k="words", type_needle_v="numbers")


def niah_single_3_handbook(**kwargs: Any) -> dict[str, Any]:
    """niah_single_3: one word key, one UUID."""
    return essay_samples(kwargs, type_needle_k="words", type_needle_v="uuids")


def niah_multikey_1_handbook(**kwargs: Any) -> dict[str, Any]:
    """niah_multikey_1: four word keys, the value of one asked."""
    return essay_samples(kwargs, type_needle_k="words", type_needle_v="numbers", num_needle_k=4)


def niah_multivalue_handbook(**kwargs: Any) -> dict[str, Any]:
    """niah_multivalue: one key with four numbers, all asked."""
    return essay_samples(kwargs, type_needle_k="words", type_needle_v="numbers", num_needle_v=4)


def niah_multiquery_handbook(**kwargs: Any) -> dict[str, Any]:
    """niah_multiquery: four keys, all four values asked."""
    return essay_samples(kwargs, type_needle_k="words", type_needle_v="numbers", num_needle_q=4)
