"""Issue 39, round 3, on the evaluation side: option values, bounded conversions in reports, the
original of a conversion, damaged source weights, resumed retrieval grids and damaged results
files. Tiny local models only (no downloads)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from slimkv.bench.entries import parse_kind_overrides
from slimkv.cli import main
from slimkv.common import spec as grammar
from slimkv.common.spec import AttentionSpec, split_entries
from slimkv.compress.options import CompressOptions
from slimkv.compress.workflow import compress_pretrained
from slimkv.convert.methods import parse_method
from slimkv.convert.pipeline import ConvertOptions, convert_pretrained
from slimkv.eval import ppl
from slimkv.pretrained import loading
from slimkv.pretrained.loading import COMPRESSED_MANIFEST, CONVERTED_MANIFEST
from slimkv.retrieval import models as retrieval
from slimkv.retrieval.prompts import TASKS
from tests.compress.conftest import CALIB_LINES, HELD_OUT_LINES, char_tokenizer, tiny_config, tiny_model, write_tiny_llama_folder

MLA_KVM = "mla-kvm:chunk_size=4,window_chunks=2,min_rows=6,sink_len=1,transfer_steps=0,transfer_seq_len=32,transfer_windows=2"


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    return write_tiny_llama_folder(tmp_path, CALIB_LINES * 30, HELD_OUT_LINES * 10)


@pytest.fixture
def long_folder(tmp_path) -> Path:
    """A tiny random Llama of 1024 positions with the character tokenizer, a prose haystack and a held-out text beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    folder = tmp_path / "tiny-long"
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (tmp_path / "prose.txt").write_text("".join(f"Line {i} of the haystack: {HELD_OUT_LINES}" for i in range(40)))
    (tmp_path / "held.txt").write_text(HELD_OUT_LINES * 10)
    return folder


def niah(folder: Path, **changes) -> dict:
    options = {"tasks": [TASKS["needle-word"]], "lengths": [400], "depths": [0.5], "samples": 1, "haystack": str(folder.parent / "prose.txt"),
               "out_dir": folder.parent / "niah", "progress": False, **changes}
    return retrieval.evaluate(str(folder), **options)


def convert(folder: Path, method: str, ratio: float | None, out: Path) -> dict:
    options = ConvertOptions(method, ratio, calib=str(folder.parent / "calib.txt"), calib_tokens=96, calib_seq_len=32)
    return convert_pretrained(str(folder), options, out, progress=False)[1]


def ppl_argv(model: Path, *extra: str) -> list[str]:
    return ["eval", "ppl", "--model", str(model), "--text", str(model.parent / "held.txt"), "--seq-len", "32", "--max-tokens", "200", *extra]


def test_plain_float_spellings_are_numbers_in_every_option_grammar():
    """YAML 1.1 reads 1e-3 as text; --to, --kinds and --kind-option read it as the number it spells."""
    assert parse_method("kvm:transfer_lr=1e-3")[1]["transfer_lr"] == 0.001
    spec = AttentionSpec.parse("swa+kvm:rope_fraction=2.5E-1,kvm.max_rows=[1e1, 12]")
    assert spec.shared == {"rope_fraction": 0.25} and spec.per_kind == {"kvm": {"max_rows": [10.0, 12]}}
    assert parse_kind_overrides(["lrkv.rank=1E+1", "swa.window=.5"]) == {"lrkv": {"rank": 10.0}, "swa": {"window": 0.5}}
    assert [grammar.read_value(t) for t in ("-.5", "1.0e5", "+2e0", "8", "012", "0x10", "1:30", "'1e-3'", "sqrt", "null")] == \
        [-0.5, 1e5, 2.0, 8, 12, 16, "1:30", "1e-3", "sqrt", None]  # 012 is twelve, 1:30 is text, a quoted value stays text
    assert isinstance(grammar.read_value("8"), int)


def test_an_option_given_twice_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"option 'min_rows' is given twice in 'min_rows=1,min_rows=2'"):
        parse_method("kvm:min_rows=1,min_rows=2")
    with pytest.raises(ValueError, match=r"entry 'swa\+kvm:swa.window=4,kvm.rows=2,swa.window=8': option 'swa.window' is given twice"):
        AttentionSpec.parse("swa+kvm:swa.window=4,kvm.rows=2,swa.window=8")
    assert AttentionSpec.parse("swa+kvm:window=4,swa.window=8").layer_options(0) == {"window": 8}  # a kind's own option over the shared one
    assert split_entries("lrkv:rank=8,rope_placement=none,swa:window=4,rope=none") == ["lrkv:rank=8,rope_placement=none", "swa:window=4,rope=none"]


