"""``slimkv eval ruler`` (``slimkv.eval.ruler``, ``slimkv.eval.ruler_cache``, ``slimkv.cli.ruler``)
without lm-eval: option checks, the planner, the summary of lm-eval-shaped results, resume, and
the live cache bytes of the cache options on tiny random models. One test runs the real lm-eval
path where lm-eval is installed (.venv-ruler)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.cli.ruler import add_ruler_command
from slimkv.eval import ruler, ruler_cache, ruler_offline, ruler_press, ruler_report
from tests.compress.conftest import char_tokenizer

HAS_LM_EVAL = all(importlib.util.find_spec(m) is not None for m in ("lm_eval", "wonderwords", "nltk"))
# lm-eval and its RULER extras are an optional environment, not slimkv's test dependencies (CI's .venv has none of them)
NO_LM_EVAL = "lm-eval, wonderwords and nltk are not installed here: make ruler-env, then .venv-ruler/bin/python -m pytest tests/eval/test_ruler.py"
HAS_BACKEND = {"quanto": importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None,
               "hqq": importlib.util.find_spec("hqq") is not None}
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 64


def tiny_llama(positions: int = 2048) -> torch.nn.Module:
    """A 2-layer Llama, one KV head of 64 channels (quanto's group of 64 divides it), 99 tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=99, hidden_size=128, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=positions, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_tasks_refuse_hub_and_unknown_names():
    assert ruler_offline.parse_tasks("niah_single_1, ruler_vt") == ["niah_single_1", "ruler_vt"]
    with pytest.raises(ValueError, match="--tasks niah_single_2: its haystack is Paul Graham's essays"):
        ruler_offline.parse_tasks("niah_single_1,niah_single_2")
    with pytest.raises(ValueError, match="--tasks ruler_qa_squad"):
        ruler_offline.parse_tasks("ruler_qa_squad")
    with pytest.raises(ValueError, match="did you mean niah_single_1"):
        ruler_offline.parse_tasks("niah_singel_1")
    with pytest.raises(ValueError, match="distinct"):
        ruler_offline.parse_tasks("ruler_vt,ruler_vt")
    with pytest.raises(ValueError, match="niah_multikey_1: .*slimkv's niah_multikey_1_handbook runs it on a local haystack"):
        ruler_offline.parse_tasks("niah_multikey_1")


def test_local_haystack_tasks_are_lm_eval_task_files_beside_their_functions():
    """Every ``*_handbook`` task slimkv offers is a YAML in the folder the task manager is pointed at,
    naming a function of ``handbook_niah.py`` (read as text: it imports lm-eval) of its own name."""
    local = [t for t in ruler_offline.OFFLINE_TASKS if ruler_press.is_local_task(t)]
    assert not ruler_press.is_local_task("niah_single_1")
    assert len(local) == 5 and all(t[: -len(ruler_press.LOCAL_TASK_SUFFIX)] in ruler_offline.HUB_TASKS for t in local)
    functions = set(re.findall(r"^def (\w+)\(", (ruler_press.LOCAL_TASKS_DIR / "handbook_niah.py").read_text(), re.M))
    for task in local:
        args = ruler_press.task_manager_args(task, 2048, "tok", "/hay.txt")
        assert args == {"include_path": str(ruler_press.LOCAL_TASKS_DIR), "metadata": {"max_seq_lengths": [2048], "tokenizer": "tok", "haystack_file": "/hay.txt"}}
        text = (ruler_press.LOCAL_TASKS_DIR / f"{task}.yaml").read_text()
        assert f"task: {task}\n" in text and f"custom_dataset: !function handbook_niah.{task}\n" in text and task in functions
    assert ruler_press.task_manager_args("niah_single_1", 4096, "tok", None) == {"metadata": {"max_seq_lengths": [4096], "tokenizer": "tok"}}
    with pytest.raises(ValueError, match="niah_single_2_handbook hides its needles in a local haystack"):
        ruler_press.task_manager_args("niah_single_2_handbook", 4096, "tok", None)


def test_the_local_haystack_is_written_once_under_its_digest(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKV_CACHE", str(tmp_path))
    texts = iter(["prose one. prose two.", "prose one. prose two."])
    monkeypatch.setattr(ruler_offline, "evaluation_text", lambda name: next(texts) if name == ruler_offline.LOCAL_HAYSTACK else pytest.fail(name))
    path, digest = ruler_offline.haystack_file()
    assert path.startswith(str(tmp_path)) and digest in (ruler_offline.text_sha256("prose one. prose two."),) and digest[:16] in path
    assert open(path, encoding="utf-8").read() == "prose one. prose two."
    assert ruler_offline.haystack_file() == (path, digest)  # the second call reads the text again and finds the file written


def test_cache_options_are_checked_by_name():
    assert ruler_cache.parse_caches("none,quanto-int4,bfloat16") == ["none", "quanto-int4", "bfloat16"]
    with pytest.raises(ValueError, match="--caches press:snapkv: the budget after @ must be a number"):
        ruler_cache.parse_caches("press:snapkv")
    with pytest.raises(ValueError, match="--caches='quanto-int3' is not allowed"):
        ruler_cache.parse_caches("quanto-int3")
    with pytest.raises(ValueError, match="distinct"):
        ruler_cache.parse_caches("none,none")


def test_lengths_must_fit_the_model_positions_and_gen_tokens_the_room():
    model = tiny_llama(positions=4096)
    ruler.check_lengths([1024, 4096], model)
    with pytest.raises(ValueError, match=r"--lengths 8192: .*max_position_embeddings=4096.*1024\.\.4096"):
        ruler.check_lengths([2048, 8192], model)
    with pytest.raises(ValueError, match="--lengths 512"):
        ruler.check_lengths([512], model)
    assert ruler_offline.gen_tokens(["niah_single_1", "ruler_vt"], None) == {"niah_single_1": 16, "ruler_vt": 30}
    assert ruler_offline.gen_tokens(["niah_single_1"], 64) == {"niah_single_1": 64}
    with pytest.raises(ValueError, match="--max-gen-toks .for ruler_vt.*<= 30"):
        ruler_offline.gen_tokens(["niah_single_1", "ruler_vt"], 64)


def test_missing_packages_say_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("lm_eval", "optimum.quanto", "hqq") else real(name, *a))
    with pytest.raises(ImportError, match=r"lm_eval.*make ruler-env.*\.venv-ruler/bin/slimkv eval ruler"):
        ruler.check_lm_eval()
    with pytest.raises(ImportError, match="--caches quanto-int2 needs optimum-quanto.*make ruler-env.*venv-ruler/bin/slimkv"):
        ruler_cache.check_backends(["none", "quanto-int2"])
    ruler_cache.check_backends(["none", "bfloat16"])


def test_a_slimkv_model_takes_only_its_own_cache():
    model = SlimKVForCausalLM(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, attention="mla", attention_options={"kv_rank": 8})).eval()
    ruler_cache.check_model_takes(model, ["none"])
    with pytest.raises(ValueError, match="--caches quanto-int4: this is a slimkv model .mla layers.*SlimKVCache"):
        ruler_cache.check_model_takes(model, ["none", "quanto-int4"])
    odd = tiny_llama()
    odd.config.head_dim = 48
    with pytest.raises(ValueError, match="--caches hqq-int2: the quantized cache groups 64 channels.*head_dim 48"):
        ruler_cache.check_model_takes(odd, ["bfloat16", "hqq-int2"])


