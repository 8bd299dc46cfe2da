"""benchmarks/kvpress_niah.py's pure-python parts: options, the prompts file, the budget mapping,
resuming. The script runs in .venv-kvpress (kvpress needs transformers < 5.3); here, in the main
venv without kvpress, it must import (kvpress, torch and transformers are imported lazily) and
check everything before any model is loaded."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kvpress_niah.py"
OPTIONS = SCRIPT.with_name("kvpress_niah_options.py")  # its pure-Python parts, imported from beside it


@pytest.fixture(scope="module")
def kv():
    spec = importlib.util.spec_from_file_location("kvpress_niah_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        options = sys.modules["kvpress_niah_options"]
        yield types.SimpleNamespace(**{**vars(options), **vars(module)})  # the script and the parts it imports, as one namespace
    finally:
        sys.modules.pop(spec.name, None)


def _all_imports(tree: ast.AST) -> set[str]:
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def _prompt(pid: str = "passkey/1024/0.50/0", context: int = 100, **extra) -> dict:
    return {"id": pid, "task": "passkey", "length": context + 3, "depth": 0.5, "sample": 0, "context_ids": list(range(1, context + 1)),
            "question_ids": [7, 8, 9], "answers": ["68512"], "max_new_tokens": 12, **extra}


def _write(path: Path, prompts: list[dict], fmt: str = "slimkv-niah-prompts/1") -> Path:
    path.write_text(json.dumps({"format": fmt, "model": "smollm2", "tokenizer": "x", "prompts": prompts}))
    return path


def _model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_the_script_imports_without_kvpress_torch_or_slimkv(kv):
    """Module level imports only the standard library: kvpress, torch and transformers are imported
    inside the functions that run the model, and slimkv never (it needs transformers 5.24)."""
    for path in (SCRIPT, OPTIONS):
        tree = ast.parse(path.read_text())
        top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
        assert top <= set(sys.stdlib_module_names) | {"__future__", OPTIONS.stem}, (path.name, top)
        assert "slimkv" not in {n.split(".")[0] for n in _all_imports(tree)}
    assert kv.GENERATIONS_FORMAT == "slimkv-niah-generations/1"
    assert {"none", "streaming_llm", "snapkv", "expected_attention", "knorm"} <= set(kv.PRESSES)


def test_budget_is_the_fraction_kept_and_compression_ratio_the_fraction_removed(kv):
    assert kv.compression_ratio(0.5) == 0.5
    assert kv.compression_ratio(0.25) == 0.75
    assert kv.compression_ratio(0.1) == 0.9
    assert kv.compression_ratio(1.0) == 0.0
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="outside"):
            kv.compression_ratio(bad)


def test_budgets_parse_and_refuse_values_outside_zero_one(kv):
    assert kv.parse_budgets("0.5,0.25") == [0.5, 0.25]
    assert kv.parse_budgets(" 1 ") == [1.0]
    for bad, message in (("0", "outside"), ("1.5", "outside"), ("-0.1", "outside"), ("half", "not a number"), ("", "distinct"), ("0.5,0.5", "distinct")):
        with pytest.raises(ValueError, match=message) as error:
            kv.parse_budgets(bad)
        assert "--budgets" in str(error.value)


def test_presses_list_the_allowed_names_on_a_bad_one_and_always_run_none_first(kv):
    assert kv.parse_presses("snapkv,knorm,snapkv") == ["none", "snapkv", "knorm"]
    assert kv.parse_presses("knorm,none") == ["none", "knorm"]
    with pytest.raises(ValueError) as error:
        kv.parse_presses("snapkv,h2o")
    assert "--presses" in str(error.value) and "'h2o'" in str(error.value)
    assert all(name in str(error.value) for name in kv.PRESSES)
    with pytest.raises(ValueError, match="--presses"):
        kv.parse_presses(" , ")


def test_press_options_default_and_override_with_their_types(kv):
    options = kv.parse_press_options(["snapkv.window_size=32", "expected_attention.use_covariance=false"], ["none", "snapkv", "expected_attention"])
    assert options["snapkv"] == {"window_size": 32, "kernel_size": 5}
    assert options["expected_attention"]["use_covariance"] is False and options["expected_attention"]["n_sink"] == 4
    assert "none" not in options
    for item, message in (("snapkv.window=3", "takes window_size, kernel_size"), ("knorm.x=1", "not among --presses"),
                          ("snapkv.window_size=big", "not an integer"), ("snapkv=3", "PRESS.KEY=VALUE"), ("snapkv.window_size=0", "positive")):
        with pytest.raises(ValueError, match=message) as error:
            kv.parse_press_options([item], ["none", "snapkv"])
        assert "--press-option" in str(error.value)


def test_prompts_file_is_read_and_checked(kv, tmp_path):
    data = kv.read_prompts(_write(tmp_path / "p.json", [_prompt(), _prompt("b")]))
    assert [p["id"] for p in data["prompts"]] == ["passkey/1024/0.50/0", "b"]
    with pytest.raises(ValueError, match="does not exist") as error:
        kv.read_prompts(tmp_path / "missing.json")
    assert "--prompts" in str(error.value)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        kv.read_prompts(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="expected 'slimkv-niah-prompts/1'"):
        kv.read_prompts(_write(tmp_path / "f.json", [_prompt()], fmt="slimkv-niah-generations/1"))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="not a slimkv prompts file"):
        kv.read_prompts(tmp_path / "list.json")
    cases = [([], "no prompts"), ([_prompt(), _prompt()], "repeats"), ([_prompt(context_ids=[])], "context_ids"),
             ([_prompt(question_ids=[1, "2"])], "question_ids"), ([_prompt(context_ids=[1, -2])], "context_ids"),
             ([_prompt(max_new_tokens=0)], "max_new_tokens"), ([{**_prompt(), "id": 3}], "'id'"), (["x"], "not an object")]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            kv.read_prompts(_write(tmp_path / "c.json", prompts))


def test_model_dir_needs_config_and_safetensors(kv, tmp_path):
    assert kv.check_model_dir(_model_dir(tmp_path / "m")) == tmp_path / "m"
    with pytest.raises(ValueError, match="not a folder"):
        kv.check_model_dir(tmp_path / "nowhere")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json") as error:
        kv.check_model_dir(tmp_path / "m")
    assert "--model-dir" in str(error.value)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").unlink()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors"):
        kv.check_model_dir(tmp_path / "m")


def test_the_plan_checks_everything_and_runs_none_then_each_press_at_each_budget(kv, tmp_path):
    prompts = _write(tmp_path / "p.json", [_prompt(), _prompt("b")])
    model = _model_dir(tmp_path / "m")
    base = ["--prompts", str(prompts), "--out", str(tmp_path / "out"), "--model-dir", str(model)]
    plan = kv.make_plan(kv.build_parser().parse_args(base + ["--presses", "snapkv,knorm", "--budgets", "0.5,0.25", "--limit", "1"]))
    assert plan.runs == [("none", None), ("snapkv", 0.5), ("snapkv", 0.25), ("knorm", 0.5), ("knorm", 0.25)]
    assert [p["id"] for p in plan.prompts] == ["passkey/1024/0.50/0"]
    parse = kv.build_parser().parse_args
    with pytest.raises(ValueError, match="--presses snapkv: needs prompts of at least 65"):  # SnapKV's window (64) must fit in the context
        kv.make_plan(parse(base[:1] + [str(_write(tmp_path / "s.json", [_prompt(context=40)]))] + base[2:] + ["--presses", "snapkv"]))
    assert kv.make_plan(parse(base + ["--presses", "snapkv", "--press-option", "snapkv.window_size=16"])).options["snapkv"]["window_size"] == 16
    for extra, message in ((["--threads", "0"], "--threads"), (["--limit", "0"], "--limit"), (["--budgets", "2"], "--budgets")):
        with pytest.raises(ValueError, match=message):
            kv.make_plan(parse(base + extra))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--out"):
        kv.make_plan(parse(base[:2] + ["--out", str(tmp_path / "file")] + base[4:]))


def test_lengths_pick_the_prompts_of_those_lengths_and_name_the_ones_the_file_holds(kv, tmp_path, capsys):
    """--lengths 1024,8128 runs only those prompts of the exported file (the length is context +
    question); a length the file lacks is refused, naming the lengths it has, with exit code 2."""
    prompts = _write(tmp_path / "p.json", [_prompt("a/103/0", context=100), _prompt("a/203/0", context=200), _prompt("a/103/1", context=100),
                                           _prompt("a/303/0", context=300)])
    base = ["--prompts", str(prompts), "--out", str(tmp_path / "out"), "--model-dir", str(_model_dir(tmp_path / "m"))]
    parse = kv.build_parser().parse_args
    assert [p["id"] for p in kv.make_plan(parse(base)).prompts] == ["a/103/0", "a/203/0", "a/103/1", "a/303/0"]
    assert [p["id"] for p in kv.make_plan(parse(base + ["--lengths", "303, 103"])).prompts] == ["a/103/0", "a/103/1", "a/303/0"]
    assert [p["id"] for p in kv.make_plan(parse(base + ["--lengths", "103", "--limit", "1"])).prompts] == ["a/103/0"]
    for lengths, message in (("103,2k", r"--lengths 2048: .*p.json holds no prompts of that length; its lengths are 103, 203, 303"),
                             ("103,abc", "'abc' is not a token count"), ("103,103", "distinct")):
        with pytest.raises(ValueError, match=message):
            kv.make_plan(parse(base + ["--lengths", lengths]))
    assert kv.main(base + ["--lengths", "400"]) == 2
    assert "--lengths 400" in capsys.readouterr().err


def test_main_reports_a_bad_option_by_name_and_exit_code_2(kv, tmp_path, capsys):
    assert kv.main(["--prompts", str(tmp_path / "none.json"), "--out", str(tmp_path / "o"), "--presses", "h2o"]) == 2
    assert "--presses" in capsys.readouterr().err
    assert kv.main(["--prompts", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_outside_the_kvpress_env_the_message_says_how_to_make_it(kv, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress -> ImportError
    with pytest.raises(SystemExit, match="make bench-kvpress-env"):
        kv.import_kvpress()
    namespace = types.ModuleType("kvpress")
    namespace.__path__ = [str(SCRIPT.parent / "kvpress")]  # what `import kvpress` finds from benchmarks/ without the package
    monkeypatch.setitem(sys.modules, "kvpress", namespace)
    with pytest.raises(SystemExit, match="not installed.*make bench-kvpress-env"):
        kv.import_kvpress()


def test_result_files_labels_and_budget_notes(kv):
    assert kv.result_name("none", None) == "none.json"
    assert kv.result_name("snapkv", 0.5) == "snapkv_budget0.5.json"
    assert kv.result_name("knorm", 0.25, compress_question=True) == "knorm_budget0.25_qctx.json"
    assert kv.label("snapkv", 0.5) == "kvpress snapkv budget 0.5"
    assert "question and generated tokens are appended" in kv.budget_note("snapkv", False)
    assert kv.min_context_tokens("streaming_llm", {"n_sink": 4}) == 5


def test_atomic_write_and_resume(kv, tmp_path):
    header = {"format": kv.GENERATIONS_FORMAT, "press": "snapkv", "press_options": {"window_size": 64}, "cache_budget": 0.5,
              "compress_question": False, "prompts_digest": "abc", "model_config_digest": "def"}
    path = tmp_path / "out" / "snapkv_budget0.5.json"
    assert kv.previous_generations(path, header) == ([], 0.0, False)
    kv.atomic_write_json(path, {**header, "seconds": 3.0, "complete": False, "generations": [{"id": "a"}]})
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    assert kv.previous_generations(path, header) == ([{"id": "a"}], 3.0, False)
    kv.atomic_write_json(path, {**header, "seconds": 5.0, "complete": True, "generations": [{"id": "a"}, {"id": "b"}]})
    assert kv.previous_generations(path, header)[2] is True
    with pytest.raises(ValueError, match="prompts_digest differ"):
        kv.previous_generations(path, {**header, "prompts_digest": "other"})


def test_the_prompts_digest_follows_what_the_model_sees(kv):
    a, b = _prompt(), _prompt()
    assert kv.prompts_digest([a]) == kv.prompts_digest([b])
    assert kv.prompts_digest([a]) == kv.prompts_digest([{**b, "answers": ["other"]}])
    assert kv.prompts_digest([a]) != kv.prompts_digest([{**b, "max_new_tokens": 5}])
