"""Bad input and faults around training runs: every one gets a clear error naming the culprit,
nothing a user wrote is lost, and no half-finished state is left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slimkv.cli import main
from slimkv.common.files import FolderBusyError, folder_lock
from slimkv.model import load_model_folder
from slimkv.train import load_run, train
from tests.train.tiny import tiny_config


def flags(**changes) -> list[str]:
    return [f"--set={k}={json.dumps(v)}" for k, v in tiny_config(**changes).to_dict().items()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_cache):
    """A finished 3-step run (checkpoint and model/ written)."""
    run_dir = tmp_path_factory.mktemp("runs") / "done"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIMKV_CACHE", str(tiny_cache))
        train(tiny_config(steps=3, checkpoint_every=3, eval_every=3), run_dir, progress=False)
    return run_dir


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target


def test_a_second_process_cannot_train_into_a_busy_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with folder_lock(run_dir, "training run"):  # another process is training there
        with pytest.raises(FolderBusyError, match="in use by another slimkv training run"):
            train(tiny_config(steps=2), run_dir, progress=False)
        assert main(["train", *flags(steps=2), "--out", str(run_dir), "--no-progress"]) == 2
        assert "in use by another slimkv training run" in capsys.readouterr().err
        assert list(run_dir.iterdir()) == []  # nothing was written beside the other run
    assert train(tiny_config(steps=2), run_dir, progress=False)["status"] == "finished"  # free again


def test_resume_without_a_checkpoint_is_an_error_and_loses_nothing(finished_run, tmp_path, capsys):
    run_dir = copy_run(finished_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoint")
    model_before = (run_dir / "model" / "model.safetensors").read_bytes()
    assert main(["train", "--out", str(run_dir), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "model/" in err and "without --resume" in err
    assert (run_dir / "model" / "model.safetensors").read_bytes() == model_before
    assert main(["train", "--out", str(tmp_path / "never"), "--resume"]) == 2
    assert "is not a training run" in capsys.readouterr().err


def test_a_failed_setup_leaves_no_half_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *flags(dataset="missing"), "--out", str(run_dir), "--no-progress"]) == 2
    assert "slimkv data prepare" in capsys.readouterr().err
    assert not (run_dir / "train_config.json").exists()
    assert main(["train", *flags(steps=2), "--out", str(run_dir), "--no-progress"]) == 0  # no rm -r needed


def test_edited_model_config_is_refused(finished_run, tmp_path):
    for change in ({"n_layers": 3}, {"attention": "swa", "attention_options": {"window": 4}}):
        run_dir = copy_run(finished_run, tmp_path / str(len(change)))
        path = run_dir / "model" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
        with pytest.raises(ValueError, match="does not describe the model this run trained|do not fit config.json"):
            load_run(run_dir)


def test_missing_or_unexpected_weights_are_refused(finished_run, tmp_path):
    folder = copy_run(finished_run, tmp_path) / "model"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layers": 3}))
    with pytest.raises(ValueError, match=r"weights do not fit config.json \(missing"):
        load_model_folder(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model_folder(folder)
    from slimkv import SlimKVForCausalLM

    with pytest.raises(FileNotFoundError, match="has no config.json"):
        SlimKVForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("where", ["checkpoint/model.safetensors", "checkpoint/optimizer.safetensors", "model/model.safetensors"])
def test_truncated_safetensors_name_the_file(finished_run, tmp_path, capsys, where):
    run_dir = copy_run(finished_run, tmp_path)
    path = run_dir / where
    path.write_bytes(path.read_bytes()[:200])
    if where.startswith("checkpoint"):
        cfg = tiny_config(steps=5, checkpoint_every=3, eval_every=3)
        (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict()))
        (run_dir / "checkpoint" / "state.json").write_text(json.dumps({**json.loads((run_dir / "checkpoint" / "state.json").read_text()), "config": cfg.to_dict()}))
        code = main(["train", "--out", str(run_dir), "--resume", "--no-progress"])
    else:
        code = main(["eval", str(run_dir), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and (where.split("/")[-1] in err or str(run_dir / "model") in err), err


@pytest.mark.parametrize("content, message", [("[1, 2]", "holds a JSON list, expected a JSON object"), ('{"step": 3,\n', "is not valid JSON")])
def test_damaged_state_json_names_the_file(finished_run, tmp_path, capsys, content, message):
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "checkpoint" / "state.json").write_text(content)
    cfg = tiny_config(steps=5, checkpoint_every=3, eval_every=3)
    (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["train", "--out", str(run_dir), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "state.json" in err and message in err


def test_an_edited_step_is_refused(finished_run, tmp_path, capsys):
    run_dir = copy_run(finished_run, tmp_path)
    cfg = tiny_config(steps=5, checkpoint_every=3, eval_every=3)
    (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    for step, message in ((1, "optimizer state was saved at step"), (9, "past the run's 5 steps"), ("3", "must be an integer")):
        (run_dir / "checkpoint" / "state.json").write_text(json.dumps({**state, "config": cfg.to_dict(), "step": step}))
        assert main(["train", "--out", str(run_dir), "--resume", "--no-progress"]) == 2
        assert message in capsys.readouterr().err


def test_out_that_is_a_file_is_refused_everywhere(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("mine")
    for argv in (["train", *flags(steps=2), "--out", str(target)],
                 ["compare", "--kinds", "mha", "--out", str(target)],
                 ["demo", "--out", str(target), "--no-compression"],
                 ["compress", "--model", "smollm2", "--method", "svd", "--ratio", "0.2", "--out", str(target)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "is a file" in err and "Traceback" not in err, (argv, err)
    assert target.read_text() == "mine"


def test_eval_and_generate_options_are_checked(finished_run, capsys):
    for argv, message in (
        (["eval", str(finished_run), "--batch-size", "-1"], "--batch-size must be an integer >= 1"),
        (["eval", str(finished_run), "--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (["generate", str(finished_run), "--prompt", "abc\udcff"], "--prompt is not valid UTF-8"),
        (["generate", str(finished_run), "--prompt", "KING", "--max-new-tokens", "1000000000"], "--max-new-tokens must be an integer >= 1 and <= 100000"),
    ):
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err


def test_yaml_tags_and_bad_files_name_the_file(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("steps: !!python/object/apply:os.system ['echo hi']\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "safe YAML" in err and "Traceback" not in err
