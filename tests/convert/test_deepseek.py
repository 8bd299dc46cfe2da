"""``--export deepseek``: an mla-prefix conversion written as transformers' DeepseekV3ForCausalLM
computes what the slimkv model computes (the constant latent channel makes kv_a_layernorm linear)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimkv.cli import main
from slimkv.convert.deepseek import EXPORT_FOLDER, check_exportable
from slimkv.convert.pipeline import convert_pretrained
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.compress.conftest import tiny_model
from tests.convert.conftest import options


def test_an_mla_prefix_conversion_exports_to_deepseek_v3(tiny_folder, tmp_path):
    out = tmp_path / "out"
    opts = options("mla-prefix", 0.5, tmp_path)
    opts.export = "deepseek"
    model, manifest = convert_pretrained(str(tiny_folder), opts, out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    assert stored["export"]["folder"] == EXPORT_FOLDER and EXPORT_FOLDER in stored["files"]
    assert manifest["export"] == stored["export"]  # what the caller gets is what was published
    exported = AutoModelForCausalLM.from_pretrained(out / EXPORT_FOLDER).eval()  # transformers' own class, no slimkv code
    assert type(exported).__name__ == "DeepseekV3ForCausalLM"
    assert exported.config.kv_lora_rank == model.model.layers[0].attn.kv_rank + 1  # the constant channel
    ids = torch.randint(3, 99, (2, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        assert (exported(ids).logits - expected).abs().max() < 1e-4
        # and it decodes from its own (latent) cache
        prefix = exported(ids[:, :60], use_cache=True)
        step = exported(ids[:, 60:], cache=prefix.past_key_values, use_cache=True)
        assert (step.logits - expected[:, 60:]).abs().max() < 1e-4
    assert stored["export"]["max_abs_logit_difference"] < 1e-4


def test_only_what_deepseek_v3_expresses_is_exported(tiny_folder, tmp_path, capsys):
    base = ["convert", "--model", str(tiny_folder), "--cache-ratio", "0.5", "--export", "deepseek", "--calib", str(tmp_path / "calib.txt"),
            "--calib-tokens", "64", "--calib-seq-len", "32", "--out", str(tmp_path / "never")]
    assert main(base + ["--to", "mla"]) == 2
    assert "--export deepseek needs --to mla-prefix" in capsys.readouterr().err
    qwen = tmp_path / "qwen"
    tiny_model("qwen2").save_pretrained(qwen)
    argv = base + ["--to", "mla-prefix"]
    argv[argv.index("--model") + 1] = str(qwen)
    assert main(argv) == 2
    assert "DeepSeek-V3's q_proj has no bias" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    mla = convert_pretrained(str(tiny_folder), options("mla", 0.5, tmp_path), None, progress=False)[0]
    pairs = mla.model.layers[0].attn.rope_dim // 2
    prefix = (1.0 / 10000.0 ** (torch.arange(pairs, dtype=torch.float64) * 2 / 12)).tolist()
    assert any(layer.attn.rope_frequencies != pytest.approx(prefix) for layer in mla.model.layers)  # mla chose other pairs
    with pytest.raises(ValueError, match="--export deepseek needs"):
        check_exportable(mla)
