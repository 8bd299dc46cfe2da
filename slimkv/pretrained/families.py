"""The transformers model families slimkv can read: ``model_type`` -> family."""

from __future__ import annotations

# transformers ``model_type`` -> the family whose module layout slimkv knows.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "opt": "opt", "gpt2": "gpt2"}
SUPPORTED_TEXT = "Llama, Mistral, Qwen2 (model_type llama/mistral/qwen2), OPT (opt) and GPT-2 (gpt2) causal LMs"


def family_of(model_type: str) -> str:
    """The slimkv family ("llama", "opt", "gpt2") of a transformers model_type, or a ValueError."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {model_type!r}: slimkv supports {SUPPORTED_TEXT}")
    return SUPPORTED_MODEL_TYPES[model_type]
