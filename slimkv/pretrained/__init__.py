"""Pretrained causal LMs from transformers: which families slimkv understands, the SmolLM2 asset
(installed offline from a registry wheel and converted once into the cache folder), and loading
local transformers folders (safetensors only, never remote code). docs/assets.md explains where
assets come from."""

from slimkv.pretrained.families import SUPPORTED_MODEL_TYPES, SUPPORTED_TEXT, family_of
from slimkv.pretrained.loading import LoadedModel, load_pretrained, resolve_model_path, weights_fingerprint
from slimkv.pretrained.smollm2 import SMOLLM2, fetch_smollm2, smollm2_dir

__all__ = [
    "SMOLLM2",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_TEXT",
    "LoadedModel",
    "family_of",
    "fetch_smollm2",
    "load_pretrained",
    "resolve_model_path",
    "smollm2_dir",
    "weights_fingerprint",
]
