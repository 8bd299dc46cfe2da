"""Long-context retrieval prompts and their evaluation on pretrained-format models
(``slimkv.retrieval.prompts``, ``slimkv.retrieval.models``, ``slimkv eval niah --model``), on a tiny local
Llama with a character tokenizer (no downloads)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slimkv.cli import main
from slimkv.pretrained import weights_fingerprint
from slimkv.retrieval import models as retrieval
from slimkv.retrieval.prompts import TASKS, PromptBuilder, parse_tasks
from tests.compress.conftest import HELD_OUT_LINES, char_tokenizer, tiny_config

PROSE = "".join(f"Line {i} of the haystack: {HELD_OUT_LINES}" for i in range(40))


@pytest.fixture
def builder():
    return PromptBuilder(char_tokenizer(), PROSE)


@pytest.fixture
def tiny_folder(tmp_path):
    """A tiny random Llama (1024 positions) with the character tokenizer, and a prose file."""
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    folder = tmp_path / "tiny-llama"
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (tmp_path / "prose.txt").write_text(PROSE)
    return folder


@pytest.mark.parametrize("task", list(TASKS))
def test_prompts_have_the_exact_length_and_hold_their_answers_on_lines_of_their_own(builder, task):
    for depth in (0.0, 0.5, 1.0):
        prompt = builder.build(TASKS[task], 700, depth, sample=0, seed=0)
        assert len(prompt.ids) == 700
        text = builder.tokenizer.decode(prompt.context_ids)
        for answer in prompt.answers:
            line = next(line for line in text.split("\n") if answer in line)
            assert line.startswith(("The pass key", "One of the special magic"))  # the needle is a whole line
        assert prompt.question_ids == builder.encode(builder.tokenizer.decode(prompt.question_ids))
        assert prompt.max_new_tokens > len(builder.encode(" " + ", ".join(prompt.answers)))


def test_only_the_needle_moves_across_depths_and_samples_differ(builder):
    task = TASKS["needle-number"]
    shallow, deep = (builder.build(task, 600, d, sample=3, seed=1) for d in (0.0, 1.0))
    assert shallow.answers == deep.answers and shallow.depth_actual < 0.1 < 0.9 < deep.depth_actual
    assert sorted(shallow.context_ids) == sorted(deep.context_ids)  # the same tokens, the needle elsewhere
    assert builder.build(task, 600, 0.0, sample=4, seed=1).answers != shallow.answers
    assert builder.build(task, 600, 0.0, sample=3, seed=1).ids == shallow.ids  # deterministic


def test_multi_needle_tasks(builder):
    multivalue = builder.build(TASKS["multivalue"], 900, 0.3, sample=0, seed=0)
    assert len(set(multivalue.answers)) == 4
    text = builder.tokenizer.decode(multivalue.context_ids)
    keys = {line.split(" for ")[1].split(" is:")[0] for line in text.split("\n") if line.startswith("One of the special")}
    assert len(keys) == 1  # one key, four values
    multikey = builder.build(TASKS["multikey"], 900, 0.3, sample=0, seed=0)
    text = builder.tokenizer.decode(multikey.context_ids)
    needles = [line for line in text.split("\n") if line.startswith("One of the special")]
    assert len(needles) == 4 and len({n.split(" for ")[1].split(" is:")[0] for n in needles}) == 4
    assert len(multikey.answers) == 1


def test_bad_options_name_themselves(builder):
    with pytest.raises(ValueError, match="--lengths 100 is too short for task passkey"):
        builder.build(TASKS["passkey"], 100, 0.5, sample=0, seed=0)
    with pytest.raises(ValueError, match="allowed values: passkey"):
        parse_tasks("passkey,haystack")
    with pytest.raises(ValueError, match="--lengths"):
        retrieval.parse_lengths("1k,abc")
    assert retrieval.parse_lengths("1k, 2048") == [1024, 2048]
    with pytest.raises(ValueError, match="--depths"):
        retrieval.parse_depths("0.5,1.5")


def test_scoring_and_the_interval():
    assert retrieval.score_output(["1234567"], "The number is 1234567.") == 1.0
    assert retrieval.score_output(["1234567"], "12345678") == 0.0  # not a piece of a longer number
    assert retrieval.score_output(["11", "22", "33", "44"], "11, 33 and 99") == 0.5
    low, high = retrieval.wilson(6, 6)
    assert 0.6 < low < 0.7 and high == pytest.approx(1.0)
    low, high = retrieval.wilson(1, 6)
    assert 0.0 < low < 0.05 and 0.55 < high < 0.6


def test_evaluate_writes_resumes_and_refuses_other_settings(tiny_folder, tmp_path, monkeypatch):
    out = tmp_path / "niah"
    options = {"tasks": [TASKS["passkey"], TASKS["needle-word"]], "lengths": [400, 600], "depths": [0.0, 1.0], "samples": 2, "haystack": str(tmp_path / "prose.txt"),
               "out_dir": out, "progress": False, "export_prompts": True}
    report = retrieval.evaluate(str(tiny_folder), **options)
    assert set(report["cells"]) == {f"{t}/{n}/{d:.2f}" for t in ("passkey", "needle-word") for n in (400, 600) for d in (0.0, 1.0)}
    for name in (retrieval.RESULT_FILE, retrieval.TABLE_FILE, retrieval.PLOT_FILE, retrieval.PROMPTS_FILE):
        assert (out / name).is_file()
    cell = report["cells"]["passkey/400/0.00"]
    assert len(cell["outputs"]) == 2 and cell["score"] == np.mean([retrieval.score_output(a, o) for a, o in zip(cell["answers"], cell["outputs"])])
    assert report["cache"]["400"]["bytes_per_token"] == 2 * 2 * 12 * 2 * 4  # k and v, 2 kv heads x 12, 2 layers, float32
    prompts = json.loads((out / retrieval.PROMPTS_FILE).read_text())
    assert prompts["format"] == retrieval.PROMPTS_FORMAT and len(prompts["prompts"]) == 16
    assert all(len(p["context_ids"]) + len(p["question_ids"]) == p["length"] for p in prompts["prompts"])

    def no_generation(*args, **kwargs):
        raise AssertionError("a finished cell was run again")

    monkeypatch.setattr(retrieval, "generate", no_generation)
    assert retrieval.evaluate(str(tiny_folder), **options)["cells"] == report["cells"]  # resumed: nothing to run
    with pytest.raises(ValueError, match="another model or other options"):
        retrieval.evaluate(str(tiny_folder), **{**options, "samples": 3})
    monkeypatch.undo()
    grown = retrieval.evaluate(str(tiny_folder), **{**options, "lengths": [400, 500]})  # one more length: only its cells run
    assert {k: grown["cells"][k] for k in report["cells"]} == report["cells"] and "passkey/500/0.00" in grown["cells"]
    assert list(grown["summary"]["passkey"]) == ["400", "500"]


def test_a_resume_matches_the_weights_by_folder_and_content(tiny_folder, tmp_path, monkeypatch):
    """The fingerprint holds the weights (resolved folder + sha256 of the safetensors), not the
    spelling of --model: the same folder named another way resumes; other weights saved at the
    same path are refused."""
    out = tmp_path / "niah"
    options = {"tasks": [TASKS["passkey"]], "lengths": [400], "depths": [0.5], "samples": 1, "haystack": str(tmp_path / "prose.txt"),
               "out_dir": out, "progress": False}
    report = retrieval.evaluate(str(tiny_folder), **options)
    assert report["settings"]["weights"] == {"path": str(tiny_folder.resolve()), "sha256": weights_fingerprint(tiny_folder)}
    monkeypatch.chdir(tiny_folder.parent)
    monkeypatch.setattr(retrieval, "generate", lambda *a, **k: pytest.fail("a finished cell was run again"))
    assert retrieval.evaluate(f"./{tiny_folder.name}/", **options)["cells"] == report["cells"]
    torch.manual_seed(1)
    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tiny_folder)  # other weights, the same path
    with pytest.raises(ValueError, match=r"another model or other options \(they differ in: weights\)"):
        retrieval.evaluate(str(tiny_folder), **options)


def test_lengths_past_the_positions_are_refused_before_any_work(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(retrieval, "generate", lambda *a, **k: pytest.fail("generated"))
    for lengths, message in (([512, 2048], r"--lengths 2048: a prompt and its answer \(up to \d+ new tokens\) run past this model's positions "
                                                r"\(max_position_embeddings=1024\); use lengths <= \d+"),
                             ([1024], r"--lengths 1024: a prompt and its answer")):  # the answer itself must fit too
        with pytest.raises(ValueError, match=message):
            retrieval.evaluate(str(tiny_folder), tasks=[TASKS["passkey"]], lengths=lengths, depths=[0.5], samples=1, out_dir=tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_default_lengths_leave_room_for_the_answer():
    class Model:
        class config:  # noqa: N801 (a stand-in for a transformers config)
            max_position_embeddings = 8192

    assert retrieval.default_lengths(Model) == [1024, 2048, 4096, 8192 - retrieval.ANSWER_ROOM]
    Model.config.max_position_embeddings = 32768
    assert retrieval.default_lengths(Model) == [1024, 2048, 4096, 8192]


def test_cli(tiny_folder, tmp_path, capsys):
    for argv, message in ((["runs/x", "--model", str(tiny_folder)], "either RUN_DIR"), (["--model", str(tiny_folder)], "--out DIR is required"),
                          (["--model", str(tiny_folder), "--tasks", "s1", "--out", str(tmp_path / "o")], "allowed values: passkey")):
        assert main(["eval", "niah", *argv]) != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["eval", "niah", "--model", str(tiny_folder), "--tasks", "passkey", "--lengths", "400", "--depths", "0.5", "--samples", "1",
                 "--haystack", str(tmp_path / "prose.txt"), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    assert "passkey" in capsys.readouterr().out
