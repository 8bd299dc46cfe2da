"""``slimkv convert`` on tiny local Llama-family folders (no downloads): the exact copy, each
method end to end (reload gives identical logits, the live cache meets the ratio), healing with
exact resume, and bad input refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

import slimkv.convert.heal as heal_module
from slimkv.cli import main
from slimkv.convert.heal import HealConfig, held_out_metrics
from slimkv.convert.pipeline import convert_pretrained, heal_converted
from slimkv.convert.source import Source, exact_copy
from slimkv.eval.cache import cache_report
from slimkv.eval.models import load_language_model
from slimkv.pretrained import LoadedModel
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.compress.conftest import char_tokenizer, tiny_model
from tests.convert.conftest import CALIB, options


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_exact_copy_computes_what_the_original_computes(family):
    original = tiny_model(family)
    with torch.no_grad():
        for p in original.parameters():
            p.add_(0.05 * torch.randn_like(p))  # non-trivial biases and norms
    copy = exact_copy(Source(LoadedModel(original, None, {})), torch.float32)
    ids = torch.randint(3, 99, (2, 40))
    with torch.no_grad():
        assert torch.allclose(copy(ids).logits, original(ids).logits, atol=1e-4, rtol=1e-4)
        cache = copy.new_cache(2)  # and decodes from its own cache
        copy(ids[:, :30], cache=cache)
        assert torch.allclose(copy(ids[:, 30:], cache=cache).logits, original(ids).logits[:, 30:], atol=1e-4, rtol=1e-4)


def test_gqa_conversion_end_to_end(tiny_folder, tmp_path):
    out = tmp_path / "out"
    model, manifest = convert_pretrained(str(tiny_folder), options("gqa", 0.5, tmp_path), out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    assert stored["method"] == "gqa" and stored["cache_ratio"] == 0.5 and stored["achieved_cache_ratio"] <= 0.5
    assert stored["cache_elements_per_token_per_layer"]["before"] == [48.0, 48.0]
    assert stored["calibration"]["tokens"] == 96 and len(stored["base_model"]["weights_sha256"]) == 64
    reloaded = load_language_model(str(out))
    ids = torch.randint(3, 99, (1, 24))
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids).logits, model(ids).logits)
    report = cache_report(str(out), 40, new_tokens=4, text=str(tmp_path / "held.txt"))
    assert report["ratio_to_original"] == pytest.approx(stored["achieved_cache_ratio"])
    assert report["original"]["cache_type"] == "DynamicCache" and report["model"]["cache_type"] == "SlimKVCache"


def test_healing_lowers_the_distance_to_the_original_and_resumes_exactly(tiny_folder, tmp_path):
    cfg = HealConfig(tokens=32 * 4 * 12, text=str(tmp_path / "calib.txt"), seq_len=32, batch_size=4, lr=3e-3, checkpoint_every=4, eval_every=12)
    straight = tmp_path / "straight"
    convert_pretrained(str(tiny_folder), options("gqa-mean", 0.5, tmp_path), straight, progress=False)
    windows = torch.tensor(char_tokenizer()(CALIB[-400:], add_special_tokens=False).input_ids[:3 * 33]).view(3, 33)
    teacher = load_language_model(str(tiny_folder)).model
    before = held_out_metrics(load_language_model(str(straight)).model, teacher, windows)["kl"]
    manifest = heal_converted(straight, cfg, progress=False)
    healed = load_language_model(str(straight)).model
    assert manifest["healing"]["step"] == 12 and manifest["healing"]["trainable_parameters"] > 0
    assert set(manifest["healing"]["load_average_1min"]) == {"before", "after"}  # the load beside the healing time
    assert held_out_metrics(healed, teacher, windows)["kl"] < before
    assert json.loads((straight / CONVERTED_MANIFEST).read_text())["healing"]["status"] == "finished"
    # the same healing interrupted after 5 steps (last checkpoint: step 4) and resumed gives the same weights
    split = tmp_path / "split"
    convert_pretrained(str(tiny_folder), options("gqa-mean", 0.5, tmp_path), split, progress=False)
    assert heal_converted(split, cfg, progress=False, stop_after=5)["healing"]["status"] == "stopped"
    assert json.loads((split / CONVERTED_MANIFEST).read_text())["healing"] is None  # the published model is still the one-shot one
    heal_converted(split, cfg, resume=True, progress=False)
    for (name, x), (_, y) in zip(healed.state_dict().items(), load_language_model(str(split)).model.state_dict().items()):
        assert torch.equal(x, y), name


def test_bad_input_is_refused_before_any_work(tiny_folder, tmp_path, capsys):
    base = ["convert", "--model", str(tiny_folder), "--to", "gqa", "--calib", str(tmp_path / "calib.txt"), "--calib-tokens", "64", "--calib-seq-len", "32"]
    cases = [
        (["--cache-ratio", "1.5", "--out", str(tmp_path / "a")], "--cache-ratio must be a finite number > 0.0 and < 1.0"),
        (["--cache-ratio", "0.2", "--out", str(tmp_path / "a")], "below what --to gqa can represent for this model: the minimum is 0.5000"),
        (["--cache-ratio", "0.5", "--out", str(tmp_path / "held.txt")], "is a file"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    assert main(base + ["--cache-ratio", "0.5", "--out", str(tmp_path / "busy")]) == 2
    assert "not empty and is not an earlier slimkv conversion folder" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["mine.txt"]
    opt = tmp_path / "opt"
    tiny_model("opt").save_pretrained(opt)
    assert main(["convert", "--model", str(opt), "--to", "gqa", "--cache-ratio", "0.5", "--out", str(tmp_path / "b")]) == 2
    assert "cannot convert model_type 'opt': slimkv converts Llama, Mistral and Qwen2" in capsys.readouterr().err
    (tmp_path / "tiny.txt").write_text("short")
    argv = base + ["--cache-ratio", "0.5", "--out", str(tmp_path / "c")]
    argv[argv.index("--calib") + 1] = str(tmp_path / "tiny.txt")
    assert main(argv) == 2
    assert "no document of at least 32 tokens" in capsys.readouterr().err
    assert main(["convert", "--out", str(tmp_path / "d"), "--resume"]) == 2
    assert "holds no conversion (slimkv_conversion.json is missing)" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_activation_checkpointing_and_chunked_logits_change_memory_not_the_healed_weights(tiny_folder, tmp_path, monkeypatch):
    """Healing with each block's activations recomputed, and with the distillation's logits made a
    few tokens at a time (heal.LOSS_CHUNK), trains the same weights as keeping everything."""
    healed = {}
    for name, setting, chunk in (("kept", "off", 512), ("recomputed", "on", 512), ("chunked", "on", 7)):
        monkeypatch.setattr(heal_module, "LOSS_CHUNK", chunk)
        out = tmp_path / name
        convert_pretrained(str(tiny_folder), options("gqa-mean", 0.5, tmp_path), out, progress=False)
        cfg = HealConfig(tokens=32 * 4 * 3, text=str(tmp_path / "calib.txt"), seq_len=32, batch_size=4, lr=3e-3, activation_checkpointing=setting)
        assert heal_converted(out, cfg, progress=False)["healing"]["activation_checkpointing"] is (setting == "on")
        healed[name] = load_language_model(str(out)).model.state_dict()
    convert_pretrained(str(tiny_folder), options("gqa-mean", 0.5, tmp_path), tmp_path / "one-shot", progress=False)
    one_shot = load_language_model(str(tmp_path / "one-shot")).model.state_dict()
    assert any(not torch.equal(healed["kept"][key], value) for key, value in one_shot.items())  # the three runs trained something
    for key, kept in healed["kept"].items():
        assert torch.equal(healed["recomputed"][key], kept), key
        assert torch.allclose(healed["chunked"][key], kept, rtol=1e-5, atol=1e-6), key


def test_a_bad_activation_checkpointing_setting_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--heal-activation-checkpointing"):
        HealConfig(tokens=64, activation_checkpointing="sometimes").validate()
    assert HealConfig(tokens=64, seq_len=4096, batch_size=2).recomputes_activations  # auto: from 8192 tokens a step
    assert not HealConfig(tokens=64, seq_len=4096, batch_size=1).recomputes_activations and not HealConfig(tokens=64, seq_len=512).recomputes_activations
    assert HealConfig(tokens=64, seq_len=512, activation_checkpointing="on").recomputes_activations
