"""``slimkv convert`` under races, bad options, changed inputs, a full disk and links (issue 39,
the conversion side): one lock on --out from before the first publish to the last write, a fit
step that makes its objective worse keeps what it had, a resume checks its healing text and
refuses a finished run, the state printed is the state held, windows fit the model, a failed
write names the file and leaves nothing behind, and nothing the user owns is deleted or replaced."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import slimkv.convert.pipeline as pipeline
from slimkv.cli import main
from slimkv.common import files
from slimkv.common.files import WriteFailed, atomic_directory, write_json
from slimkv.convert.heal import HEAL_CONFIG, HEAL_DIR, TEXT_KEY
from slimkv.convert.pipeline import CONVERTED_FOLDER, convert_pretrained, heal_converted
from slimkv.convert.transfer import TransferConfig, transfer_layer
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.convert.conftest import options
from tests.convert.test_faults import convert_argv, heal_flags, heal_options, weights
from tests.convert.test_kvm import SMALL_KVM, kvm_options


def held_elsewhere(out: Path) -> int:
    """Take the output lock of ``out`` as another process would (a descriptor of our own); returns it."""
    descriptor = os.open(out.with_name(f".{out.name}.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return descriptor


def test_a_second_run_on_a_busy_out_is_refused_before_work(tiny_folder, tmp_path, capsys, no_loading):
    out = tmp_path / "out"
    descriptor = held_elsewhere(out)
    try:
        assert main(convert_argv(tiny_folder, tmp_path, out)) == 2
        assert f"--out {out} is being written by another slimkv run" in capsys.readouterr().err
        assert not out.exists()
    finally:
        os.close(descriptor)


def test_the_out_stays_locked_between_publishing_and_healing(tiny_folder, tmp_path, monkeypatch):
    """Run A publishes its one-shot model and loads it back to heal: no other run can publish in between."""
    out, seen = tmp_path / "out", []
    real = pipeline.load_model_folder

    def load_and_try_the_lock(folder):
        with pytest.raises(BlockingIOError):
            held_elsewhere(out)
        seen.append(folder)
        return real(folder)

    monkeypatch.setattr(pipeline, "load_model_folder", load_and_try_the_lock)
    convert_pretrained(str(tiny_folder), options("gqa", 0.5, tmp_path), out, heal_cfg=heal_options(tmp_path), progress=False)
    assert seen  # healing loaded the student while the lock was held
    os.close(held_elsewhere(out))  # and the lock is free once the run is over


def test_a_fit_that_makes_the_layer_worse_keeps_its_one_shot_parameters():
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 16, 8)
    with torch.no_grad():
        y = layer(x) + 1e-4 * torch.randn(4, 16, 8)  # the one-shot layer is nearly exact already
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    facts = transfer_layer(layer, x, y, TransferConfig(steps=5, lr=1.0, params="attention"))
    assert facts["kept"] == "one-shot" and facts["relative_error_fitted"] > facts["relative_error_before"]
    assert facts["relative_error_after"] == facts["relative_error_before"]
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())


def test_a_transfer_at_too_high_a_rate_is_not_published_worse(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    _, manifest = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, SMALL_KVM + ",transfer_steps=10,transfer_params=attention,transfer_lr=1.0"),
                                     out, progress=False)
    layers = manifest["refinement"]["layers"]
    assert all(layer["relative_error_after"] <= layer["relative_error_before"] for layer in layers)
    kept = manifest["refinement"]["layers_kept_one_shot"]
    assert kept and f"attention transfer, layer {kept[0]}: the fit made the layer worse" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (",transfer_lr=1000000.0", r"transfer_lr must be a finite number > 0.0 and <= 1.0"),
    (",min_rows=1", r"min_rows=1 is below chunk_size=4: the state keeps every row of the first chunk"),
    (",min_rows=8,max_rows=6", r"max_rows=6 must be an integer >= min_rows=8"),
])
def test_state_and_transfer_options_that_cannot_hold_are_refused(tiny_folder, tmp_path, extra, message):
    method = SMALL_KVM.replace(",min_rows=6", "") + extra
    with pytest.raises(ValueError, match=message):
        pipeline.check_before_work(str(tiny_folder), kvm_options(tmp_path, method), tmp_path / "out")


def test_rope_partial_errors_speak_of_rope_partial(tiny_folder, tmp_path):
    with pytest.raises(ValueError, match=r"--to rope-partial: rope_pairs=0 .* at least one pair must keep its rotation") as err:
        pipeline.check_before_work(str(tiny_folder), kvm_options(tmp_path, "rope-partial:rope_pairs=0"), tmp_path / "out")
    assert "KVM" not in str(err.value)


def test_the_default_transfer_rate_depends_on_what_is_fitted(tiny_folder, tmp_path):
    _, manifest = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, SMALL_KVM + ",transfer_steps=2,transfer_params=attention"),
                                     tmp_path / "out", progress=False)
    assert manifest["refinement"]["lr"] == 1e-3
    _, manifest = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, SMALL_KVM + ",transfer_steps=2"), tmp_path / "out2", progress=False)
    assert manifest["refinement"]["lr"] == 0.05


@pytest.mark.parametrize("flags, message", [
    (["--calib-seq-len", "256"], "--calib-seq-len 256 is longer than the model's 128 positions"),
    (["--heal-tokens", "1000", "--heal-seq-len", "200"], "--heal-seq-len 200 is longer than the model's 128 positions"),
])
def test_windows_past_the_models_positions_are_refused_before_work(tiny_folder, tmp_path, capsys, no_loading, flags, message):
    argv = convert_argv(tiny_folder, tmp_path, tmp_path / "out")
    if "--calib-seq-len" in flags:
        del argv[argv.index("--calib-seq-len"):argv.index("--calib-seq-len") + 2]
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err


def stopped_healing(tiny_folder, tmp_path) -> Path:
    out = tmp_path / "out"
    convert_pretrained(str(tiny_folder), options("gqa", 0.5, tmp_path), out, progress=False)
    assert heal_converted(out, heal_options(tmp_path), progress=False, stop_after=2)["healing"]["status"] == "stopped"
    return out


def test_resume_refuses_a_healing_text_changed_since_the_run_started(tiny_folder, tmp_path, capsys):
    out = stopped_healing(tiny_folder, tmp_path)
    assert json.loads((out / HEAL_DIR / HEAL_CONFIG).read_text())[TEXT_KEY]
    calib = tmp_path / "calib.txt"
    calib.write_text(calib.read_text().replace("e", "a"))
    before = weights(out)
    assert main(["convert", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "the healing text" in (err := capsys.readouterr().err) and "changed since the run" in err
    assert weights(out) == before


def test_resume_of_a_finished_healing_changes_nothing(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    cfg = heal_options(tmp_path)
    assert main([*convert_argv(tiny_folder, tmp_path, out), *heal_flags(cfg)]) == 0
    manifest = (out / CONVERTED_MANIFEST).read_text()
    assert main(["convert", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "finished" in capsys.readouterr().err
    assert (out / CONVERTED_MANIFEST).read_text() == manifest


def test_the_suggested_cache_context_fits_the_model(tiny_folder, tmp_path, capsys):
    assert main(convert_argv(tiny_folder, tmp_path, tmp_path / "out")) == 0
    assert "--context 128`" in capsys.readouterr().out  # the tiny Llama has 128 positions, not 4096


def test_a_full_disk_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    real = Path.write_text

    def full(self, *args, **kwargs):
        real(self, "{\"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(WriteFailed, match=rf"could not write {target}: no space left on the device"):
        write_json(target, {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_library_writer_reporting_a_full_disk_in_its_own_words_is_named(tmp_path):
    with pytest.raises(WriteFailed, match="no space left"):
        with atomic_directory(tmp_path / "checkpoint"):
            raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')
    assert list(tmp_path.iterdir()) == []


def test_a_convert_onto_a_full_disk_says_so_and_keeps_the_earlier_folder(tiny_folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(convert_argv(tiny_folder, tmp_path, out)) == 0
    before = sorted(p.name for p in out.iterdir()), weights(out)
    real = files.os.replace

    def full(src, dst):
        if Path(dst) == out and Path(src).name.startswith(".out.tmp-"):  # the new folder's swap into place
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", full)
    assert main(convert_argv(tiny_folder, tmp_path, out, "--seed", "1")) == 2
    assert f"could not write {out}: no space left on the device" in capsys.readouterr().err
    assert (sorted(p.name for p in out.iterdir()), weights(out)) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == [".out.lock"]


def test_a_symlinked_out_is_written_through_and_kept(tiny_folder, tmp_path):
    target, link = tmp_path / "real-target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    assert main(convert_argv(tiny_folder, tmp_path, link)) == 0
    assert link.is_symlink() and link.resolve() == target.resolve() and (target / CONVERTED_MANIFEST).is_file()
    assert main(convert_argv(tiny_folder, tmp_path, link, "--seed", "1")) == 0  # and again, replacing the earlier output
    assert link.is_symlink() and (target / CONVERTED_MANIFEST).is_file()


def test_a_dangling_symlink_out_is_refused_before_work(tiny_folder, tmp_path, capsys, no_loading):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    assert main(convert_argv(tiny_folder, tmp_path, link)) == 2
    assert f"--out {link} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist" in capsys.readouterr().err
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_file_an_edited_manifest_claims_is_kept(tiny_folder, tmp_path):
    out = tmp_path / "out"
    assert main(convert_argv(tiny_folder, tmp_path, out)) == 0
    (out / "mine.txt").write_text("user data")
    manifest = json.loads((out / CONVERTED_MANIFEST).read_text())
    (out / CONVERTED_MANIFEST).write_text(json.dumps({**manifest, "files": [*manifest["files"], "mine.txt"]}))
    assert main(convert_argv(tiny_folder, tmp_path, out, "--seed", "1")) == 0
    assert (out / "mine.txt").read_text() == "user data"


def test_a_file_replaced_since_it_was_written_is_the_users(tiny_folder, tmp_path):
    out = tmp_path / "out"
    assert main(convert_argv(tiny_folder, tmp_path, out)) == 0
    (out / "generation_config.json").write_text('{"mine": true}')
    assert "generation_config.json" not in CONVERTED_FOLDER.written_by_slimkv(out)
    assert main(convert_argv(tiny_folder, tmp_path, out, "--seed", "1")) == 2  # the new output would need that name


def test_a_truncated_compressed_model_is_named(tmp_path):
    from slimkv.compress.persist import WEIGHTS_NAME, load, save
    from tests.compress.conftest import char_tokenizer, tiny_model

    model = tiny_model("llama")
    save(model, char_tokenizer(), {"modules": []}, tmp_path / "c")
    weights = tmp_path / "c" / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"the weights in {tmp_path / 'c'} cannot be read .*truncated or damaged"):
        load(tmp_path / "c")


def test_repeated_kind_options_and_set_floats():
    from slimkv.bench.entries import parse_kind_overrides
    from slimkv.train.config import parse_override

    with pytest.raises(ValueError, match=r"--kind-option lrkv.rank is given twice"):
        parse_kind_overrides(["lrkv.rank=2", "lrkv.rank=4"])
    assert parse_override("lr=1e-3") == ("lr", 1e-3)


def test_an_out_below_a_file_is_refused_before_work(tiny_folder, tmp_path, capsys, no_loading):
    (tmp_path / "afile").write_text("x")
    assert main(convert_argv(tiny_folder, tmp_path, tmp_path / "afile" / "out")) == 2
    assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err


def test_eval_json_never_overwrites_a_file_that_is_not_a_report(tmp_path, capsys):
    text = tmp_path / "held.txt"
    text.write_text("the user's text")
    assert main(["eval", "ppl", "--model", str(tmp_path / "none"), "--text", str(text), "--json", str(text)]) == 2
    assert "exists and is not a JSON file" in capsys.readouterr().err and text.read_text() == "the user's text"


def test_eval_cache_checks_the_original_before_loading_anything(tiny_folder, tmp_path, monkeypatch):
    import slimkv.eval.cache as cache

    out = tmp_path / "out"
    assert main(convert_argv(tiny_folder, tmp_path, out)) == 0
    tiny_folder.rename(tmp_path / "moved")

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the original was checked")

    monkeypatch.setattr(cache, "load_language_model", refuse)
    with pytest.raises((ValueError, FileNotFoundError), match="original"):
        cache.cache_report(str(out), 64)
