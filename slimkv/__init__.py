"""slimkv: transformers with smaller key-value caches.

Importing the package registers every attention kind and the ``slimkv`` model type with the
``transformers`` Auto classes.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from slimkv.attention import ATTENTION_KINDS, build_attention
from slimkv.common.version import VERSION
from slimkv.model import ModelConfig, SlimKVCache, SlimKVForCausalLM

__version__ = VERSION

AutoConfig.register(ModelConfig.model_type, ModelConfig, exist_ok=True)
AutoModelForCausalLM.register(ModelConfig, SlimKVForCausalLM, exist_ok=True)

__all__ = ["ATTENTION_KINDS", "ModelConfig", "SlimKVCache", "SlimKVForCausalLM", "build_attention", "__version__"]
