"""Loading a pretrained causal LM from ``smollm2`` or a local transformers folder."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimkv.common.files import read_json, sha256_file
from slimkv.common.quiet import quiet_transformers
from slimkv.pretrained.families import family_of
from slimkv.pretrained.smollm2 import FETCH_HINT, SMOLLM2, SOURCE_FILE, smollm2_dir

# Folders slimkv writes beside a transformers config: a compressed model (slimkv.compress) and a
# converted one (slimkv.convert). Plain loading refuses them: they need their own loaders.
COMPRESSED_MANIFEST = "slimkv_compression.json"
CONVERTED_MANIFEST = "slimkv_conversion.json"


@dataclass
class LoadedModel:
    """A causal LM ready for evaluation or compression, with where it came from."""

    model: nn.Module
    tokenizer: object
    identity: dict  # JSON-able: name, path, model_type, weights sha256, compressed manifest (if any)


def resolve_model_path(name_or_path: str) -> Path:
    """``smollm2`` -> its converted folder (error naming the fetch command if absent); else a folder."""
    if name_or_path == SMOLLM2:
        path = smollm2_dir()
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"SmolLM2 is not converted yet ({path} is empty): {FETCH_HINT}")
        return path
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {name_or_path!r}: expected `{SMOLLM2}` (then {FETCH_HINT}) or a folder with config.json")
    return path


def resolve_original(manifest: dict, manifest_path: Path) -> str:
    """The original model a converted or compressed model was made from (its manifest's
    ``base_model.name``), checked to exist; FileNotFoundError naming the manifest, the recorded
    place and what to do when it is gone (moved or deleted)."""
    base = (manifest.get("base_model") or {}).get("name")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{manifest_path} records no original model (base_model.name); the file was edited or damaged")
    try:
        resolve_model_path(base)
    except FileNotFoundError:
        if base == SMOLLM2:
            problem, how = f"{SMOLLM2} is not in {smollm2_dir()}", FETCH_HINT
        else:
            problem, how = f"{base} holds no config.json: it was moved or deleted", f"put it back at {base}"
        raise FileNotFoundError(f"the original model recorded in {manifest_path} is missing ({problem}); {how}, then run this again") from None
    return base


def weights_fingerprint(path: Path) -> str:
    """sha256 over the folder's safetensors files (the base model's identity in manifests)."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        digest.update(file.name.encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


def load_pretrained(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``smollm2`` or a local transformers folder of a supported family (safetensors only)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    for marker, what, how in ((COMPRESSED_MANIFEST, "compressed", "slimkv.compress.load"), (CONVERTED_MANIFEST, "converted", "AutoModelForCausalLM after `import slimkv`")):
        if (path / marker).is_file():
            raise ValueError(f"{path} is a model slimkv already {what} ({marker}); give the original model here, or load this one with {how}")
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    family_of(config.model_type)
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds no .safetensors weights (slimkv loads safetensors only)")
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    identity = {"name": SMOLLM2 if name_or_path == SMOLLM2 else str(path.resolve()), "path": str(path.resolve()), "model_type": config.model_type}
    if (path / SOURCE_FILE).is_file():
        identity["source"] = read_json(path / SOURCE_FILE)
    return LoadedModel(model, tokenizer, identity)
