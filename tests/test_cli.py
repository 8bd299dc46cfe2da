"""The ``slimkv`` command line: --help everywhere, and train/eval/generate end to end on a tiny run."""

from __future__ import annotations

import argparse
import json

import pytest

from slimkv.cli import build_parser, main
from slimkv.cli.eval import EVAL_TASKS
from tests.train.tiny import tiny_cache, tiny_config, tiny_env  # noqa: F401  (fixtures)


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and nested sub-command of ``parser`` (so commands added later are covered)."""
    paths = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append((*prefix, name))
                paths.extend(command_paths(sub, (*prefix, name)))
    return paths


COMMANDS = command_paths(build_parser())


def test_the_commands_of_this_issue_exist():
    assert {("train",), ("eval",), ("generate",), ("demo",)} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_works_for_every_command(path, capsys):
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_eval_help_shows_both_forms_and_each_task_help(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "slimkv eval RUN_DIR" in text and all(task in text for task in EVAL_TASKS)
    with pytest.raises(SystemExit) as done:
        main(["eval", "some_run", "--help"])
    assert done.value.code == 0 and "--max-tokens" in capsys.readouterr().out
    for task in EVAL_TASKS:
        with pytest.raises(SystemExit) as done:
            main(["eval", task, "--help"])
        assert done.value.code == 0 and f"slimkv eval {task}" in capsys.readouterr().out


def tiny_flags(**changes) -> list[str]:
    """--set flags for every option of the tiny recipe."""
    return [f"--set={k}={json.dumps(v)}" for k, v in tiny_config(**changes).to_dict().items()]


def test_train_eval_generate_resume_end_to_end(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    flags = tiny_flags(attention="mqa", steps=3)
    assert main(["train", *flags, "--out", run_dir, "--no-progress"]) == 0
    assert "finished 3 steps" in capsys.readouterr().out

    assert main(["train", *flags, "--out", run_dir]) == 2
    assert "is not empty: continue that run with --resume, or choose another --out" in capsys.readouterr().err
    assert main(["train", *flags, "--set", "steps=5", "--out", run_dir, "--resume"]) == 2  # --set wins over earlier ones
    assert "different configuration:\n  steps: stored 3, requested 5" in capsys.readouterr().err
    assert main(["train", "--out", run_dir, "--resume", "--no-progress"]) == 0  # stored options; already finished

    assert main(["eval", run_dir, "--max-tokens", "64", "--no-progress"]) == 0
    assert "ratio to MHA 0.250" in capsys.readouterr().out  # 1 of 4 K/V heads
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["val_tokens"] == 64

    assert main(["generate", run_dir, "--prompt", "KING: the", "--max-new-tokens", "5", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("KING: the") and len(first.strip()) > len("KING: the")
    assert main(["generate", run_dir, "--prompt", "KING: the", "--max-new-tokens", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out == first


def test_divergence_exits_non_zero_with_a_clear_message(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", *tiny_flags(warmup_steps=0, checkpoint_every=1, lr=1e30), "--out", str(run_dir), "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert "training diverged at step" in err and "is intact" in err
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"


def test_bad_options_are_clean_errors(tmp_path, capsys):
    assert main(["train", "--set", "stpes=3", "--out", str(tmp_path / "a")]) == 2
    assert "did you mean steps" in capsys.readouterr().err
    assert main(["train", "--attention", "gqa", "--out", str(tmp_path / "b")]) == 2
    assert "n_kv_heads" in capsys.readouterr().err
    assert main(["train", "--set", "dataset=missing", "--out", str(tmp_path / "c")]) == 2
    assert "slimkv data prepare" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "is not a training run" in capsys.readouterr().err