def test_ppl_of_a_bounded_conversion_describes_its_cache_in_bytes(tiny_folder, tmp_path, capsys):
    """mla-kvm records a ratio but no achieved ratio (its cache is bounded): the label gives its
    cache bytes at the longest context of its table, where it used to format None."""
    manifest = convert(tiny_folder, MLA_KVM, 0.5, tmp_path / "out")
    assert manifest["cache_ratio"] == 0.5 and manifest["achieved_cache_ratio"] is None
    assert main(ppl_argv(tmp_path / "out", "--json", str(tmp_path / "ppl.json"))) == 0
    last = manifest["cache_bytes"][-1]
    label = json.loads((tmp_path / "ppl.json").read_text())["results"][1]["model"]
    assert f"(mla-kvm layers) cache ratio 0.5, bounded cache: {last['bytes']:,} bytes at {last['context']} tokens ({last['ratio']:.4f} of the original's)" in label
    assert label in capsys.readouterr().out
    kvm = {"method": "kvm", "kind": "kvm", "cache_ratio": None, "achieved_cache_ratio": None, "cache_bytes": manifest["cache_bytes"], "healing": {"step": 1}}
    assert ppl.describe({"converted": kvm}, "x") == f"convert kvm (kvm layers) bounded cache: {last['bytes']:,} bytes at {last['context']} tokens ({last['ratio']:.4f} of the original's) healed"
    assert ppl.describe({"converted": {**kvm, "cache_bytes": None}}, "x") == "convert kvm (kvm layers) bounded cache healed"


