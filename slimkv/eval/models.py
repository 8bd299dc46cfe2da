"""Loading any causal LM slimkv can evaluate: ``smollm2``, a transformers folder of a supported
family, a folder written by ``slimkv compress`` or a slimkv model folder (``slimkv convert``, or a
training run's ``model/``) - each with the tokenizer saved beside it and where it came from."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from slimkv.common.files import read_json
from slimkv.compress.persist import load as load_compressed
from slimkv.model import ModelConfig, load_model_folder
from slimkv.pretrained import LoadedModel, load_pretrained, resolve_model_path
from slimkv.pretrained.loading import COMPRESSED_MANIFEST, CONVERTED_MANIFEST


def load_language_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """The model and tokenizer at ``name_or_path``; ``identity`` says what it is and, for a compressed
    or converted model, names its original (``identity["base"]``) so reports can show both."""
    path = resolve_model_path(name_or_path)
    if (path / COMPRESSED_MANIFEST).is_file():
        model, tokenizer, manifest = load_compressed(path, dtype=dtype, device=device, return_manifest=True)
        identity = dict(manifest["base_model"])
        identity["compressed"] = {"path": str(path), "method": manifest["method"], "ratio": manifest["ratio"], "achieved_ratio": manifest["achieved_ratio"],
                                  "calibration_text_sha256": manifest.get("calibration", {}).get("text_sha256"),
                                  "calibration_sources": manifest.get("calibration", {}).get("sources") or []}
        identity["base"] = identity["name"]
        return LoadedModel(model, tokenizer, identity)
    if AutoConfig.from_pretrained(path, trust_remote_code=False).model_type == ModelConfig.model_type:
        model = load_model_folder(path, dtype=dtype).to(device)
        if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} holds a slimkv model without a transformers tokenizer; evaluate a training run with `slimkv eval RUN_DIR`")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        identity = {"name": str(Path(path).resolve()), "path": str(Path(path).resolve()), "model_type": ModelConfig.model_type}
        if (path / CONVERTED_MANIFEST).is_file():
            manifest = read_json(path / CONVERTED_MANIFEST, expect=dict)
            identity["converted"] = {k: manifest.get(k) for k in ("method", "cache_ratio", "achieved_cache_ratio", "calibration", "healing")}
            identity["base"] = manifest.get("base_model", {}).get("name")
        return LoadedModel(model, tokenizer, identity)
    return load_pretrained(name_or_path, dtype=dtype, device=device)
