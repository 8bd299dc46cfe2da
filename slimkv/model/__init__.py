"""The decoder LM around the attention mechanisms, integrated with ``transformers``."""

from slimkv.model.config import ModelConfig
from slimkv.model.modeling import SlimKVCache, SlimKVForCausalLM, SlimKVModel, load_model_folder

__all__ = ["ModelConfig", "SlimKVCache", "SlimKVForCausalLM", "SlimKVModel", "load_model_folder"]
