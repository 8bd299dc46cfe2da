"""Save and load compressed models: config + safetensors weights + a JSON manifest.

The manifest lists every replaced leaf (kind, ranks, identity-block permutation, damping, ...) and
the global facts (base model identity, method, ratio, achieved ratio, calibration data hash,
library version). ``load`` rebuilds the base architecture from the config, swaps in empty
factored modules as the manifest describes, and loads the weights strictly, so every value comes
from the file (never a random initialisation) and logits are identical to the saved model's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from slimkv.common.files import read_json, write_json
from slimkv.common.output_folder import OutputFolder
from slimkv.compress.arch import Architecture
from slimkv.compress.factored import FactoredLinear, SharedInputFactor, SplitOutputLinear, make_input_factor
from slimkv.pretrained.families import family_of
from slimkv.pretrained.loading import COMPRESSED_MANIFEST

MANIFEST_NAME = COMPRESSED_MANIFEST
WEIGHTS_NAME = "model.safetensors"
FORMAT = "slimkv-compressed"
FORMAT_VERSION = 1


COMPRESSED_FOLDER = OutputFolder(MANIFEST_NAME, "slimkv compression folder")


def save(model: nn.Module, tokenizer, manifest: dict, out_dir: str | Path) -> Path:
    """Write ``out_dir`` (config, tokenizer, weights, manifest with the list of files written).
    An earlier slimkv compression there is replaced; files slimkv did not write are kept."""
    out_dir = Path(out_dir).expanduser()
    with COMPRESSED_FOLDER.publish(out_dir) as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / WEIGHTS_NAME), metadata={"format": FORMAT})
        write_json(tmp / MANIFEST_NAME, {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, **COMPRESSED_FOLDER.file_record(tmp)})
    return out_dir


def _empty_factored(entry: dict, shared: dict[str, SharedInputFactor]) -> FactoredLinear:
    """A FactoredLinear with the shapes in ``entry`` (values come from the weights file)."""
    key = entry.get("shared_input")
    if key is not None:
        if key not in shared:
            shared[key] = SharedInputFactor(make_input_factor(entry["in_features"], entry["rank"], entry["identity_block"]))
        input_factor = shared[key]
    else:
        input_factor = make_input_factor(entry["in_features"], entry["rank"], entry["identity_block"])
    return FactoredLinear(input_factor, entry["out_features"], entry["bias"])


def apply_manifest(model: nn.Module, modules: list[dict]) -> None:
    """Replace the leaves named in the manifest by empty factored modules of the recorded shapes."""
    shared: dict[str, SharedInputFactor] = {}
    for entry in modules:
        if entry["kind"] == "split":
            module = SplitOutputLinear([_empty_factored(part, shared) for part in entry["parts"]])
        elif entry["kind"] == "factored":
            module = _empty_factored(entry, shared)
        elif entry["kind"] == "dense":
            continue  # left uncompressed: the original leaf and its weights stay
        else:
            raise ValueError(f"manifest entry for {entry.get('module')!r} has unknown kind {entry['kind']!r}")
        model.get_submodule(entry["module"])  # the leaf must exist in this architecture
        Architecture.set_leaf(model, entry["module"], module)


def load(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", return_manifest: bool = False):
    """(model, tokenizer) from a ``slimkv compress`` folder (plus the manifest if asked)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(path).expanduser()
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path} is not a slimkv compression folder (no {MANIFEST_NAME}); create one with `slimkv compress`")
    manifest = read_json(manifest_path, expect=dict)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: unsupported format {manifest.get('format')!r} version {manifest.get('format_version')!r}")
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    family_of(config.model_type)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    apply_manifest(model, manifest["modules"])
    try:
        load_model(model, str(path / WEIGHTS_NAME), strict=True, device="cpu")
    except (OSError, SafetensorError) as err:
        raise ValueError(f"the weights in {path} cannot be read ({err}); a file is truncated or damaged") from None
    model.to(dtype=dtype, device=device).eval()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False) if (path / "tokenizer_config.json").is_file() else None
    return (model, tokenizer, manifest) if return_manifest else (model, tokenizer)
