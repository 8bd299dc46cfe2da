"""kvpress presses as ``slimkv eval ruler`` cache options (``slimkv.eval.ruler_press``, the runner
``slimkv/eval/ruler_press_runner.py``): option parsing and checks, the missing environment, the
parent's summary of a press cell (with the runner stood in for), the runner's equal-bytes ratio,
and one real cell through kvpress's environment where it exists (``make bench-kvpress-env``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimkv.data.austen import austen_dir
from slimkv.eval import ruler, ruler_cache, ruler_press
from tests.eval.test_ruler import HAS_LM_EVAL, lm_eval_shaped, tiny_folder  # noqa: F401  (tiny_folder is a fixture)

HAS_PRESS_ENV = ruler_press.env_problem() is None


def load_runner():
    """``ruler_press_runner.py`` loaded by path, as kvpress's python runs it."""
    spec = importlib.util.spec_from_file_location("ruler_press_runner_test", ruler_press.RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_press_options_parse_to_one_spelling():
    assert ruler_cache.parse_caches("none, press:kvzip@.25,press:tova@0.125") == ["none", "press:kvzip@0.25", "press:tova@0.125"]
    assert ruler_press.parse_option("kvpress:adakv_snapkv@0.5") == ("adakv_snapkv", 0.5)
    with pytest.raises(ValueError, match="distinct"):
        ruler_cache.parse_caches("press:kvzip@0.25,press:kvzip@.250")


@pytest.mark.parametrize(("text", "message"), [
    ("press:zip@0.25", r"--caches press:zip@0.25: unknown press 'zip'.*allowed presses: streaming_llm, snapkv, .*kvzip, duo_attention"),
    ("press:kvzip", "the budget after @ must be a number in .0, 1."),
    ("press:kvzip@1", "budget 1 is outside .0, 1."),
    ("press:tova@0", "budget 0 is outside"),
    ("press:duo_attention_patterns@0.5", "pre-computed patterns are downloaded.*offline: use press:duo_attention"),
    ("kvzip", "a kvpress press is written press:NAME@BUDGET.*allowed presses: .*kvzip"),
    ("pressure", "press:NAME@BUDGET"),
])
def test_bad_press_options_name_the_option_and_the_allowed_presses(text, message):
    with pytest.raises(ValueError, match=message):
        ruler_cache.parse_caches(f"none,{text}")


def test_duo_attention_budget_must_clear_its_streaming_window():
    ruler_press.check_budget("press:duo_attention@0.25", 2048)
    ruler_press.check_budget("press:kvzip@0.01", 2048)
    with pytest.raises(ValueError, match=r"press:duo_attention@0.125 at --lengths 2048: .*128 sink \+ 256 recent.*about 0.19"):
        ruler_press.check_budget("press:duo_attention@0.125", 2048)


def test_settings_record_the_press_its_scorer_and_storage():
    record = ruler_cache.option_settings("press:adakv_expected_attention@0.25")["press"]
    assert record["class"] == "AdaKVPress" and record["scorer"]["class"] == "ExpectedAttentionPress" and record["masked"]
    assert record["budget_of_bf16_original"] == 0.25 and record["store_dtype"] == "bfloat16"
    assert ruler_cache.option_settings("press:duo_attention@0.5")["press"]["pattern_texts"]["corpus"] == "austen"
    assert not ruler_cache.option_settings("press:snapkv@0.5")["press"]["masked"]


def test_a_missing_kvpress_env_is_refused_before_any_model_loads(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(ruler_press.ENV_VARIABLE, str(tmp_path / "no-venv" / "bin" / "python"))
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    monkeypatch.setattr(ruler, "load_language_model", lambda *_: pytest.fail("the model loaded before the environment was checked"))
    with pytest.raises(ImportError, match=r"--caches press:tova@0.25: .*no-venv/bin/python does not exist; run `make bench-kvpress-env`"):
        ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["none", "press:tova@0.25"], limit=1, out_dir=tmp_path / "o",
                       progress=False, say=lambda _: None)
    ruler_press.check_env(["none", "bfloat16"])  # no press: nothing to check


def test_a_press_cell_is_summarized_with_the_bytes_attention_still_sees(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    monkeypatch.setattr(ruler_press, "check_env", lambda options: None)
    reference = 2 * 2 * 64 * 2  # the tiny Llama's bfloat16 bytes per token: 2 layers, K and V, one head of 64
    requests: list = []

    def fake_runner(request, log_path=None, timeout_s=None, on_log=None):
        requests.append(request)
        on_log("Running generate_until requests:  50%|#####     | 1/2 [00:01<00:01,  1.00s/it]")  # what lm-eval prints: the prompts bar moves
        cell_dir = Path(request["cell_dir"])
        values = [float(i % 2 == 0) for i in range(request["first"], request["limit"])]
        results, samples = lm_eval_shaped(request["task"], request["length"], values)
        (cell_dir / "lm_eval_t.json").write_text(json.dumps(results))
        (cell_dir / "samples_t.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        prompt = {"bytes_per_token": reference, "bytes_per_token_kept": reference / 4, "bytes_per_token_after_decode": reference,
                  "bytes_per_token_kept_after_decode": reference / 3, "tail_tokens": 30, "prompt_tokens": 900, "prefill_s": 1.0}
        return {"results": str(cell_dir / "lm_eval_t.json"), "samples": str(cell_dir / "samples_t.jsonl"), "generate_s": 4.0, "prompts": [prompt] * len(values),
                "runner_versions": {"kvpress": "0.5.5", "transformers": "5.2.0"}, "runner_python": "/env/python", "threads": 1}
    monkeypatch.setattr(ruler_press, "call_runner", fake_runner)
    out = tmp_path / "o"
    said: list[str] = []
    report = ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["press:kvzip@0.25"], limit=2, out_dir=out,
                            progress=False, say=said.append)
    assert any("1 to run, 1 cell(s) not timed (" in line for line in said)  # an untimed press is not "0.0 min"
    assert [r["mode"] for r in requests] == ["cell"] and requests[0]["option"] == "press:kvzip@0.25" and requests[0]["dtype"] == "float32"
    assert requests[0]["first"] == 0 and Path(requests[0]["patterns_dir"]) == (out / "press_patterns").resolve()
    row = report["cells"]["press:kvzip@0.25/niah_single_1/1024"]
    assert row["score"] == 0.5 and row["n"] == 2 and row["full"] == 1
    assert row["bytes_ratio_to_bf16_original"] == pytest.approx(0.25) and row["bytes_ratio_live"] == pytest.approx(1.0)
    assert row["question_tail_tokens_mean"] == 30 and row["runner"] == "kvpress env"
    cell = json.loads((out / "cells" / "press:kvzip@0.25" / "niah_single_1" / "1024" / ruler.CELL_FILE).read_text())
    assert cell["machine"]["press_runner"]["packages"]["kvpress"] == "0.5.5" and "git_commit" in cell["machine"]
    assert cell["settings"]["press"]["class"] == "KVzipPress" and len(cell["probe"]["prompts"]) == 2
    requests.clear()
    ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["press:kvzip@0.25"], limit=2, out_dir=out, progress=False,
                   say=lambda _: None)
    assert requests == []  # finished: skipped
    row = ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["press:kvzip@0.25"], limit=3, out_dir=out, progress=False,
                         say=lambda _: None)["cells"]["press:kvzip@0.25/niah_single_1/1024"]
    assert [(r["first"], r["limit"], Path(r["cell_dir"]).name) for r in requests] == [(2, 3, "prompts-2-2")]  # only the new prompt
    assert row["n"] == 3 and row["full"] == 2 and row["bytes_ratio_to_bf16_original"] == pytest.approx(0.25)
    cell = json.loads((out / "cells" / "press:kvzip@0.25" / "niah_single_1" / "1024" / ruler.CELL_FILE).read_text())
    assert len(cell["probe"]["prompts"]) == 3 and cell["machine"]["earlier_parts"][0]["press_runner"]["packages"]["kvpress"] == "0.5.5"


