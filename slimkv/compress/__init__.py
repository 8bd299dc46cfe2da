"""Post-training low-rank compression of pretrained causal LMs (LatentLLM and its baselines).

``compress_model`` compresses a transformers model in place, layer by layer; ``save``/``load``
persist it (config + safetensors + JSON manifest); ``compress_pretrained`` does load -> calibrate
-> compress -> save for ``smollm2`` or a local folder; ``demo_compression`` is the ``make demo``
step. See ``pipeline`` for what the ratio means and ``linalg``/``joint_qk``/``joint_mlp`` for the
numerics.
"""

from slimkv.compress.linalg import FactorizationError
from slimkv.compress.methods import METHODS, register_method
from slimkv.compress.options import CompressOptions
from slimkv.compress.persist import load, save
from slimkv.compress.pipeline import compress_model
from slimkv.compress.sweep import demo_compression, run_sweep
from slimkv.compress.workflow import compress_pretrained

__all__ = [
    "METHODS",
    "CompressOptions",
    "FactorizationError",
    "compress_model",
    "compress_pretrained",
    "demo_compression",
    "load",
    "register_method",
    "run_sweep",
    "save",
]