def test_planner_keeps_grid_order_within_the_budget():
    cells = [{"id": c, "estimate_s": s} for c, s in (("a", 60.0), ("b", 100.0), ("c", 10.0))]
    assert ruler.plan(cells, None) == (cells, [])
    assert ruler.plan(cells, 170.0) == (cells, [])
    assert ruler.plan(cells, 165.0) == (cells[:2], cells[2:])
    assert ruler.plan(cells, 59.0) == ([], cells)
    row = {"prefill_s": 2.0, "decode_s_per_token": 0.1}
    assert ruler.estimate_cell(row, limit=40, max_gen_toks=16) == pytest.approx(40 * (2.0 + 1.6))


def lm_eval_shaped(task: str, length: int, values: list[float]) -> tuple[dict, list[dict]]:
    """An lm-eval results JSON and its samples, as lm-eval 0.4.13 writes them for a RULER task."""
    results = {"results": {task: {"alias": task, "4096,none": -1, f"{length},none": sum(values) / len(values), f"{length},none_stderr": "N/A"}},
               "n-samples": {task: {"original": 500, "effective": len(values)}}}
    samples = [{"doc_id": i, "4096": -1.0, str(length): v, "resps": [["x"]]} for i, v in enumerate(values)]
    return results, samples


def test_summary_takes_lm_evals_score_and_counts_full_answers():
    results, samples = lm_eval_shaped("niah_single_1", 2048, [1.0, 1.0, 0.0, 1.0])
    row = ruler.summarize_cell([(results, samples)], "niah_single_1", 2048)
    assert row["score"] == 0.75 and row["n"] == 4 and row["full"] == 3 and row["binary"]
    low, high = row["wilson95"]
    assert 0.2 < low < 0.75 < high < 1.0
    results, samples = lm_eval_shaped("ruler_cwe", 1024, [1.0, 0.5, 0.9])
    row = ruler.summarize_cell([(results, samples)], "ruler_cwe", 1024)
    assert row["score"] == pytest.approx(0.8) and row["full"] == 1 and not row["binary"]
    assert row["score95"] == ruler.summarize_cell([(results, samples)], "ruler_cwe", 1024)["score95"]  # seeded: a report regenerates
    assert 0.5 <= row["score95"][0] < 0.8 < row["score95"][1] <= 1.0  # the mean's interval, not the Wilson one of 1 full answer in 3
    wide = ruler.summarize_cell([lm_eval_shaped("ruler_cwe", 1024, [0.2, 0.3] * 20)], "ruler_cwe", 1024)["score95"]
    assert 0.2 < wide[0] < 0.25 < wide[1] < 0.3  # 40 prompts: a narrow interval around the mean
    results["n-samples"]["ruler_cwe"]["effective"] = 5
    with pytest.raises(ValueError, match="count 5 samples"):
        ruler.summarize_cell([(results, samples)], "ruler_cwe", 1024)
    parts = [lm_eval_shaped("niah_single_1", 2048, [1.0, 1.0, 0.0]), lm_eval_shaped("niah_single_1", 2048, [0.0])]
    row = ruler.summarize_cell(parts, "niah_single_1", 2048)  # a grown cell: lm-eval's part scores weighted by their prompts
    assert row["score"] == 0.5 and row["n"] == 4 and row["full"] == 2


