"""Loading any causal LM slimkv can evaluate: ``smollm2``, a transformers folder of a supported
family, a folder written by ``slimkv compress`` or a slimkv model folder (``slimkv convert``, or a
training run's ``model/``) - each with the tokenizer saved beside it and where it came from."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from slimkv.common.files import read_json
from slimkv.common.vocabulary import current_layer_options
from slimkv.compress.persist import load as load_compressed
from slimkv.model import ModelConfig, SlimKVForCausalLM, load_model_folder
from slimkv.ops.quantize import parse_storage
from slimkv.pretrained import LoadedModel, load_pretrained, resolve_model_path
from slimkv.pretrained.loading import COMPRESSED_MANIFEST, CONVERTED_MANIFEST, load_tokenizer, read_config, resolve_original


def load_language_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """The model and tokenizer at ``name_or_path``; ``identity`` says what it is and, for a compressed
    or converted model, names its original (``identity["base"]``) so reports can show both."""
    path = resolve_model_path(name_or_path)
    if (path / COMPRESSED_MANIFEST).is_file():
        damage = compression_damage(read_json(path / COMPRESSED_MANIFEST, expect=dict))
        if damage:
            raise ValueError(f"{path / COMPRESSED_MANIFEST} is damaged ({'; '.join(damage)}); it was edited by hand or cut short: compress again rather than trust its labels")
        model, tokenizer, manifest = load_compressed(path, dtype=dtype, device=device, return_manifest=True)
        identity = dict(manifest["base_model"])
        identity["compressed"] = {"path": str(path), "method": manifest["method"], "ratio": manifest["ratio"], "achieved_ratio": manifest["achieved_ratio"],
                                  "calibration_text_sha256": manifest.get("calibration", {}).get("text_sha256"),
                                  "calibration_sources": manifest.get("calibration", {}).get("sources") or []}
        identity["base"] = identity["name"]
        return LoadedModel(model, tokenizer, identity)
    if read_config(path).model_type == ModelConfig.model_type:
        model = load_model_folder(path, dtype=dtype).to(device)
        if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} holds a slimkv model without a transformers tokenizer; evaluate a training run with `slimkv eval RUN_DIR`")
        tokenizer = load_tokenizer(path)
        identity = {"name": str(Path(path).resolve()), "path": str(Path(path).resolve()), "model_type": ModelConfig.model_type}
        if (path / CONVERTED_MANIFEST).is_file():
            manifest = read_json(path / CONVERTED_MANIFEST, expect=dict)
            check_conversion_manifest(model, manifest, path / CONVERTED_MANIFEST)
            identity["converted"] = {k: manifest.get(k) for k in ("method", "method_options", "options", "cache_ratio", "achieved_cache_ratio",
                                                                  "cache_bytes", "cache_storage", "budget_plan", "calibration", "healing")}
            identity["converted"]["kind"] = model.config.layer_kinds()[0]
            identity["base"] = manifest.get("base_model", {}).get("name")
            identity["manifest"] = str(path / CONVERTED_MANIFEST)
        return LoadedModel(model, tokenizer, identity)
    return load_pretrained(name_or_path, dtype=dtype, device=device)


def check_positions(model: torch.nn.Module, length: int, option: str) -> None:
    """``length`` tokens in one sequence must be within the model's position limit
    (``max_position_embeddings``, when it has one); ValueError naming ``option``, before any work."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"{option} {length} is past this model's position limit (max_position_embeddings={limit}); use {option} <= {limit}")


def manifest_of(name_or_path: str) -> Path | None:
    """The manifest of a compressed or converted model folder, or None for any other model."""
    path = resolve_model_path(name_or_path)
    return next((path / marker for marker in (COMPRESSED_MANIFEST, CONVERTED_MANIFEST) if (path / marker).is_file()), None)


def original_of(name_or_path: str) -> str | None:
    """The original of a compressed or converted model (None for any other model), checked before
    any model is loaded: present, and holding the weights it was made from (``resolve_original``)."""
    manifest = manifest_of(name_or_path)
    return None if manifest is None else resolve_original(read_json(manifest, expect=dict), manifest)