def test_lm_eval_progress_lines_give_the_prompts_done():
    chunk = ("Running generate_until requests:   0%|          | 0/40 [00:00<?, ?it/s]\rRunning generate_until requests:  38%|###8      | "
             "15/40 [03:08<06:02, 14.51s/it]\rRunning generate_until requests:  40%|####      | 16/40 [03:20<05:29, 13.73s/it]")
    assert ruler.prompts_done(chunk) == 16
    assert ruler.prompts_done("Building contexts for niah_single_1 on rank 0...\n100%|##########| 40/40 [00:02<00:00]") is None


@pytest.mark.parametrize("outcome", ["reply", "fails", "hangs"])
def test_the_runner_call_relays_its_output_and_reports_failures(tmp_path, monkeypatch, outcome):
    """call_runner hands the runner's output on as it comes (the prompts bar), returns its reply, and
    on a failure or past ``timeout_s`` says so with the end of its log."""
    import subprocess

    script = tmp_path / "runner.py"
    script.write_text("import json, sys, time\n"
                      "print('Running generate_until requests:  50%|#    | 1/2 [00:01<00:01]', flush=True)\n"
                      f"time.sleep({3 if outcome == 'hangs' else 1.2})\n"
                      + ("sys.exit('the press broke')\n" if outcome == "fails" else "json.dump({'ok': 1}, open(sys.argv[2], 'w'))\n"))
    monkeypatch.setattr(ruler_press, "RUNNER", script)
    monkeypatch.setattr(ruler_press, "env_python", lambda: Path(sys.executable))
    heard: list[str] = []
    call = lambda: ruler_press.call_runner({"mode": "cell", "option": "press:tova@0.5"}, log_path=tmp_path / "runner.log",  # noqa: E731
                                           timeout_s=1.5 if outcome == "hangs" else None, on_log=heard.append)
    if outcome == "reply":
        assert call() == {"ok": 1}
        assert ruler.prompts_done("".join(heard)) == 1
    elif outcome == "fails":
        with pytest.raises(RuntimeError, match="(?s)exit code 1.*press:tova@0.5.*the press broke"):
            call()
    else:
        with pytest.raises(subprocess.TimeoutExpired):
            call()


