"""Text sources for calibration and evaluation (never overlapping), and calibration windows.

``shakespeare`` is the text of the training plays (calibration), ``shakespeare-val`` the text of
the held-out plays (evaluation), ``austen`` Jane Austen's novels (out-of-domain evaluation,
``slimkv.data.austen``), ``kjv``, ``devil``, ``pydoc`` and ``handbook`` Debian-packaged texts
(``slimkv.data.corpora``: calibration reads their "train" split; as ``--text`` the whole text),
``kjv-val``, ``devil-val``, ``pydoc-val`` and ``handbook-val`` their held-out documents
(evaluation only: no calibration or healing mix reads them), anything else a local text file or
a folder of ``*.txt`` files. ``--calib`` also takes a comma-separated mix of named sources
(``shakespeare,kjv``), each getting an equal share of the calibration windows.
Documents are joined with a blank line ("\\n\\n").
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import torch

from slimkv.common.checks import close_matches
from slimkv.data.austen import austen_documents
from slimkv.data.corpora import CORPORA
from slimkv.data.shakespeare import shakespeare_plays, shakespeare_split

CALIB_SHAKESPEARE = "shakespeare"
EVAL_SHAKESPEARE = "shakespeare-val"
AUSTEN = "austen"  # Jane Austen's novels: the out-of-domain evaluation text (slimkv.data.austen)
HELD_OUT_SUFFIX = "-val"  # NAME-val: the held-out documents of a Debian source (slimkv.data.corpora.split_documents)
EVAL_HANDBOOK = "handbook-val"  # the Debian handbook's held-out pages: modern English, the out-of-domain text of the mix era
DOC_SEPARATOR = "\n\n"
CALIBRATION_SOURCES = (CALIB_SHAKESPEARE, *CORPORA)  # names --calib takes, alone or mixed
EVALUATION_ONLY = (EVAL_SHAKESPEARE, AUSTEN, *(name + HELD_OUT_SUFFIX for name in CORPORA))  # never calibration text
MIXED_CALIBRATION = "shakespeare,kjv,devil,pydoc,handbook"  # every calibration source, equal shares


def _shakespeare(split: str) -> list[str]:
    plays = shakespeare_plays()
    train, val = shakespeare_split()
    return [plays[name] for name in (train if split == "train" else val)]


def read_text_file(path: str | Path) -> str:
    """Exact text of a UTF-8 file (a leading byte-order mark is dropped); ValueError naming the file
    if it is binary, not UTF-8 or empty, FileNotFoundError if it does not exist or is a folder."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder, not a text file")
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    data = path.read_bytes()
    if b"\x00" in data[:1 << 20]:
        raise ValueError(f"{path} looks like a binary file (it holds NUL bytes), not UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid UTF-8 ({err})") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def _local_documents(spec: str) -> list[str]:
    path = Path(spec).expanduser()
    if path.is_file():
        return [read_text_file(path)]
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise FileNotFoundError(f"{path} is a folder that holds no *.txt files")
        return [read_text_file(f) for f in files]
    known = ", ".join((*CALIBRATION_SOURCES, *EVALUATION_ONLY))
    raise FileNotFoundError(f"text {spec!r} is neither a known source ({known}) nor an existing file or folder")


def _named_documents(name: str) -> list[str]:
    return _shakespeare("train") if name == CALIB_SHAKESPEARE else CORPORA[name].split("train")


def _looks_like_path(item: str) -> bool:
    return item.startswith(("~", ".")) or "/" in item or "\\" in item or Path(item).suffix != ""


