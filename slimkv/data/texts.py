"""Text sources for calibration and evaluation (never overlapping), and calibration windows.

``shakespeare`` is the text of the training plays (calibration), ``shakespeare-val`` the text of
the held-out plays (evaluation), ``austen`` Jane Austen's novels (out-of-domain evaluation,
``slimkv.data.austen``), anything else a local text file or a folder of ``*.txt`` files.
Documents are joined with a blank line ("\\n\\n").
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import torch

from slimkv.data.austen import austen_documents
from slimkv.data.shakespeare import shakespeare_plays, shakespeare_split

CALIB_SHAKESPEARE = "shakespeare"
EVAL_SHAKESPEARE = "shakespeare-val"
AUSTEN = "austen"  # Jane Austen's novels: the out-of-domain evaluation text (slimkv.data.austen)
DOC_SEPARATOR = "\n\n"


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
    raise FileNotFoundError(f"text {spec!r} is neither a known source ({CALIB_SHAKESPEARE}, {EVAL_SHAKESPEARE}) nor an existing file or folder")


def calibration_documents(spec: str) -> list[str]:
    """``shakespeare`` (the training plays) or a local PATH, as a list of documents."""
    if spec in (EVAL_SHAKESPEARE, AUSTEN):
        raise ValueError(f"--calib {spec!r} is an evaluation text; use {CALIB_SHAKESPEARE!r} or a PATH")
    return _shakespeare("train") if spec == CALIB_SHAKESPEARE else _local_documents(spec)


def evaluation_text(spec: str) -> str:
    """``shakespeare-val`` (the held-out plays), ``austen`` (out of domain) or a local PATH,
    documents joined with a blank line."""
    if spec == CALIB_SHAKESPEARE:
        raise ValueError(f"--text {spec!r} is the calibration split; use {EVAL_SHAKESPEARE!r}, {AUSTEN!r} or a PATH")
    if spec == AUSTEN:
        return DOC_SEPARATOR.join(austen_documents())
    return DOC_SEPARATOR.join(_shakespeare("val") if spec == EVAL_SHAKESPEARE else _local_documents(spec))


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids of the whole text, tokenized once, without added special tokens."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def calibration_ids(tokenizer, documents: list[str], tokens: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(ceil(tokens / seq_len), seq_len) LongTensor of calibration windows.

    Each window is a random ``seq_len``-token span of a random document (seeded). Documents are
    tokenized once each, lazily, so a small calibration set does not tokenize the whole corpus.
    """
    if tokens < 1 or seq_len < 2:
        raise ValueError(f"calibration needs tokens >= 1 and seq_len >= 2; got tokens={tokens}, seq_len={seq_len}")
    rng = random.Random(seed)
    cache: dict[int, list[int]] = {}
    windows = []
    for _ in range(math.ceil(tokens / seq_len)):
        for _attempt in range(100):
            index = rng.randrange(len(documents))
            if index not in cache:
                cache[index] = tokenize(tokenizer, documents[index])
            ids = cache[index]
            if len(ids) >= seq_len:
                start = rng.randrange(len(ids) - seq_len + 1)
                windows.append(ids[start:start + seq_len])
                break
        else:
            raise ValueError(f"calibration text has no document of at least {seq_len} tokens; lower --calib-seq-len")
    return torch.tensor(windows, dtype=torch.long)
