"""``slimkv convert`` and the evaluations of its output under bad input and faults (issue 25):
a healing run never outlives its conversion, publishing deletes only what it created, every
option is checked before the work, and a manifest that does not describe its model is refused."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import slimkv.convert.pipeline as pipeline
from slimkv.cli import main
from slimkv.common import files
from slimkv.convert.heal import CONVERSION_KEY, HEAL_CONFIG, HEAL_DIR, HealConfig
from slimkv.convert.pipeline import convert_pretrained, heal_converted
from slimkv.eval.cache import cache_report
from slimkv.eval.models import load_language_model
from slimkv.eval.ppl import perplexity_report
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.convert.conftest import CALIB, options


def heal_options(tmp_path: Path) -> HealConfig:
    return HealConfig(tokens=32 * 4 * 4, text=str(tmp_path / "calib.txt"), seq_len=32, batch_size=4, lr=3e-3, checkpoint_every=2)


def heal_flags(cfg: HealConfig) -> list[str]:
    return ["--heal-tokens", str(cfg.tokens), "--heal-text", cfg.text, "--heal-seq-len", str(cfg.seq_len), "--heal-batch-size", str(cfg.batch_size),
            "--heal-lr", str(cfg.lr)]


def convert_argv(folder: Path, tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", "--model", str(folder), "--to", "gqa", "--cache-ratio", "0.5", "--calib", str(tmp_path / "calib.txt"), "--calib-tokens", "96",
            "--calib-seq-len", "32", "--out", str(out), "--no-progress", *extra]


def weights(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


def test_a_new_conversion_drops_the_earlier_healing_and_resume_refuses_a_foreign_one(tiny_folder, tmp_path, capsys):
    out, cfg = tmp_path / "out", heal_options(tmp_path)
    convert_pretrained(str(tiny_folder), options("gqa-mean", 0.5, tmp_path), out, progress=False)
    assert json.loads((out / CONVERTED_MANIFEST).read_text())[CONVERSION_KEY] == pipeline.model_fingerprint(out)
    assert heal_converted(out, cfg, progress=False, stop_after=3)["healing"]["status"] == "stopped"  # conversion A, healing interrupted
    stale = tmp_path / "stale-healing"
    shutil.copytree(out / HEAL_DIR, stale)
    # conversion B into the same folder (other calibration): A's healing run goes with A
    other = options("gqa", 0.5, tmp_path)
    other.seed = 1
    convert_pretrained(str(tiny_folder), other, out, progress=False)
    assert not (out / HEAL_DIR).exists()
    one_shot = weights(out)
    assert main(["convert", "--out", str(out), "--resume", *heal_flags(cfg)]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert not (out / HEAL_DIR).exists() and weights(out) == one_shot  # no empty healing/ left, B untouched
    # a healing run of another conversion put back (or left by an older slimkv) is refused, at this ratio and another
    shutil.copytree(stale, out / HEAL_DIR)
    for argv in (["--resume"], ["--resume", *heal_flags(cfg)]):
        assert main(["convert", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert "belongs to another conversion than the one published in" in err and "without --resume" in err
        assert weights(out) == one_shot
    convert_pretrained(str(tiny_folder), options("gqa", 0.75, tmp_path), tmp_path / "other-ratio", progress=False)
    shutil.copytree(stale, tmp_path / "other-ratio" / HEAL_DIR)
    with pytest.raises(ValueError, match="belongs to another conversion"):
        heal_converted(tmp_path / "other-ratio", cfg, resume=True, progress=False)
    stored = json.loads((stale / HEAL_CONFIG).read_text())
    assert stored[CONVERSION_KEY] == json.loads((tmp_path / "stale-healing" / "checkpoint" / "state.json").read_text())[CONVERSION_KEY]


def test_resume_needs_no_options_and_refuses_other_ones(tiny_folder, tmp_path, capsys):
    out, cfg = tmp_path / "out", heal_options(tmp_path)
    convert_pretrained(str(tiny_folder), options("gqa-mean", 0.5, tmp_path), out, progress=False)
    heal_converted(out, cfg, progress=False, stop_after=3)
    one_shot = weights(out)
    with files.folder_lock(out / HEAL_DIR, "healing run"):  # another process is healing there: a new conversion must not replace it
        assert main(convert_argv(tiny_folder, tmp_path, out)) == 2
        assert "is in use by another slimkv run (a new output would replace it)" in capsys.readouterr().err
    assert weights(out) == one_shot
    for extra, message in ((["--heal-lr", "0.1"], "healed with other options (lr: stored 0.003, requested 0.1)"),
                           (["--to", "mla"], "--to: " + str(out) + " has 'gqa-mean', given 'mla'"),
                           (["--heal-tokens", "64"], "tokens: stored 512, requested 64")):
        assert main(["convert", "--out", str(out), "--resume", *extra]) == 2
        assert message in capsys.readouterr().err
        assert weights(out) == one_shot
    assert main(["convert", "--out", str(out), "--resume", "--no-progress"]) == 0  # the --help example
    manifest = json.loads((out / CONVERTED_MANIFEST).read_text())
    assert manifest["healing"]["status"] == "finished" and manifest["healing"]["step"] == cfg.steps
    assert weights(out) != one_shot and (out / HEAL_DIR / HEAL_CONFIG).is_file()  # the healing run stays with its conversion
    assert main(convert_argv(tiny_folder, tmp_path, tmp_path / "x", "--heal-lr", "0.1")) == 2
    assert "--heal-lr set(s) up healing, which runs only with --heal-tokens" in capsys.readouterr().err


def test_publishing_deletes_only_what_it_created(tiny_folder, tmp_path):
    out = tmp_path / "out"
    lookalikes = [tmp_path / ".out.old", tmp_path / f".out.tmp-{os.getpid()}", tmp_path / ".out.old-x"]
    for folder in lookalikes:
        folder.mkdir()
        (folder / "mine.txt").write_text("user data")
    for _ in range(2):  # a new folder, then a replacement
        assert main(convert_argv(tiny_folder, tmp_path, out)) == 0
    assert all((folder / "mine.txt").read_text() == "user data" for folder in lookalikes)
    # what is left beside them is the output lock (a file slimkv created; kept, since deleting a lock file races with its next user)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == sorted([".out.lock", *(p.name for p in lookalikes)])
    assert (tmp_path / ".out.lock").is_file() and (tmp_path / ".out.lock").stat().st_size == 0


def test_publishing_that_fails_leaves_the_earlier_folder_and_user_files(tiny_folder, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert main(convert_argv(tiny_folder, tmp_path, out)) == 0
    (out / "notes.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir())
    real = os.replace

    def failing(src, dst):
        if Path(dst) == out and Path(src).name.startswith(".out.tmp-"):  # the swap itself fails (a full disk, a crash of the filesystem)
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", failing)
    with pytest.raises(OSError, match="I/O error"):
        convert_pretrained(str(tiny_folder), options("gqa", 0.5, tmp_path), out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == before and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == [".out.lock"]  # no temporary folder left, only the lock


def test_an_out_that_cannot_be_written_is_refused_before_work(tiny_folder, tmp_path, capsys, no_loading, monkeypatch):
    assert main(convert_argv(tiny_folder, tmp_path, Path("/proc/slimkv-probe"))) == 2
    assert "--out /proc/slimkv-probe cannot be written: creating a folder in /proc failed" in capsys.readouterr().err

    def read_only(target, tag):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(files, "fresh_sibling", read_only)
    assert main(convert_argv(tiny_folder, tmp_path, tmp_path / "ro" / "out")) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'ro' / 'out'} cannot be written" in err and "Read-only file system" in err
    assert not (tmp_path / "ro").exists()


def test_texts_and_names_are_checked_before_work(tiny_folder, tmp_path, capsys, no_loading):
    out = tmp_path / "out"
    argv = convert_argv(tiny_folder, tmp_path, out)
    argv[argv.index("--calib-tokens") + 1] = "100000"
    assert main(argv) == 2
    assert (f"--calib-tokens 100000 in windows of --calib-seq-len 32 takes 100000 tokens from calibration source '{tmp_path / 'calib.txt'}' "
            f"(3125 windows), which holds only {len(CALIB)} tokens") in capsys.readouterr().err  # one token per character
    for extra, message in ((["--heal-tokens", "100", "--heal-seq-len", "0"], "--heal-seq-len must be an integer >= 1, got 0"),
                           (["--heal-tokens", "100", "--heal-seq-len", "32", "--heal-text", "shakespeare-val"], "--heal-text 'shakespeare-val' names evaluation text"),
                           (["--heal-tokens", "100", "--heal-lr", "-1"], "--heal-lr must be a finite number > 0.0"),
                           (["--calib-tokens", "0"], "--calib-tokens must be an integer >= 1, got 0")):
        assert main(convert_argv(tiny_folder, tmp_path, out, *extra)) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "short.txt").write_text("To be, or not to be." * 3)
    assert main(convert_argv(tiny_folder, tmp_path, out, "--heal-tokens", "1000", "--heal-text", str(tmp_path / "short.txt"), "--heal-seq-len", "64")) == 2
    assert "--heal-text" in (err := capsys.readouterr().err) and "has 60 tokens, too few for --heal-seq-len 64" in err
    out.mkdir()
    (out / CONVERTED_MANIFEST).write_text(json.dumps({"files": ["model.safetensors"]}))  # an earlier conversion, and a folder of the user's
    (out / "deepseek_v3").mkdir()
    argv = convert_argv(tiny_folder, tmp_path, out, "--export", "deepseek")
    argv[argv.index("--to") + 1] = "mla-prefix"
    assert main(argv) == 2
    assert "holds files slimkv did not write with the names of new output files (deepseek_v3)" in capsys.readouterr().err
    (out / "healing").mkdir()  # no heal_config.json: not a healing run slimkv wrote
    assert main(convert_argv(tiny_folder, tmp_path, out, *heal_flags(heal_options(tmp_path)))) == 2
    assert "new output files (healing)" in capsys.readouterr().err
    assert not any(out.glob("*.safetensors"))


@pytest.fixture
def converted(tiny_folder, tmp_path) -> Path:
    out = tmp_path / "out"
    convert_pretrained(str(tiny_folder), options("gqa", 0.5, tmp_path), out, progress=False)
    return out


@pytest.mark.parametrize(("edit", "message"), [
    ({"method": "mla"}, "method is 'mla' but the conversion's options say 'gqa'"),
    ({"method": "gqa-mean"}, "method is 'gqa-mean' but the conversion's options say 'gqa'"),
    ({"cache_ratio": 0.25}, "above the ratio asked, 0.25"),
    ({"achieved_cache_ratio": 0.25}, "achieved_cache_ratio 0.25 is not the recorded cache after / before"),
    ({"kind": "mla", "method": "mla", "options": "same"}, "kind 'mla' but config.json has gqa layers"),
])
def test_an_edited_manifest_is_refused_not_trusted_for_labels(converted, tmp_path, capsys, edit, message):
    path = converted / CONVERTED_MANIFEST
    manifest = json.loads(path.read_text())
    edit = dict(edit)
    if edit.pop("options", None):
        manifest["options"] = {**manifest["options"], **edit}
    path.write_text(json.dumps({**manifest, **edit}))
    with pytest.raises(ValueError, match="does not describe the model beside it") as info:
        load_language_model(str(converted))
    assert message in str(info.value)
    assert main(["eval", "ppl", "--model", str(converted), "--text", str(tmp_path / "held.txt"), "--seq-len", "32"]) == 2
    assert message in capsys.readouterr().err


def test_eval_errors_name_the_options_and_the_missing_original(converted, tiny_folder, tmp_path, capsys):
    held = str(tmp_path / "held.txt")
    assert main(["eval", "cache", "--model", str(converted), "--context", "16", "--text", held]) == 2
    assert "--context 16 leaves no room for a prompt before --new-tokens 16 generated tokens (default 16)" in capsys.readouterr().err
    assert main(["eval", "cache", "--model", str(converted), "--context", "100000", "--text", held]) == 2
    assert "--context 100000 is past this model's position limit (max_position_embeddings=128)" in capsys.readouterr().err
    for task in (["cache", "--context", "24"], ["ppl", "--seq-len", "32"]):  # an output that cannot be written is refused before the work
        assert main(["eval", *task, "--model", str(converted), "--text", held, "--json", "/proc/slimkv.json"]) == 2
        assert "--json /proc/slimkv.json cannot be written" in capsys.readouterr().err
    assert main(["eval", "recall", "--kinds", "mha", "--steps", "1", "--out", "/proc/slimkv-recall"]) == 2
    assert "--out /proc/slimkv-recall cannot be written" in capsys.readouterr().err
    assert cache_report(str(converted), 24, new_tokens=2, text=held)["ratio_to_original"] <= 0.5
    label = perplexity_report(str(converted), held, 32, progress=False)["results"][-1]["model"]
    assert label.startswith("convert gqa (gqa layers) cache ratio 0.5 (achieved 0.5000)")
    tiny_folder.rename(tmp_path / "moved")
    for argv in (["cache", "--context", "24", "--new-tokens", "2"], ["ppl", "--seq-len", "32"]):
        assert main(["eval", *argv, "--model", str(converted), "--text", held]) == 2
        err = capsys.readouterr().err
        assert f"the original model recorded in {converted / CONVERTED_MANIFEST} is missing ({tiny_folder.resolve()} holds no config.json" in err
        assert f"put it back at {tiny_folder.resolve()}" in err and "--model" not in err
    with pytest.raises(FileNotFoundError, match="the original model recorded in .* is missing"):  # healing needs it too: said before any work
        heal_converted(converted, heal_options(tmp_path), progress=False)
    assert not (converted / HEAL_DIR).exists()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_generate_refuses_a_cache_of_another_sequence(converted):
    model = load_language_model(str(converted)).model
    ids = torch.randint(3, 99, (1, 30), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = out["cache"]
    longer = model.generate(out["sequences"], past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)  # continuing works
    assert longer.shape[1] == 35 and cache.seq_len == 34
    with pytest.raises(ValueError, match="already holds 34 tokens, and input_ids has 10: input_ids must be the cached sequence followed by"):
        model.generate(ids[:, :10], past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="at least one token per sequence"):
        model(ids[:, :0])


def test_bf16_decoding_from_the_cache_is_as_exact_as_the_full_forward(tiny_folder, tmp_path):
    """In bfloat16 a converted model's cached decode and its cache-free forward differ by rounding
    only: each is as far from the float32 computation of the same (bf16) weights as the other, and
    generate() produces exactly what a manual greedy decode from the cache produces. Greedy tokens
    can still part where two logits are within rounding of each other, as for any bf16 model."""
    out = tmp_path / "mla"
    convert_pretrained(str(tiny_folder), options("mla", 0.5, tmp_path), out, progress=False)
    model = load_language_model(str(out), dtype=torch.bfloat16).model
    reference = load_language_model(str(out), dtype=torch.bfloat16).model.float()  # the same weights, computed in float32
    ids = torch.randint(3, 99, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits[:, 40:]
        full = model(ids).logits.float()[:, 40:]
        cache = model.new_cache(1)
        model(ids[:, :40], cache=cache)
        decoded = torch.cat([model(ids[:, t:t + 1], cache=cache).logits.float() for t in range(40, 120)], dim=1)
        scale = expected.abs().max()
        rounding = max(float((full - expected).abs().max()), float(2 ** -8 * scale))  # bf16 keeps 8 bits: one unit in the last place
        assert float((decoded - expected).abs().max()) <= 2 * rounding
        prompt = ids[:, :40]
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 40:].tolist()
        cache, manual = model.new_cache(1), []
        logits = model(prompt, cache=cache).logits[:, -1]
        for _ in range(12):
            token = logits.argmax(-1)
            manual.append(int(token))
            logits = model(token[:, None], cache=cache).logits[:, -1]
    assert generated == manual


def test_conversion_and_healing_default_to_the_calibration_mix_compress_uses():
    """Fitted to one text by default, a conversion holds away from it worse (docs/conversion.md):
    convert, its healing and compress share one default, the mix of every calibration source."""
    from slimkv.compress.workflow import DEFAULT_CALIB
    from slimkv.data.texts import CALIBRATION_SOURCES

    assert pipeline.ConvertOptions("mla", 0.5).calib == HealConfig(tokens=1).text == DEFAULT_CALIB
    assert DEFAULT_CALIB.split(",") == list(CALIBRATION_SOURCES)


def test_the_fingerprint_tells_apart_conversions_that_keep_the_same_weights(tiny_folder, tmp_path):
    """hybrid plans keep the original's weights; their head roles and storage are in config.json, which the fingerprint covers."""
    from slimkv.pretrained import weights_fingerprint

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    before, weights_before = pipeline.model_fingerprint(folder), weights_fingerprint(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert weights_fingerprint(folder) == weights_before and pipeline.model_fingerprint(folder) != before
    shutil.copy(tiny_folder / "config.json", folder / "config.json")
    assert pipeline.model_fingerprint(folder) == before