@pytest.mark.parametrize("made", ["convert", "compress"])
def test_an_original_whose_weights_changed_is_refused_before_any_model_loads(made, tiny_folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    if made == "convert":
        manifest_path, recorded = out / CONVERTED_MANIFEST, convert(tiny_folder, "gqa", 0.5, out)["base_model"]["weights_sha256"]
    else:
        options = CompressOptions("svd", 0.3)
        manifest_path, recorded = out / COMPRESSED_MANIFEST, compress_pretrained(str(tiny_folder), options, "", 64, out, progress=False)[1]["base_model"]["weights_sha256"]
    tiny_model("llama", seed=1).save_pretrained(tiny_folder)  # other weights where the original was
    monkeypatch.setattr(ppl, "load_language_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(ppl_argv(out)) == 2
    err = capsys.readouterr().err
    assert f"the original model {tiny_folder} holds other weights than the ones {manifest_path} was made from (weights sha256 {recorded[:12]}... recorded" in err
    assert f"or run `slimkv {made}` again from the current ones" in err
    monkeypatch.undo()
    manifest = json.loads(manifest_path.read_text())
    del manifest["base_model"]["weights_sha256"]  # a manifest written before the fingerprint: accepted
    manifest_path.write_text(json.dumps(manifest))
    assert main(ppl_argv(out)) == 0


def test_the_healing_resume_checks_the_original_in_the_same_place(tiny_folder, tmp_path):
    from slimkv.pretrained.loading import resolve_original

    out = tmp_path / "out"
    manifest = convert(tiny_folder, "gqa", 0.5, out)
    assert resolve_original(manifest, out / CONVERTED_MANIFEST) == manifest["base_model"]["name"]
    tiny_model("llama", seed=1).save_pretrained(tiny_folder)
    with pytest.raises(ValueError, match=r"holds other weights than the ones .* was made from"):
        resolve_original(manifest, out / CONVERTED_MANIFEST)
    with pytest.raises(ValueError, match=r"base_model.weights_sha256 is 5, not a sha256"):
        resolve_original({"base_model": {**manifest["base_model"], "weights_sha256": 5}}, out / CONVERTED_MANIFEST)


def test_a_damaged_source_model_is_named_in_convert_ppl_and_niah(tiny_folder, tmp_path, capsys, monkeypatch):
    weights = tiny_folder / "model.safetensors"
    whole = weights.read_bytes()
    commands = (ppl_argv(tiny_folder),
                ["convert", "--model", str(tiny_folder), "--to", "gqa", "--cache-ratio", "0.5", "--calib", str(tmp_path / "calib.txt"), "--calib-tokens", "96",
                 "--calib-seq-len", "32", "--out", str(tmp_path / "conv"), "--no-progress"],
                ["eval", "niah", "--model", str(tiny_folder), "--tasks", "passkey", "--lengths", "64", "--depths", "0.5", "--samples", "1",
                 "--out", str(tmp_path / "niah"), "--no-progress"])
    weights.write_bytes(whole[: len(whole) // 2])
    for argv in commands:
        assert main(argv) == 2, argv
        assert f"the weights in {tiny_folder} cannot be read (" in capsys.readouterr().err
    monkeypatch.setattr(loading, "smollm2_dir", lambda: tiny_folder)  # the cached SmolLM2 copy, cut short
    assert main(["eval", "ppl", "--model", "smollm2", "--text", str(tmp_path / "held.txt"), "--seq-len", "32"]) == 2
    assert "a file is truncated or damaged; run `slimkv models fetch smollm2 --force` to convert it again" in capsys.readouterr().err
    from safetensors.torch import load_file, save_file

    weights.write_bytes(whole)
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})  # a readable file that lacks a tensor: it used to be initialised at random
    assert main(commands[0]) == 2
    assert "the weights do not fit config.json (missing: ['model.layers.1.mlp.up_proj.weight'])" in capsys.readouterr().err
    weights.write_bytes(whole)
    config = json.loads((tiny_folder / "config.json").read_text())
    for damaged, message in (("{not json", "config.json is not valid JSON"), (json.dumps({**config, "hidden_size": "wide"}), "config.json cannot be read as a llama config"),
                             (json.dumps({**config, "intermediate_size": 81}), "the weights do not have the shapes config.json gives")):
        (tiny_folder / "config.json").write_text(damaged)
        assert main(commands[0]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "conv").exists() and not (tmp_path / "niah").exists()


def test_a_niah_resume_refuses_a_haystack_file_whose_text_changed(long_folder, tmp_path, monkeypatch):
    """Only the haystack's path was fingerprinted: cells of the new text were merged beside cells of the old one."""
    report = niah(long_folder)
    recorded = report["settings"]["haystack_sha256"]
    monkeypatch.setattr(retrieval, "generate", lambda *a, **k: pytest.fail("a cell was run"))
    assert niah(long_folder)["cells"] == report["cells"]  # the same text resumes
    prose = tmp_path / "prose.txt"
    prose.write_text(prose.read_text().replace("dagger", "feather"))
    with pytest.raises(ValueError, match=rf"niah.json holds results on another haystack text: the text of --haystack '{prose}' changed since "
                                         rf"\(sha256 {recorded[:12]}\.\.\. then, [0-9a-f]{{12}}\.\.\. now\)"):
        niah(long_folder, lengths=[400, 500])
    results = tmp_path / "niah" / retrieval.RESULT_FILE
    data = json.loads(results.read_text())
    del data["settings"]["haystack_sha256"]  # written before the text was fingerprinted
    data["fingerprint"] = retrieval.fingerprint(data["settings"])
    results.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"written before the haystack's text was fingerprinted"):
        niah(long_folder)
    assert json.loads(results.read_text()) == data  # nothing the earlier run wrote is changed


def damage(cell: dict, cache: dict, how: str) -> None:
    """Edit one niah.json cell (or its cache entry) as a hand or a broken disk might."""
    if how == "score":
        cell["score"] = "high"
    elif how == "scores":
        cell["scores"] = [None]
    elif how == "mean":
        cell["score"] = 0.5 if cell["score"] != 0.5 else 0.25
    elif how == "outputs":
        del cell["outputs"]
    elif how == "cache":
        cache["400"]["bytes_per_token"] = "lots"


@pytest.mark.parametrize("how, message", [
    ("score", r"cell 'needle-word/400/0\.50': score must be a finite number >= 0\.0 and <= 1\.0, got 'high'"),
    ("scores", r"cell 'needle-word/400/0\.50': scores\[0\] must be a finite number"),
    ("mean", r"cell 'needle-word/400/0\.50': score [0-9.]+ is not the mean of its scores"),
    ("outputs", r"cell 'needle-word/400/0\.50': outputs is None, not a list with one entry per prompt"),
    ("cache", r"cache at length '400': bytes_per_token must be a finite number >= 0\.0, got 'lots'"),
], ids=["score", "scores", "mean", "outputs", "cache"])
def test_a_damaged_niah_json_names_the_file_and_the_cell(how, message, long_folder, tmp_path, capsys):
    niah(long_folder)
    results = tmp_path / "niah" / retrieval.RESULT_FILE
    data = json.loads(results.read_text())
    damage(data["cells"]["needle-word/400/0.50"], data["cache"], how)
    results.write_text(json.dumps(data))
    argv = ["eval", "niah", "--model", str(long_folder), "--tasks", "needle-word", "--lengths", "400", "--depths", "0.5", "--samples", "1",
            "--haystack", str(tmp_path / "prose.txt"), "--out", str(tmp_path / "niah"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(results) in err and "the file was edited or damaged; move it away to start over" in err
    assert re.search(message, err), err
    assert json.loads(results.read_text()) == data


@pytest.mark.parametrize("edit, message", [
    ({"cache_bytes": "x"}, "cache_bytes is 'x', not a JSON list"),
    ({"cache_bytes": [{"bytes": 1}]}, "cache_bytes holds {'bytes': 1}, not a row of positive integers"),
    ({"layers": [1, 2]}, "layers holds entries that are not JSON objects"),
    ({"options": "x"}, "options is 'x', not a JSON object"),
    ({"calibration": "x"}, "calibration is 'x', not a JSON object"),
    ({"healing": "yes"}, "healing is 'yes', not a JSON object"),
    ({"achieved_cache_ratio": "half"}, "achieved_cache_ratio is 'half', not a number in [0, 1]"),
    ({"cache_elements_per_token_per_layer": {"before": [48.0, 48.0], "after": ["x"]}}, "cache_elements_per_token_per_layer.after is ['x'], not a list"),
], ids=["cache_bytes", "row", "layers", "options", "calibration", "healing", "achieved", "elements"])
def test_a_damaged_conversion_manifest_is_named_not_a_traceback(edit, message, tiny_folder, tmp_path, capsys):
    """The manifest's labels are checked against the model; its form was not: a string where a table
    goes failed with a TypeError, KeyError or AttributeError, or was printed as a label."""
    out = tmp_path / "out"
    convert(tiny_folder, "gqa", 0.5, out)
    manifest = json.loads((out / CONVERTED_MANIFEST).read_text())
    (out / CONVERTED_MANIFEST).write_text(json.dumps({**manifest, **edit}))
    assert main(ppl_argv(out)) == 2
    assert f"{out / CONVERTED_MANIFEST} is damaged ({message}" in capsys.readouterr().err
    for command in (["eval", "cache", "--model", str(out), "--context", "64"], ["eval", "niah", "--model", str(out), "--out", str(tmp_path / "n")]):
        assert main(command) == 2
        assert "is damaged (" in capsys.readouterr().err


def test_a_cache_table_row_whose_ratio_is_not_its_bytes_over_the_originals_is_refused(tiny_folder, tmp_path, capsys):
    """The bounded label prints the table's ratio: it must follow from the bytes the model is checked to hold."""
    out = tmp_path / "out"
    manifest = convert(tiny_folder, MLA_KVM, 0.5, out)
    manifest["cache_bytes"][-1]["ratio"] = 0.01
    (out / CONVERTED_MANIFEST).write_text(json.dumps(manifest))
    assert main(ppl_argv(out)) == 2
    assert "tokens is recorded as 0.01 of the original's, not its bytes / the original's" in capsys.readouterr().err


def test_an_infinite_length_is_refused_naming_the_option():
    """``infk`` / ``infx`` overflowed into a raw OverflowError."""
    from slimkv.eval import positions
    from slimkv.retrieval import runs

    for parse, text, option in ((retrieval.parse_lengths, "1024,infk", "--lengths"), (lambda t: runs.parse_lengths(t, 32), "1x,infx", "--lengths"),
                                (lambda t: positions.parse_length(t, 32), "1e999x", "--length")):
        with pytest.raises(ValueError, match=rf"^{option}"):
            parse(text)


def test_a_damaged_tokenizer_names_the_folder(long_folder, tmp_path, capsys):
    """transformers and tokenizers fail there with errors that name no file (JSONDecodeError, 'Couldn't instantiate the backend tokenizer')."""
    (long_folder / "tokenizer.json").write_text("{")
    niah_argv = ["eval", "niah", "--model", str(long_folder), "--tasks", "passkey", "--lengths", "300", "--out", str(tmp_path / "n")]
    for argv in (ppl_argv(long_folder), niah_argv):
        assert main(argv) == 2
        assert f"the tokenizer in {long_folder} cannot be loaded (" in capsys.readouterr().err
    (long_folder / "tokenizer.json").unlink()
    (long_folder / "tokenizer_config.json").unlink()
    assert main(ppl_argv(long_folder)) == 2
    assert "its tokenizer files (tokenizer.json, tokenizer_config.json) are missing or damaged" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    ({"achieved_ratio": "x"}, "achieved_ratio is 'x', not a number in [0, 1]"),  # was "Unknown format code 'f' for object of type 'str'"
    ({"method": 5}, "method is 5, not a JSON string"),  # was printed as the label "5 ratio 0.3"
    ({"calibration": "x"}, "calibration is 'x', not a JSON object"),  # was an AttributeError
    ({"ratio": None}, "ratio is missing"),
], ids=["achieved", "method", "calibration", "ratio"])
def test_a_damaged_compression_manifest_is_named(edit, message, tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    manifest = compress_pretrained(str(tiny_folder), CompressOptions("svd", 0.3), "", 64, out, progress=False)[1]
    stored = json.loads((out / COMPRESSED_MANIFEST).read_text())
    (out / COMPRESSED_MANIFEST).write_text(json.dumps({**stored, **edit}))
    assert manifest["method"] == "svd" and main(ppl_argv(out)) == 2
    assert f"{out / COMPRESSED_MANIFEST} is damaged ({message}" in capsys.readouterr().err


def test_an_out_folder_under_a_file_is_refused_before_any_work(long_folder, tmp_path):
    """It failed with a bare '[Errno 20] Not a directory' once the work was done (or at its first write)."""
    from slimkv.eval import positions
    from slimkv.retrieval import runs

    under = tmp_path / "prose.txt" / "results"
    message = rf"--out {under} cannot be created: {tmp_path / 'prose.txt'} is a file, not a folder"
    with pytest.raises(ValueError, match=message):
        niah(long_folder, out_dir=under)
    with pytest.raises(ValueError, match=message):
        runs.niah_report(tmp_path / "no-run", tasks=["s1"], lengths="1x", depths="0.5", samples=1, max_new_tokens=4, seed=0, batch_size=1, out_dir=under)
    with pytest.raises(ValueError, match=message):
        positions.positions_report(tmp_path / "no-run", length="2x", buckets=2, max_sequences=1, batch_size=1, out_dir=under)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_cache) -> Path:
    """A tiny training run (3 steps on the tiny dataset)."""
    from slimkv.train import train
    from tests.train.tiny import one_thread, tiny_config

    run_dir = tmp_path_factory.mktemp("round3") / "run"
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("SLIMKV_CACHE", str(tiny_cache))
        train(tiny_config(steps=3), run_dir, progress=False)
    return run_dir


def test_a_folder_where_a_result_file_goes_fails_before_the_work(trained_run, long_folder, tmp_path, capsys, monkeypatch):
    """write_json refused it only at the end, after the whole evaluation (or, for niah --model, after the first cell)."""
    from slimkv.eval import lm

    (tmp_path / "niah").mkdir()
    (tmp_path / "niah" / retrieval.TABLE_FILE).mkdir()
    monkeypatch.setattr(retrieval, "generate", lambda *a, **k: pytest.fail("a cell was run"))
    with pytest.raises(ValueError, match=rf"--out {tmp_path / 'niah' / retrieval.TABLE_FILE} is a folder; give a file path to write to"):
        niah(long_folder)
    monkeypatch.setattr(lm, "score_windows", lambda *a, **k: pytest.fail("the run was evaluated"))
    for argv, name in ((["eval", str(trained_run), "--max-tokens", "64", "--no-progress"], "eval.json"),
                       (["eval", "positions", str(trained_run), "--length", "2x", "--buckets", "2", "--max-sequences", "1", "--no-progress"], "positions.png"),
                       (["eval", "niah", str(trained_run), "--tasks", "s1", "--lengths", "1x", "--samples", "1", "--no-progress"], "niah.png")):
        (trained_run / name).mkdir()
        try:
            assert main(argv) == 2
            assert f"RUN_DIR {trained_run / name} is a folder; give a file path to write to" in capsys.readouterr().err
        finally:
            (trained_run / name).rmdir()


def test_slimkv_eval_run_dir_names_its_options(trained_run, capsys):
    """The checks said context / max_tokens / batch_size, the names of the library's arguments."""
    for flag in ("--context", "--max-tokens", "--batch-size"):
        assert main(["eval", str(trained_run), flag, "0", "--no-progress"]) == 2
        assert f"{flag} must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_second_niah_run_into_the_same_out_is_refused(long_folder, tmp_path):
    """Each run rewrites niah.json from its own cells after every cell: two at once lost each other's."""
    from slimkv.common.files import FolderBusyError, folder_lock

    out = tmp_path / "niah"
    with folder_lock(out, "test"), pytest.raises(FolderBusyError, match=rf"{out} is in use by another slimkv eval niah run"):
        niah(long_folder)
    assert list(out.iterdir()) == []
    assert set(niah(long_folder)["cells"]) == {"needle-word/400/0.50"}  # the lock goes with the run


def test_fingerprinting_an_original_twice_reads_it_once(tiny_folder, monkeypatch):
    """resolve_original hashes the original's weights: convert then heal (or ppl after convert in one process) must not read them twice."""
    from slimkv.common import files
    from slimkv.pretrained import weights_fingerprint

    reads = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda path, *a: reads.append(path) or real(path, *a))
    first = weights_fingerprint(tiny_folder)
    assert weights_fingerprint(tiny_folder) == first and len(reads) == 1
    tiny_model("llama", seed=1).save_pretrained(tiny_folder)
    assert weights_fingerprint(tiny_folder) != first and len(reads) == 2  # new weights are read again