def calibration_sources(spec: str, option: str = "--calib") -> list[tuple[str, list[str]]]:
    """The sources of ``--calib SPEC`` as (name, documents), in the order given.

    SPEC is a named source (``shakespeare``, ``kjv``, ``devil``, ``pydoc``), a comma-separated mix
    of them (``shakespeare,kjv``: each gets an equal share of the windows, see
    ``calibration_ids``) or a local PATH (a file or a folder of ``*.txt``; a path holding a
    comma is a path if it exists, a name wins over a file of that name: write ``./kjv``).
    Evaluation texts are refused, naming them (and ``option``, the flag that gave SPEC).
    """
    if spec in CALIBRATION_SOURCES:
        return [(spec, _named_documents(spec))]
    if spec not in EVALUATION_ONLY and Path(spec).expanduser().exists():
        return [(spec, _local_documents(spec))]
    names = [item.strip() for item in spec.split(",")]
    refused = [name for name in names if name in EVALUATION_ONLY]
    if refused:
        raise ValueError(f"{option} {spec!r} names evaluation text {', '.join(refused)}, which calibration never uses; "
                         f"allowed values: {', '.join(CALIBRATION_SOURCES)} (or a mix like {MIXED_CALIBRATION}), or a PATH")
    if len(names) == 1 and _looks_like_path(spec):
        return [(spec, _local_documents(spec))]  # FileNotFoundError naming the path
    for name in names:
        if name not in CALIBRATION_SOURCES:
            raise ValueError(f"{option} {spec!r}: {name!r} is not a calibration source{close_matches(name, CALIBRATION_SOURCES)}; "
                             f"allowed values: {', '.join(CALIBRATION_SOURCES)}, a comma-separated mix of them "
                             f"(like {MIXED_CALIBRATION}), or an existing PATH")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{option} {spec!r} names {', '.join(repeated)} more than once; each source gets an equal share, name it once")
    return [(name, _named_documents(name)) for name in names]


def calibration_text_sha256(sources: list[tuple[str, list[str]]]) -> str:
    """The hash of the whole calibration text of ``sources`` (``calibration_sources``): every
    document, sources in order, joined with ``DOC_SEPARATOR``; what ``eval ppl`` compares against."""
    return text_sha256(DOC_SEPARATOR.join(document for _name, documents in sources for document in documents))


def calibration_documents(spec: str) -> list[str]:
    """All documents of ``--calib SPEC`` (``calibration_sources``) as one list, sources in order:
    the calibration text to hash. Sample windows from ``calibration_sources(spec)``, not from
    this list, so that a mix gives each source an equal share."""
    return [document for _name, documents in calibration_sources(spec) for document in documents]


def evaluation_text(spec: str) -> str:
    """``shakespeare-val`` (the held-out plays), ``austen`` (out of domain), ``NAME-val`` (the
    held-out documents of a Debian source), ``kjv``, ``devil``, ``pydoc``, ``handbook`` (the whole
    text, held-out documents included) or a local PATH, documents joined with a blank line. A run must not be evaluated on
    a text it was calibrated on (``kjv`` after ``--calib shakespeare,kjv``): its scores would not
    measure generalisation; only the calibration split ``shakespeare`` is refused here."""
    if spec == CALIB_SHAKESPEARE:
        others = ", ".join(map(repr, (*EVALUATION_ONLY, *CORPORA)))
        raise ValueError(f"--text {spec!r} is the calibration split; use {others} or a PATH")
    if spec == AUSTEN:
        return DOC_SEPARATOR.join(austen_documents())
    if spec.endswith(HELD_OUT_SUFFIX) and spec.removesuffix(HELD_OUT_SUFFIX) in CORPORA:
        return DOC_SEPARATOR.join(CORPORA[spec.removesuffix(HELD_OUT_SUFFIX)].split("val"))
    if spec in CORPORA:
        return DOC_SEPARATOR.join(CORPORA[spec].documents())
    return DOC_SEPARATOR.join(_shakespeare("val") if spec == EVAL_SHAKESPEARE else _local_documents(spec))


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids of the whole text, tokenized once, without added special tokens."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _window(rng: random.Random, tokenizer, documents: list[str], cache: dict[int, list[int]], seq_len: int) -> list[int] | None:
    """A random ``seq_len``-token span of a random document long enough (up to 100 draws), or None."""
    for _attempt in range(100):
        index = rng.randrange(len(documents))
        if index not in cache:
            cache[index] = tokenize(tokenizer, documents[index])
        ids = cache[index]
        if len(ids) >= seq_len:
            start = rng.randrange(len(ids) - seq_len + 1)
            return ids[start:start + seq_len]
    return None


