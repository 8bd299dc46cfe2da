"""Healing's copy mix (``--heal-copy-fraction``): windows keep their length, the rebuilt ones end
with the span they showed earlier, the choice depends only on (seed, step) so a resumed run sees the
same windows, fraction 0 is plain text, and a bad fraction is refused naming the option."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slimkv.cli import main
from slimkv.convert.heal import CopyMixBatches, HealConfig, TextBatches
from tests.compress.conftest import char_tokenizer
from tests.convert.conftest import CALIB

SEQ_LEN = 95


def batches(fraction: float, seed: int = 3) -> CopyMixBatches:
    tokenizer = char_tokenizer()
    ids = np.array(tokenizer(CALIB, add_special_tokens=False).input_ids)
    return CopyMixBatches(ids, SEQ_LEN, seed, fraction, tokenizer, CALIB.split("\n\n"))


def repeats_its_source(window: torch.Tensor) -> bool:
    """The window ends with a span that also appears, whole, at a depth of 5-25% of it."""
    width = window.numel()
    for length in range(width // 8, 4, -1):
        tail = window[-length:]
        if any(torch.equal(window[d:d + length], tail) for d in range(int(0.05 * width), int(0.25 * width) + 1)):
            return True
    return False


def test_copy_windows_keep_their_length_and_end_with_the_span_they_showed():
    batch = batches(1.0).sample(step=0, n=6)
    assert batch.shape == (6, SEQ_LEN + 1)
    assert all(repeats_its_source(row) for row in batch)
    plain = TextBatches(batches(1.0).ids, SEQ_LEN, 3).sample(0, 6)
    head = int(0.05 * (SEQ_LEN + 1))
    assert all(not torch.equal(row, text) and torch.equal(row[:head], text[:head]) for row, text in zip(batch, plain))


def test_fraction_zero_is_the_text_and_the_mix_is_a_function_of_seed_and_step():
    mixed = batches(0.0)
    assert torch.equal(mixed.sample(0, 4), TextBatches(mixed.ids, SEQ_LEN, 3).sample(0, 4))
    first, second = batches(0.5), batches(0.5)
    state = first.state()
    a = first.sample(step=7, n=8)
    second.load_state(state)  # a resumed run: the sampler's state restored, the step the same
    assert torch.equal(second.sample(step=7, n=8), a)
    for seed in range(3):  # about half the windows rebuilt (the rest exactly the text's), each starting with the text's prose
        mix = batches(0.5, seed)
        plain = TextBatches(mix.ids, SEQ_LEN, seed).sample(0, 16)
        batch = mix.sample(0, 16)
        rebuilt = [i for i, row in enumerate(batch) if not torch.equal(row, plain[i])]
        assert 2 <= len(rebuilt) <= 14, rebuilt
        head = int(0.05 * (SEQ_LEN + 1))
        assert all(torch.equal(batch[i, :head], plain[i, :head]) and repeats_its_source(batch[i]) for i in rebuilt)


def test_a_bad_copy_fraction_is_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(ValueError, match="--heal-copy-fraction"):
        HealConfig(tokens=64, copy_fraction=1.5).validate()
    assert main(["convert", "--model", "smollm2", "--to", "gqa", "--cache-ratio", "0.5", "--out", str(tmp_path / "o"),
                 "--heal-tokens", "64", "--heal-copy-fraction", "-0.1"]) == 2
    assert "--heal-copy-fraction" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
