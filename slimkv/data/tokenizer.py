"""Byte-level BPE (trained with the ``tokenizers`` library) and the UTF-8 byte length of each token.

The tokenizer has no normalizer, no added prefix space and no special tokens, so every id stands
for real bytes of text and ``decode(encode(text)) == text`` for any string. Each vocabulary entry
is written in the byte-level alphabet (one character per byte), so its UTF-8 byte length is its
character count; BPB divides by ``token_bytes[ids].sum()``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MIN_VOCAB_SIZE = 257  # the 256 single bytes plus at least one merge
MAX_VOCAB_SIZE = 65536  # token arrays are stored as uint16 on disk

# A newline between two visible characters: the ByteLevel pre-tokenizer (GPT-2 pattern) always
# ends a piece before the newline and starts one after it, so encoding the text cut there piece
# by piece gives exactly the ids of encoding it whole.
_VISIBLE = r"[\w!-/:-@\[-`{-~]"
_SAFE_CUT = re.compile(rf"(?<={_VISIBLE})\n(?={_VISIBLE})")


def check_vocab_size(vocab_size: int) -> None:
    """ValueError naming ``vocab_size`` unless it is an int in [MIN_VOCAB_SIZE, MAX_VOCAB_SIZE]."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size (--vocab-size) must be an integer from {MIN_VOCAB_SIZE} to {MAX_VOCAB_SIZE} (256 bytes + merges), got {vocab_size!r}")


def train_byte_bpe(documents: Iterable[str], *, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` ids on ``documents``.

    The result may have fewer ids than asked when the text has too few distinct pairs
    (tiny inputs); callers read ``tokenizer.get_vocab_size()``.
    """
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def encode_long(tokenizer: Tokenizer, text: str, *, chunk_chars: int = 1 << 16) -> list[int]:
    """``tokenizer.encode(text).ids`` for a long text, computed in parallel on pieces of about
    ``chunk_chars`` characters cut only where the pre-tokenizer cuts anyway (see ``_SAFE_CUT``);
    one huge string is several times slower to encode in a single call.
    """
    pieces, start = [], 0
    while len(text) - start > chunk_chars:
        cut = _SAFE_CUT.search(text, start + chunk_chars)
        if cut is None:
            break
        pieces.append(text[start : cut.end()])
        start = cut.end()
    pieces.append(text[start:])
    return [i for encoding in tokenizer.encode_batch(pieces, add_special_tokens=False) for i in encoding.ids]


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """int64 array (vocab_size,): UTF-8 byte length of each id of a byte-level tokenizer."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    if sorted(vocab.values()) != list(range(len(lengths))):
        raise ValueError("tokenizer ids are not contiguous from 0; cannot build the byte-length table")
    for token, index in vocab.items():
        if not token or not set(token) <= alphabet:
            raise ValueError(f"token {token!r} (id {index}) is not written in the byte-level alphabet")
        lengths[index] = len(token)
    return lengths