def test_an_unreadable_option_value_is_one_line_naming_the_option():
    """The YAML error came as several lines of parser context ('in "<unicode string>", line 1, column 1: ...')."""
    with pytest.raises(ValueError) as caught:
        AttentionSpec.parse("lrkv:rank=[1,2")
    assert str(caught.value) == ("entry 'lrkv:rank=[1,2': cannot read the value '[1,2' of option 'rank' (while parsing a flow sequence, expected ',' or ']', "
                                 "but got '<stream end>'); write it as YAML, e.g. 8, 0.5, sqrt or [1, 2]")


def test_depths_that_name_one_cell_are_refused():
    """A cell is keyed by its depth to 2 decimals: with --depths 0,0.001 the second overwrote the first and was reported for both."""
    with pytest.raises(ValueError, match=r"--depths 0 and 0\.001 are one cell \(depth 0\.00\): give depths at least 0\.01 apart"):
        retrieval.parse_depths("0,0.001,0.5")
    assert retrieval.parse_depths("0,0.01,0.5,1") == [0.0, 0.01, 0.5, 1.0]


def test_a_resume_does_not_reuse_a_cell_of_a_nearby_depth(long_folder, monkeypatch):
    niah(long_folder)
    monkeypatch.setattr(retrieval, "generate", lambda *a, **k: pytest.fail("a cell was run"))
    with pytest.raises(ValueError, match=r"holds the cell 'needle-word/400/0\.50' at depth 0\.5, not 0\.501; give --depths 0\.5 to reuse it"):
        niah(long_folder, depths=[0.501])