def test_cache_bytes_of_the_dynamic_and_cast_caches_are_their_tensors():
    model = tiny_llama()
    full = ruler_cache.probe(model, "none", 300, 99, decode_tokens=2)
    assert full["cache_type"] == "DynamicCache" and full["tokens"] == 300
    assert full["bytes_per_token"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # float32 keys and values
    assert full["bytes_per_token_after_decode"] == full["bytes_per_token"]
    half = ruler_cache.probe(model, "bfloat16", 300, 99, decode_tokens=2)
    assert half["bytes_per_token"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    assert ruler_cache.bf16_reference(full) == half["bytes_per_token"]
    ids = torch.randint(3, 99, (1, 20))
    new_cache = ruler_cache.cache_factory(model, "bfloat16")
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=2, cache=new_cache())
    assert out.shape == (1, 23)


def test_tensor_bytes_counts_each_tensor_once_through_containers():
    scale = torch.zeros(4, dtype=torch.float16)
    packed = torch.zeros(10, dtype=torch.uint8)
    assert ruler_cache.tensor_bytes((packed, {"scale": scale, "zero": scale, "nbits": 4})) == 10 + 8


@pytest.mark.parametrize("option", ["quanto-int4", "quanto-int2", "hqq-int4"])
def test_quantized_cache_bytes_count_packed_data_scales_and_the_residual_window(option):
    backend, nbits = ruler_cache.QUANTIZED[option]
    if not HAS_BACKEND[backend]:
        pytest.skip(f"{backend} not installed: make ruler-env")
    model = tiny_llama()
    row = ruler_cache.probe(model, option, 300, 99, decode_tokens=4)
    # per token, layer, K or V: 64 channels at nbits (packed) and one group's float32 scale and zero point
    per_token = LAYERS * 2 * KV_HEADS * (HEAD_DIM * nbits // 8 + 8)
    assert row["bytes_per_token"] == per_token
    residual = 4 * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # 4 decoded tokens kept in float32
    assert row["bytes_per_token_after_decode"] == pytest.approx((300 * per_token + residual) / 304)


def fake_run_cell(calls):
    """A stand-in for lm-eval: writes lm-eval-shaped files into the cell's folder."""

    def run(loaded, option, task, length, *, first=0, limit, max_gen_toks, seed, tokenizer_dir, cell_dir, haystack=None):
        calls.append((option, task, length) if first == 0 else (option, task, length, first))
        cell_dir.mkdir(parents=True, exist_ok=True)
        results, samples = lm_eval_shaped(task, length, [float(i % 2 == 0) for i in range(first, limit)])
        (cell_dir / "lm_eval_t.json").write_text(json.dumps(results))
        (cell_dir / "samples_t.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        return cell_dir / "lm_eval_t.json", cell_dir / "samples_t.jsonl", 1.0

    return run


def test_resume_skips_finished_cells_and_refuses_other_settings(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    calls: list = []
    monkeypatch.setattr(ruler, "run_cell", fake_run_cell(calls))
    out = tmp_path / "out"
    options = {"tasks": ["niah_single_1", "ruler_vt"], "lengths": [1024], "caches": ["none", "bfloat16"], "limit": 3, "out_dir": out, "progress": False,
               "say": lambda _: None}
    report = ruler.evaluate(str(tiny_folder), **options)
    assert len(calls) == 4 and set(report["cells"]) == {f"{o}/{t}/1024" for o in ("none", "bfloat16") for t in ("niah_single_1", "ruler_vt")}
    row = report["cells"]["bfloat16/ruler_vt/1024"]
    assert row["n"] == 3 and row["score"] == pytest.approx(2 / 3) and row["bytes_ratio_to_bf16_original"] == 1.0
    assert report["cells"]["none/ruler_vt/1024"]["bytes_ratio_to_bf16_original"] == 2.0  # the float32 original
    saved = json.loads((out / "ruler.json").read_text())
    assert saved["cells"] == json.loads(json.dumps(report["cells"])) and "git_commit" in saved["machine"]
    calls.clear()
    ruler.evaluate(str(tiny_folder), **options)
    assert calls == []
    (out / "cells" / "none" / "ruler_vt" / "1024" / ruler.CELL_FILE).unlink()
    ruler.evaluate(str(tiny_folder), **options)
    assert calls == [("none", "ruler_vt", 1024)]
    with pytest.raises(ValueError, match="differ in: limit; only a larger --limit"):
        ruler.evaluate(str(tiny_folder), **{**options, "limit": 2})


def test_a_larger_limit_grows_finished_cells_with_only_the_new_prompts(tiny_folder, tmp_path, monkeypatch):
    """A cell finished with 3 prompts, asked for 5 then 6, runs prompts 3-4 then 5 into folders of their own; its score is
    lm-eval's over all of them (the stand-in answers the even-numbered prompts), its earlier files and machine are kept."""
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    calls: list = []
    monkeypatch.setattr(ruler, "run_cell", fake_run_cell(calls))
    out = tmp_path / "out"
    options = {"tasks": ["niah_single_1"], "lengths": [1024], "caches": ["none"], "out_dir": out, "progress": False, "say": lambda _: None}
    ruler.evaluate(str(tiny_folder), limit=3, **options)
    cell_dir = out / "cells" / "none" / "niah_single_1" / "1024"
    first_files = sorted(p.name for p in cell_dir.iterdir())
    said: list[str] = []
    report = ruler.evaluate(str(tiny_folder), limit=5, **{**options, "say": said.append})
    assert calls == [("none", "niah_single_1", 1024), ("none", "niah_single_1", 1024, 3)]
    assert any("prompts 3-4: 3 finished before" in line for line in said)
    row = report["cells"]["none/niah_single_1/1024"]
    assert row["n"] == 5 and row["full"] == 3 and row["score"] == pytest.approx(3 / 5) and report["settings"]["limit"] == 5
    assert [(p["first"], p["n"]) for p in row["added_prompts"]] == [(3, 2)]
    assert (out / row["added_prompts"][0]["lm_eval_samples"]).parent == cell_dir / "prompts-3-4"
    assert first_files == sorted(p.name for p in cell_dir.iterdir() if p.name != "prompts-3-4")  # the first part's files untouched
    assert row["seconds"] == pytest.approx(sum(p["seconds"] for p in ruler_report.cell_parts(row)))
    ruler.evaluate(str(tiny_folder), limit=5, **options)
    assert len(calls) == 2  # finished at 5: skipped
    row = ruler.evaluate(str(tiny_folder), limit=6, **options)["cells"]["none/niah_single_1/1024"]
    assert calls[-1] == ("none", "niah_single_1", 1024, 5) and row["n"] == 6 and row["score"] == pytest.approx(3 / 6)
    assert [(p["first"], p["n"]) for p in ruler_report.cell_parts(row)] == [(0, 3), (3, 2), (5, 1)]
    cell = json.loads((cell_dir / ruler.CELL_FILE).read_text())
    assert len(cell["machine"]["earlier_parts"]) == 2 and "earlier_parts" not in cell["machine"]["earlier_parts"][-1]


def test_a_run_with_another_grid_keeps_the_folders_earlier_cells_in_its_report(tiny_folder, tmp_path, monkeypatch):
    """A second run into one --out with other tasks and caches (how a comparison grows) reports every finished cell
    of the folder, not only its own grid: its report once dropped the first run's cells, and every page read from it."""
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    calls: list = []
    monkeypatch.setattr(ruler, "run_cell", fake_run_cell(calls))
    out = tmp_path / "out"
    common = {"lengths": [1024], "limit": 2, "out_dir": out, "progress": False, "say": lambda _: None}
    ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], caches=["none", "bfloat16"], **common)
    report = ruler.evaluate(str(tiny_folder), tasks=["ruler_vt"], caches=["none"], **common)
    assert calls[-1] == ("none", "ruler_vt", 1024) and len(calls) == 3
    assert list(report["cells"]) == ["none/niah_single_1/1024", "bfloat16/niah_single_1/1024", "none/ruler_vt/1024"]
    saved = json.loads((out / "ruler.json").read_text())
    assert list(saved["cells"]) == list(report["cells"])
    assert saved["settings"]["tasks"] == ["niah_single_1", "ruler_vt"] and saved["settings"]["caches"] == ["none", "bfloat16"]
    assert saved["settings"]["run"]["tasks"] == ["ruler_vt"] and saved["settings"]["max_gen_toks"] == {"niah_single_1": 16, "ruler_vt": 30}
    assert "| bfloat16 | niah_single_1 | 1024 |" in (out / "ruler.md").read_text()
    report = ruler.evaluate(str(tiny_folder), tasks=["ruler_vt"], caches=["none"], **{**common, "limit": 3, "out_dir": tmp_path / "other"})
    assert list(report["cells"]) == ["none/ruler_vt/1024"]  # another folder: nothing of the first one
    (out / "cells" / "none" / "ruler_vt" / "1024" / ruler.CELL_FILE).unlink()
    calls.clear()
    report = ruler.evaluate(str(tiny_folder), tasks=["ruler_vt"], caches=["none"], **{**common, "limit": 3})
    assert list(report["cells"]) == ["none/ruler_vt/1024"]  # cells of another --limit are not this run's model settings: left out


def test_a_slimkv_model_folder_runs_with_its_own_cache_measured_by_nbytes(tmp_path, monkeypatch):
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    calls: list = []
    monkeypatch.setattr(ruler, "run_cell", fake_run_cell(calls))
    torch.manual_seed(0)
    model = SlimKVForCausalLM(ModelConfig(vocab_size=99, d_model=32, n_layers=2, n_heads=4, attention="mla", attention_options={"kv_rank": 8, "rope_dim": 8})).eval()
    folder = tmp_path / "tiny-slimkv"
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    options = {"tasks": ["niah_single_1"], "lengths": [1024], "limit": 1, "out_dir": tmp_path / "o", "progress": False, "say": lambda _: None}
    with pytest.raises(ValueError, match="--caches bfloat16: this is a slimkv model"):
        ruler.evaluate(str(folder), caches=["none", "bfloat16"], **options)
    assert calls == []
    row = ruler.evaluate(str(folder), caches=["none"], **options)["cells"]["none/niah_single_1/1024"]
    assert row["bytes_per_token"] == 2 * (8 + 8) * 4  # two layers of one float32 latent row (kv_rank + rope_dim) per token
    assert "itself" in row["ratio_reference"]
    with pytest.raises(ValueError, match=r"--dtype='float16' is not allowed; allowed values: float32, bfloat16"):
        ruler.evaluate(str(folder), caches=["none"], **{**options, "out_dir": tmp_path / "b"}, dtype="float16")
    report = ruler.evaluate(str(folder), caches=["none"], **{**options, "out_dir": tmp_path / "b"}, dtype="bfloat16")
    assert report["settings"]["dtype"] == "bfloat16"
    row = report["cells"]["none/niah_single_1/1024"]
    assert row["bytes_per_token"] == 2 * (8 + 8) * 2  # the same rows held in bfloat16: what a bfloat16 deployment keeps
    assert row["bytes_ratio_to_bf16_original"] == pytest.approx(1.0)  # the model is its own reference, counted at 2 bytes an element


def test_budget_plan_runs_nothing_past_it(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    calls: list = []
    monkeypatch.setattr(ruler, "run_cell", fake_run_cell(calls))
    said: list[str] = []
    report = ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["none"], limit=2, out_dir=tmp_path / "o",
                            budget_minutes=1e-6, progress=False, say=said.append)
    assert calls == [] and report["not_run"] == ["none/niah_single_1/1024"]
    assert any(line.startswith("  skip  none/niah_single_1/1024") for line in said)


def test_add_ruler_command_registers_on_subparsers_and_on_the_task_table():
    parser = argparse.ArgumentParser()
    add_ruler_command(parser.add_subparsers())
    args = parser.parse_args(["ruler", "--model", "smollm2", "--out", "o", "--caches", "none,quanto-int4"])
    assert args.caches == "none,quanto-int4" and args.limit == 20 and callable(args.task_run)
    table: dict = {}
    add_ruler_command(table)
    assert set(table) == {"ruler"} and len(table["ruler"]) == 3


@pytest.mark.skipif(not HAS_LM_EVAL, reason=NO_LM_EVAL)
def test_real_lm_eval_cell_on_a_tiny_model(tiny_folder, tmp_path):
    report = ruler.evaluate(str(tiny_folder), tasks=["niah_single_1"], lengths=[1024], caches=["bfloat16"], limit=1, max_gen_toks=4,
                            out_dir=tmp_path / "o", progress=False, say=lambda _: None)
    row = report["cells"]["bfloat16/niah_single_1/1024"]
    assert row["n"] == 1 and 0.0 <= row["score"] <= 1.0
    assert (tmp_path / "o" / row["lm_eval_results"]).is_file() and (tmp_path / "o" / row["lm_eval_samples"]).is_file()


@pytest.mark.skipif(not HAS_LM_EVAL, reason=NO_LM_EVAL)
def test_real_lm_eval_cell_of_a_local_haystack_task(tmp_path, monkeypatch):
    """lm-eval builds a ``*_handbook`` task's prompts over the local haystack (sentences split without
    nltk's download) and scores them; the cell records which haystack it ran on. 4096 characters:
    room for lm-eval's first step of 500 haystack words."""
    tiny_folder = tmp_path / "tiny-llama"
    tiny_llama(positions=4096).save_pretrained(tiny_folder)
    char_tokenizer().save_pretrained(tiny_folder)
    monkeypatch.setenv("SLIMKV_CACHE", str(tmp_path / "cache"))
    prose = " ".join(f"Sentence {i} tells of the {('red', 'green', 'blue')[i % 3]} boat number {i}." for i in range(3000))
    monkeypatch.setattr(ruler_offline, "evaluation_text", lambda name: prose)
    report = ruler.evaluate(str(tiny_folder), tasks=["niah_single_2_handbook"], lengths=[4096], caches=["none"], limit=2, max_gen_toks=4,
                            out_dir=tmp_path / "o", progress=False, say=lambda _: None)
    row = report["cells"]["none/niah_single_2_handbook/4096"]
    samples = ruler_report.read_samples(tmp_path / "o" / row["lm_eval_samples"])
    assert row["n"] == 2 and len(samples) == 2 and all("boat number" in s["arguments"]["gen_args_0"]["arg_0"] for s in samples)
    assert all("special magic number for" in s["arguments"]["gen_args_0"]["arg_0"] for s in samples)
    cell = json.loads((tmp_path / "o" / "cells" / "none/niah_single_2_handbook/4096" / "cell.json").read_text())
    assert cell["settings"]["haystack"] == {"text": ruler_offline.LOCAL_HAYSTACK, "sha256": ruler_offline.text_sha256(prose)}


@pytest.mark.skipif(not HAS_LM_EVAL, reason=NO_LM_EVAL)
def test_a_grown_cell_runs_the_prompts_a_larger_limit_would_have(tiny_folder, tmp_path):
    """lm-eval's ``samples`` (which a grown cell's new part runs) picks the documents its ``limit`` would: the same
    prompts and answers, so a cell grown from 1 prompt to 2 holds what a 2-prompt cell holds."""
    common = {"tasks": ["niah_single_1"], "lengths": [1024], "caches": ["bfloat16"], "max_gen_toks": 4, "progress": False, "say": lambda _: None}
    ruler.evaluate(str(tiny_folder), limit=1, out_dir=tmp_path / "grown", **common)
    grown = ruler.evaluate(str(tiny_folder), limit=2, out_dir=tmp_path / "grown", **common)["cells"]["bfloat16/niah_single_1/1024"]
    whole = ruler.evaluate(str(tiny_folder), limit=2, out_dir=tmp_path / "whole", **common)["cells"]["bfloat16/niah_single_1/1024"]
    grown_samples = [s for part in ruler_report.cell_parts(grown) for s in ruler_report.read_samples(tmp_path / "grown" / part["lm_eval_samples"])]
    whole_samples = ruler_report.read_samples(tmp_path / "whole" / whole["lm_eval_samples"])
    assert [(s["doc_hash"], s["prompt_hash"], s["target_hash"]) for s in grown_samples] == [(s["doc_hash"], s["prompt_hash"], s["target_hash"]) for s in whole_samples]
    assert grown_samples[0]["doc_hash"] != grown_samples[1]["doc_hash"] and grown["score"] == whole["score"] and grown["n"] == 2


def test_needle_depth_hits_bins_each_prompt_by_where_its_answer_is(tmp_path):
    """``needle_depth_hits``: each prompt in the bin of its answer's first position (a fraction of the
    prompt's characters), lm-eval's own per-sample metric as the hit, over every part of a grown cell;
    nothing for a partial-credit cell or a missing samples file."""
    def sample(prompt: str, answer: str, score: float) -> dict:
        return {"doc": {"outputs": repr([answer])}, "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": {}}}, "1024": score}

    def write(name: str, samples: list[dict]) -> str:
        (tmp_path / name).write_text("\n".join(json.dumps(s) for s in samples) + "\n")
        return name

    first = write("a.jsonl", [sample("1234567" + "x" * 93, "1234567", 1.0),  # depth 0.00: bin 0
                              sample("x" * 30 + "7654321" + "x" * 63, "7654321", 0.0),  # depth 0.30: bin 1
                              sample("x" * 99 + "5", "5", 1.0)])  # depth 0.99: the last bin
    added = write("b.jsonl", [sample("x" * 60 + "42" + "x" * 38, "42", 0.0), sample("no answer here", "9", 1.0)])  # 0.60: bin 2; the other in no bin
    summary = {"binary": True, "length": 1024, "n": 5, "seconds": 5.0, "generate_s_per_sample": 1.0, "load_average_start": [0.0] * 3,
               "load_average_end": [0.0] * 3, "threads": 1, "lm_eval_results": "r.json", "lm_eval_samples": first,
               "added_prompts": [{"first": 3, "n": 2, "seconds": 2.0, "generate_s": 2.0, "lm_eval_samples": added}]}
    assert ruler_report.needle_depth_hits(summary, tmp_path) == [(1, 1), (0, 1), (0, 1), (1, 1)]
    assert ruler_report.needle_depth_hits(summary, tmp_path, bins=2) == [(1, 2), (1, 2)]
    assert ruler_report.needle_depth_hits({**summary, "binary": False}, tmp_path) is None
    assert ruler_report.needle_depth_hits({**summary, "lm_eval_samples": "missing.jsonl"}, tmp_path) is None
