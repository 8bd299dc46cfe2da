"""Tiny random transformers models (built from config classes, no downloads) for compression tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

VOCAB = 99  # = the character tokenizer below


def tiny_config(family: str):
    """A 2-layer model of ``family`` (llama with GQA, qwen2 with biases, OPT with ReLU, GPT-2 with fused Conv1D qkv)."""
    if family == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=12, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "qwen2":  # Llama layout with q/k/v biases
        return Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "opt":
        return OPTConfig(vocab_size=VOCAB, hidden_size=48, ffn_dim=80, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=48,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2)
    raise KeyError(family)


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


def char_tokenizer():
    """A character-level fast tokenizer (printable ASCII + newline; ids 0-2 are special), no downloads."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>")


CALIB_LINES = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
HELD_OUT_LINES = "Is this a dagger which I see before me,\nThe handle toward my hand? Come, let me clutch thee.\n"


def write_tiny_llama_folder(tmp_path: Path, calib: str, held_out: str) -> Path:
    """``tmp_path/tiny-llama``: a tiny random Llama with the character tokenizer, and the texts
    ``calib.txt`` and ``held.txt`` beside it (a local model and texts, no downloads)."""
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(calib)
    (tmp_path / "held.txt").write_text(held_out)
    return folder


def calib_ids(sequences: int = 6, length: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (sequences, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread avoids OpenMP oversubscription when tests run in parallel workers."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