def _groups(sources: list[str] | list[tuple[str, list[str]]]) -> tuple[list[tuple[str, list[str]]], bool]:
    """(name, documents) groups of ``calibration_ids``' ``sources``, and whether they were named."""
    named = bool(sources) and not isinstance(sources[0], str)
    groups = list(sources) if named else [("", sources)]
    for name, documents in groups:
        if not documents:
            raise ValueError(f"calibration source {name!r} has no documents" if named else "calibration text has no documents")
    return groups, named


def check_calibration_size(tokenizer, sources: list[str] | list[tuple[str, list[str]]], tokens: int, seq_len: int,
                           caches: list[dict[int, list[int]]] | None = None) -> None:
    """The calibration text holds the tokens asked for: each source (its share of the windows,
    as ``calibration_ids`` deals them) at least as many tokens, in documents of at least
    ``seq_len`` tokens, as its windows take; otherwise windows would repeat the same text.
    ValueError naming --calib-tokens, --calib-seq-len and how many tokens the text has. Documents
    are tokenized in order until there are enough (into ``caches``, one dict per source, if given)."""
    if tokens < 1 or seq_len < 2:
        raise ValueError(f"calibration needs tokens >= 1 and seq_len >= 2; got tokens={tokens}, seq_len={seq_len}")
    groups, named = _groups(sources)
    caches = [{} for _ in groups] if caches is None else caches
    windows = math.ceil(tokens / seq_len)
    if windows < len(groups):
        raise ValueError(f"--calib-tokens {tokens} in windows of --calib-seq-len {seq_len} gives {windows} windows, fewer than the "
                         f"{len(groups)} sources of the mix ({', '.join(name for name, _ in groups)}): each needs a window; "
                         f"give --calib-tokens at least {len(groups) * seq_len} or fewer sources")
    for i, (name, documents) in enumerate(groups):
        share = len(range(i, windows, len(groups)))
        needed, have = share * seq_len, 0
        for index, document in enumerate(documents):
            if have >= needed:
                break
            if index not in caches[i]:
                caches[i][index] = tokenize(tokenizer, document)
            have += len(caches[i][index]) if len(caches[i][index]) >= seq_len else 0
        text = f"calibration source {name!r}" if named else "the calibration text"
        if have == 0:
            raise ValueError(f"{text} has no document of at least {seq_len} tokens; lower --calib-seq-len")
        if have < needed:
            share_text = f"its share, {share} of the {windows} windows" if len(groups) > 1 else f"{windows} windows"
            raise ValueError(f"--calib-tokens {tokens} in windows of --calib-seq-len {seq_len} takes {needed} tokens from {text} ({share_text}), "
                             f"which holds only {have} tokens in documents of at least {seq_len} tokens: the windows would repeat the same text; "
                             f"lower --calib-tokens or give a longer text")


def calibration_ids(tokenizer, sources: list[str] | list[tuple[str, list[str]]], tokens: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(ceil(tokens / seq_len), seq_len) LongTensor of calibration windows.

    ``sources`` is a list of documents (one source) or of (name, documents) from
    ``calibration_sources``. Window i comes from source i mod k (round-robin: equal shares, the
    first sources one more when k does not divide the count), as a random ``seq_len``-token span of
    a random document of that source; one seeded rng draws them all in order, so one source gives
    the same windows either way. Documents are tokenized once each, lazily, so a small calibration
    set does not tokenize a whole corpus. ValueError naming the source when it has no document of
    ``seq_len`` tokens, or fewer tokens than its windows take (``check_calibration_size``).
    """
    groups, named = _groups(sources)
    caches: list[dict[int, list[int]]] = [{} for _ in groups]
    check_calibration_size(tokenizer, groups if named else groups[0][1], tokens, seq_len, caches)
    rng = random.Random(seed)
    windows = []
    for i in range(math.ceil(tokens / seq_len)):
        name, documents = groups[i % len(groups)]
        window = _window(rng, tokenizer, documents, caches[i % len(groups)], seq_len)
        if window is None:
            text = f"calibration source {name!r}" if named else "calibration text"
            raise ValueError(f"{text} has no document of at least {seq_len} tokens; lower --calib-seq-len")
        windows.append(window)
    return torch.tensor(windows, dtype=torch.long)