def test_a_haystack_without_lines_to_place_the_needle_at_each_depth_is_refused():
    """Needles sit at line starts: a haystack without line breaks put every needle at depth 0 and
    reported it as depth 1, and too few lines put two depths' needles on one line (the same prompts in two cells)."""
    from slimkv.retrieval.prompts import PromptBuilder

    one_line = PromptBuilder(char_tokenizer(), "x" * 3000)
    with pytest.raises(ValueError, match=r"--haystack: the \d+-token haystack of a 400-token needle-number prompt holds no line break"):
        retrieval.build_grid(one_line, [TASKS["needle-number"]], [400], [0.0, 1.0], 1, 0)
    assert retrieval.build_grid(one_line, [TASKS["needle-number"]], [400], [0.0], 1, 0)  # depth 0 needs no line break
    long_lines = PromptBuilder(char_tokenizer(), ("y" * 149 + "\n") * 40)
    with pytest.raises(ValueError, match=r"--depths 0\.45 and 0\.55 put the needle of a 700-token needle-number prompt on the same line"):
        retrieval.build_grid(long_lines, [TASKS["needle-number"]], [700], [0.45, 0.55], 1, 0)
    grid = retrieval.build_grid(long_lines, [TASKS["needle-number"]], [700], [0.0, 0.5, 1.0], 1, 0)
    assert len({cell[0].depth_actual for cell in grid.values()}) == 3
