"""The perplexity protocol: windows, exact values on a known model, non-finite windows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from slimkv.eval.ppl import perplexity
from slimkv.scoring import NonFiniteLossError, perplexity_of_ids

from .conftest import char_tokenizer


class _Output:
    def __init__(self, logits):
        self.logits = logits


class UniformModel(nn.Module):
    """Predicts every token with equal probability (ppl = vocab); NaN logits from token ``poison`` on."""

    def __init__(self, vocab: int, poison: int | None = None):
        super().__init__()
        self.vocab, self.poison = vocab, poison
        self.weight = nn.Parameter(torch.zeros(1))
        self.calls: list[int] = []

    def forward(self, ids, use_cache=False):
        self.calls.append(ids.shape[1])
        logits = torch.zeros(*ids.shape, self.vocab) + self.weight
        if self.poison is not None:
            logits[(ids == self.poison)] = float("nan")
        return _Output(logits)


def test_uniform_model_has_perplexity_equal_to_the_vocabulary_size():
    ids = torch.arange(50) % 7
    result = perplexity_of_ids(UniformModel(13), ids, seq_len=16)
    assert math.isclose(result["ppl"], 13.0, rel_tol=1e-6)
    # non-overlapping windows 16, 16, 16, 2: each predicts all but its first token
    assert result["windows"] == 4 and result["tokens_predicted"] == 50 - 4


def test_a_one_token_tail_window_is_not_evaluated():
    model = UniformModel(5)
    result = perplexity_of_ids(model, torch.zeros(33, dtype=torch.long), seq_len=16)
    assert model.calls == [16, 16] and result["tokens_predicted"] == 30


def test_non_finite_window_is_an_error_not_skipped():
    ids = torch.zeros(40, dtype=torch.long)
    ids[25] = 3  # second window
    with pytest.raises(NonFiniteLossError, match="window 1"):
        perplexity_of_ids(UniformModel(5, poison=3), ids, seq_len=16)


def test_text_is_tokenized_once_and_truncated_to_max_tokens():
    tokenizer = char_tokenizer()
    model = UniformModel(99)
    result = perplexity(model, tokenizer, "abcdefghij" * 10, seq_len=8, max_tokens=20)
    assert model.calls == [8, 8, 4]
    assert result["tokens_predicted"] == 17 and math.isclose(result["ppl"], 99.0, rel_tol=1e-6)


@pytest.mark.parametrize("kwargs", [{"seq_len": 1}, {"seq_len": 8, "max_tokens": 1}])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        perplexity(UniformModel(99), char_tokenizer(), "abc" * 10, **kwargs)
