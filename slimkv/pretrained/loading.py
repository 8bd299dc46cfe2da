"""Loading a pretrained causal LM from ``smollm2`` or a local transformers folder."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn

from slimkv.common.files import content_sha256, read_json
from slimkv.common.quiet import quiet_transformers
from slimkv.pretrained.families import SUPPORTED_TEXT, family_of
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
    ``base_model.name``), checked to exist and to hold the weights it was made from (the
    fingerprint ``base_model.weights_sha256``, when the manifest records one: older ones do not).
    FileNotFoundError naming the manifest, the recorded place and what to do when it is gone
    (moved or deleted); ValueError naming the folder and both fingerprints when its weights
    changed since. Reads no model: it hashes the original's safetensors files."""
    base_model = manifest.get("base_model") or {}
    base = base_model.get("name") if isinstance(base_model, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(f"{manifest_path} records no original model (base_model.name); the file was edited or damaged")
    try:
        folder = resolve_model_path(base)
    except FileNotFoundError:
        if base == SMOLLM2:
            problem, how = f"{SMOLLM2} is not in {smollm2_dir()}", FETCH_HINT
        else:
            problem, how = f"{base} holds no config.json: it was moved or deleted", f"put it back at {base}"
        raise FileNotFoundError(f"the original model recorded in {manifest_path} is missing ({problem}); {how}, then run this again") from None
    recorded = base_model.get("weights_sha256")
    if recorded is None:
        return base
    if not isinstance(recorded, str) or not recorded:
        raise ValueError(f"{manifest_path}: base_model.weights_sha256 is {recorded!r}, not a sha256; the file was edited or damaged")
    current = weights_fingerprint(folder)
    if current != recorded:
        made = "compress" if Path(manifest_path).name == COMPRESSED_MANIFEST else "convert"
        raise ValueError(f"the original model {folder} holds other weights than the ones {manifest_path} was made from (weights sha256 "
                         f"{recorded[:12]}... recorded, {current[:12]}... now): put back the weights it was made from, "
                         f"or run `slimkv {made}` again from the current ones")
    return base


def weights_fingerprint(path: Path) -> str:
    """sha256 over the folder's safetensors files (the base model's identity in manifests). Each
    file's sha256 is remembered while its size, mtime and inode stay (``content_sha256``), so a
    command that fingerprints one original twice (convert, then heal) reads it once."""
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        digest.update(file.name.encode())
        digest.update(content_sha256(file).encode())
    return digest.hexdigest()


def read_config(path: Path):
    """The transformers config of the model folder ``path`` (never remote code); ValueError naming
    config.json when it is not a JSON object with a ``model_type``, or holds what transformers refuses."""
    from transformers import AutoConfig

    file = Path(path) / "config.json"
    model_type = read_json(file, expect=dict).get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{file} has no model_type; slimkv reads {SUPPORTED_TEXT} and slimkv models")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as err:
        raise ValueError(f"{file} cannot be read as a {model_type} config ({' '.join(str(err).split())[:300]}); the file was edited or damaged") from None


def load_tokenizer(path: Path):
    """The transformers tokenizer saved in the model folder ``path`` (never remote code); ValueError
    naming the folder when its tokenizer files are missing or damaged (transformers and tokenizers
    fail with errors of many types there, none naming the file)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 (re-raised with the folder named)
        raise ValueError(f"the tokenizer in {path} cannot be loaded ({' '.join(str(err).split())[:300]}); "
                         "its tokenizer files (tokenizer.json, tokenizer_config.json) are missing or damaged") from None


def load_pretrained(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``smollm2`` or a local transformers folder of a supported family (safetensors only)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    for marker, what, how in ((COMPRESSED_MANIFEST, "compressed", "slimkv.compress.load"), (CONVERTED_MANIFEST, "converted", "AutoModelForCausalLM after `import slimkv`")):
        if (path / marker).is_file():
            raise ValueError(f"{path} is a model slimkv already {what} ({marker}); give the original model here, or load this one with {how}")
    config = read_config(path)
    family_of(config.model_type)
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds no .safetensors weights (slimkv loads safetensors only)")
    try:
        with quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False, output_loading_info=True)
    except (OSError, SafetensorError) as err:
        again = f"; run `slimkv models fetch {SMOLLM2} --force` to convert it again" if name_or_path == SMOLLM2 else ""
        raise ValueError(f"the weights in {path} cannot be read ({err}); a file is truncated or damaged{again}") from None
    except RuntimeError as err:
        if "mismatched_sizes" not in str(err):
            raise
        raise ValueError(f"{path}: the weights do not have the shapes config.json gives; a file is incomplete, or config.json was edited") from None
    problems = {k.replace("_keys", ""): sorted(map(str, v)) for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"{path}: the weights do not fit config.json ({'; '.join(f'{k}: {v}' for k, v in problems.items())}); "
                         "a file is incomplete, or config.json was edited")
    model.to(device).eval()
    tokenizer = load_tokenizer(path)
    identity = {"name": SMOLLM2 if name_or_path == SMOLLM2 else str(path.resolve()), "path": str(path.resolve()), "model_type": config.model_type}
    if (path / SOURCE_FILE).is_file():
        identity["source"] = read_json(path / SOURCE_FILE)
    return LoadedModel(model, tokenizer, identity)


def position_limit(model: Any) -> int | None:
    """A loaded model's ``max_position_embeddings`` (None when its config has none)."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def weights_record(model: str) -> dict[str, str]:
    """The weights ``model`` names: its folder (resolved) and the sha256 of its safetensors files."""
    folder = resolve_model_path(model).resolve()
    return {"path": str(folder), "sha256": weights_fingerprint(folder)}