def load_original(loaded: LoadedModel, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """The original of a converted or compressed model (``identity["base"]``), checked by
    ``original_of``: a clear error naming the manifest when it was moved, deleted or changed."""
    identity = loaded.identity
    folder = identity.get("path") if identity.get("converted") else (identity.get("compressed") or {}).get("path")
    base = original_of(str(folder)) if folder else None
    if base is None:
        raise ValueError(f"{identity.get('name')} is neither a compressed nor a converted model: it has no original")
    return load_language_model(base, dtype=dtype, device=device)


def conversion_method(converted: dict[str, Any]) -> str:
    """The ``--to`` text a converted model was made with (``identity["converted"]``), options
    included (``lrkv:rope_placement=decoupled``), or the bare method name of a manifest without it."""
    return (converted.get("options") or {}).get("method") or converted["method"]


def kept_cache_ratio(converted: dict[str, Any]) -> float:
    """The fraction of the original's cache a converted model keeps (``identity["converted"]``):
    its achieved ratio, or for a bounded kind (no ratio) the fraction at the longest context of its
    cache table, the position limit (smaller still beyond it)."""
    if converted.get("achieved_cache_ratio") is not None:
        return float(converted["achieved_cache_ratio"])
    table = converted.get("cache_bytes") or []
    return float(table[-1]["ratio"]) if table else 1.0


def cache_label(converted: dict[str, Any]) -> str:
    """How a converted model's cache compares with the original's (``identity["converted"]``): a
    per-token cache by its ratio asked and achieved; a bounded one (kvm, mla-kvm, streaming: no
    achieved ratio, its cache stops growing) or a hybrid one (some heads grow, the others are
    bounded) by its bytes at the longest context of its cache table."""
    asked = "" if converted.get("cache_ratio") is None else f"cache ratio {converted['cache_ratio']}"
    if converted.get("achieved_cache_ratio") is not None:
        return f"{asked or 'cache'} (achieved {float(converted['achieved_cache_ratio']):.4f})"
    table = converted.get("cache_bytes") or []
    if not table:
        return f"{asked + ', ' if asked else ''}bounded cache"
    row = table[-1]
    kind = "cache" if converted.get("method") == "hybrid" else "bounded cache"  # hybrid's exact heads grow, its other heads are bounded
    storage = converted.get("cache_storage") or "full"
    held = "" if storage == "full" else f", {storage} storage, measured in {row.get('dtype', 'bfloat16')}"
    return f"{asked + ', ' if asked else ''}{kind}: {row['bytes']:,} bytes at {row['context']} tokens ({float(row['ratio']):.4f} of the original's{held})"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def form_problems(manifest: dict, kinds: dict[str, type], fractions: tuple[str, ...], required: tuple[str, ...] = ()) -> list[str]:
    """What in a manifest does not have the form slimkv writes: a field of ``kinds`` of another JSON
    type, a field of ``fractions`` that is not a number in [0, 1], a ``required`` field missing
    (the others may be null)."""
    names = {dict: "object", list: "list", str: "string"}
    problems = [f"{key} is missing" for key in required if manifest.get(key) is None]
    problems += [f"{key} is {manifest[key]!r}, not a JSON {names[kind]}" for key, kind in kinds.items()
                 if manifest.get(key) is not None and not isinstance(manifest[key], kind)]
    problems += [f"{key} is {manifest[key]!r}, not a number in [0, 1]" for key in fractions
                 if manifest.get(key) is not None and not (_is_number(manifest[key]) and 0 <= manifest[key] <= 1)]
    return problems


def compression_damage(manifest: dict) -> list[str]:
    """What in a compression manifest (``slimkv_compression.json``) reports read is not of the form
    ``slimkv compress`` writes; empty when it is well formed."""
    problems = form_problems(manifest, {"method": str, "base_model": dict, "calibration": dict}, ("ratio", "achieved_ratio"),
                             required=("method", "ratio", "achieved_ratio", "base_model"))
    calibration = manifest.get("calibration")
    sources = calibration.get("sources") if isinstance(calibration, dict) else None
    if sources is not None and not (isinstance(sources, list) and all(isinstance(s, str) for s in sources)):
        problems.append(f"calibration.sources is {sources!r}, not a list of text names")
    return problems


def manifest_damage(manifest: dict) -> list[str]:
    """What in a conversion manifest does not have the form ``slimkv convert`` writes (the fields
    reports read: JSON types, numbers where numbers go); empty when it is well formed."""
    problems = form_problems(manifest, {"method": str, "kind": str, "options": dict, "method_options": dict, "layers": list, "cache_bytes": list,
                                        "cache_elements_per_token_per_layer": dict, "calibration": dict, "healing": dict, "base_model": dict},
                             ("cache_ratio", "achieved_cache_ratio"))
    if isinstance(manifest.get("layers"), list) and not all(isinstance(layer, dict) for layer in manifest["layers"]):
        problems.append("layers holds entries that are not JSON objects")
    if isinstance(manifest.get("cache_bytes"), list):
        for row in manifest["cache_bytes"]:
            if not isinstance(row, dict) or not all(isinstance(row.get(k), int) and not isinstance(row.get(k), bool) and row[k] > 0 for k in ("context", "bytes", "original_bytes")) \
                    or not _is_number(row.get("ratio")):
                problems.append(f"cache_bytes holds {row!r}, not a row of positive integers context, bytes, original_bytes and a number ratio")
                break
    elements = manifest.get("cache_elements_per_token_per_layer")
    if isinstance(elements, dict):
        for key in ("before", "after"):
            if not isinstance(elements.get(key), list) or not all(_is_number(v) and v > 0 for v in elements[key]):
                problems.append(f"cache_elements_per_token_per_layer.{key} is {elements.get(key)!r}, not a list of positive numbers")
    return problems


def same_storage(a: str | None, b: str | None) -> bool:
    """Whether two cache-storage names (None: full) parse to the same storage; an unparsable one matches nothing."""
    try:
        return parse_storage(a or "full") == parse_storage(b or "full")
    except ValueError:
        return False


def check_conversion_manifest(model: SlimKVForCausalLM, manifest: dict, path: Path) -> None:
    """``slimkv_conversion.json`` must describe the model beside it (reports label the model from
    it): its kind is the layers' kind, its method and ratio are those of its recorded options,
    each layer's options and the cache it measurably holds are those recorded, and the achieved
    ratio follows from them and does not exceed the ratio asked. ValueError listing every
    difference. Beyond these checks the manifest's word is trusted: the ratio asked, which method
    of the kind it was (``mla``/``mla-prefix``, ``gqa``/``gqa-mean``), calibration and healing."""
    damage = manifest_damage(manifest)
    if damage:
        raise ValueError(f"{path} is damaged ({'; '.join(damage)}); it was edited by hand or cut short: convert again rather than trust its labels")
    problems = []
    method, kind, ratio = manifest.get("method"), manifest.get("kind"), manifest.get("cache_ratio")
    kinds = sorted(set(model.config.layer_kinds()))
    if kinds != [kind]:
        problems.append(f"kind {kind!r} but config.json has {', '.join(kinds)} layers")
    options = manifest.get("options") or {}
    stored_method = str(options.get("method") or "").partition(":")[0]
    if stored_method != method:
        problems.append(f"method is {method!r} but the conversion's options say {options.get('method')!r}")
    planned = (manifest.get("budget_plan") or {}).get("cache_ratio") if options.get("cache_budget") is not None else options.get("cache_ratio")
    if planned != ratio:  # a --cache-budget conversion's ratio is its plan's
        problems.append(f"cache_ratio is {ratio!r} but the conversion's {'budget plan' if options.get('cache_budget') is not None else 'options'} "
                        f"say {planned!r}")
    # storages compared as what they parse to: a name written before a setting existed (``block``) reads with its default
    if options.get("cache_budget") is not None and not same_storage(manifest.get("cache_storage"), (manifest.get("budget_plan") or {}).get("storage")):
        problems.append(f"cache_storage is {manifest.get('cache_storage')!r} but the budget plan chose {(manifest.get('budget_plan') or {}).get('storage')!r}")
    if not same_storage(manifest.get("cache_storage"), getattr(model.config, "cache_storage", "full")):
        problems.append(f"cache_storage is {manifest.get('cache_storage')!r} but config.json has {model.config.cache_storage!r}")
    recorded = [current_layer_options(kind, layer.get("options")) for layer in manifest.get("layers") or []]  # config.json reads so too
    per_layer = model.config.per_layer_options or [{} for _ in range(model.config.n_layers)]
    if json.loads(json.dumps(recorded)) != json.loads(json.dumps(per_layer)):
        problems.append("the per-layer options differ from config.json's per_layer_options")
    elements = manifest.get("cache_elements_per_token_per_layer") or {}
    before, after = elements.get("before") or [], elements.get("after") or []
    if elements or (ratio is not None and model.cache_is_per_token()):
        measured = model.cache_elements_per_token(tokens=8)
        if len(after) != len(measured) or any(abs(a - m) > 1e-6 * max(1.0, m) for a, m in zip(after, measured)):
            problems.append(f"the cache elements per token per layer after conversion are recorded as {after}, the model holds {measured}")
    for row in manifest.get("cache_bytes") or []:
        if not row.get("measured") and model.cache_bytes(row["context"]) != row["bytes"]:  # a quantized cache's rows are measured live
            problems.append(f"the cache at {row['context']} tokens is recorded as {row['bytes']} bytes, the model holds {model.cache_bytes(row['context'])}")
        if abs(row["ratio"] - row["bytes"] / row["original_bytes"]) > 1e-9:
            problems.append(f"the cache at {row['context']} tokens is recorded as {row['ratio']} of the original's, not its bytes / the original's")
    achieved = manifest.get("achieved_cache_ratio")
    if before and isinstance(achieved, (int, float)) and abs(achieved - sum(after) / sum(before)) > 1e-9:
        problems.append(f"achieved_cache_ratio {achieved} is not the recorded cache after / before ({sum(after) / sum(before):.6f})")
    if isinstance(ratio, (int, float)) and isinstance(achieved, (int, float)) and achieved > ratio + 1e-9:
        problems.append(f"the achieved cache ratio {achieved:.4f} is above the ratio asked, {ratio}: a conversion always meets the ratio it was asked for")
    if problems:
        raise ValueError(f"{path} does not describe the model beside it ({'; '.join(problems)}); it was edited or belongs to another conversion: "
                         "convert again rather than trust its labels")