def test_a_runner_whose_parent_is_killed_stops(tmp_path):
    """exit_with_parent: a press runner whose ``slimkv eval ruler`` got SIGKILL (no clean-up ran) ends
    too, instead of computing a cell nobody reads."""
    import os
    import signal
    import subprocess
    import time

    module = Path(ruler_press.__file__)
    child = (f"import importlib.util, sys, time; s = importlib.util.spec_from_file_location('p', {str(module)!r}); "  # as the runner loads it
             "m = sys.modules['p'] = importlib.util.module_from_spec(s); s.loader.exec_module(m); m.exit_with_parent(0.05); "
             "print('watching', flush=True); time.sleep(60)")
    parent = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              "print(c.pid, flush=True); time.sleep(60)")
    started = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child_pid = int(started.stdout.readline())
    assert started.stdout.readline().strip() == "watching"  # the child runs, its watch started
    started.send_signal(signal.SIGKILL)
    started.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:  # an exited child not yet reaped by init is a zombie
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"

    deadline = time.monotonic() + 10
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(child_pid)
    if survived:
        os.kill(child_pid, signal.SIGKILL)
    assert not survived


def test_duo_attention_texts_are_fetched_before_any_cell(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    """DuoAttention's on-the-fly pattern is scored on Austen's chapters in the runner: a machine
    without them fetches them first (and an offline one fails then, not after the other cells ran)."""
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    monkeypatch.setattr(ruler_press, "check_env", lambda options: None)
    calls: list = []
    monkeypatch.setattr(ruler_press, "call_runner", lambda *a, **k: calls.append("runner"))

    def offline():
        calls.append("fetch")
        raise RuntimeError("the austen package could not be downloaded")
    monkeypatch.setattr(ruler, "fetch_austen", offline)
    with pytest.raises(RuntimeError, match="austen"):
        ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["press:tova@0.5", "press:duo_attention@0.5"], limit=2,
                       out_dir=tmp_path / "o", progress=False, say=lambda _: None)
    assert calls == ["fetch"]
    assert austen_dir().name == ruler_press.DUO_TEXTS  # what is fetched is the folder the runner reads (texts/<DUO_TEXTS>)


def test_the_runner_sets_the_ratio_for_equal_bytes_with_the_question_tail():
    runner = load_runner()
    press = SimpleNamespace(compression_ratio=0.0)
    fraction = runner.set_budget(press, "snapkv", 0.25, context=1900, tail=100, heads=90)
    assert fraction == pytest.approx((0.25 * 2000 - 100) / 1900) and press.compression_ratio == pytest.approx(1 - fraction)
    duo = SimpleNamespace(head_compression_ratio=0.0)
    runner.set_budget(duo, "duo_attention", 0.25, context=1950, tail=50, heads=90)
    kept = 1 - duo.head_compression_ratio * (1 - ruler_press.DUO_KEPT / 1950)  # retrieval heads keep all, streaming heads 384
    assert kept == pytest.approx((0.25 * 2000 - 50) / 1950, abs=1 / 90)
    with pytest.raises(SystemExit, match="the question alone"):
        runner.set_budget(press, "tova", 0.01, context=1000, tail=50, heads=90)


@pytest.mark.skipif(not HAS_PRESS_ENV, reason=f"kvpress's environment is absent ({ruler_press.env_problem()}): {ruler_press.ENV_TARGET}")
@pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-eval not installed here: make ruler-env, run from .venv-ruler")
def test_real_press_cells_through_kvpress_env(tiny_folder, tmp_path):  # noqa: F811
    report = ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["press:snapkv@0.5", "press:adakv_snapkv@0.5"], limit=1,
                            max_gen_toks=4, out_dir=tmp_path / "o", progress=False, say=lambda _: None)
    for option in ("press:snapkv@0.5", "press:adakv_snapkv@0.5"):
        row = report["cells"][f"{option}/niah_single_1/1024"]
        assert row["n"] == 1 and 0.0 <= row["score"] <= 1.0 and (tmp_path / "o" / row["lm_eval_samples"]).is_file()
        assert row["bytes_ratio_to_bf16_original"] == pytest.approx(0.5, abs=0.01)  # equal bytes, the question tail counted
    assert report["cells"]["press:adakv_snapkv@0.5/niah_single_1/1024"]["bytes_ratio_live"] == pytest.approx(1.0)  # AdaKV masks, keeps every entry
    assert report["cells"]["press:snapkv@0.5/niah_single_1/1024"]["bytes_ratio_live"] == pytest.approx(0.5, abs=0.01)
