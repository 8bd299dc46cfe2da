"""The recall frontier: default entries, the sweep (resumable, concurrent-safe), the report and the command line."""

import json
import re

import pytest
import torch

from slimkv.attention import ATTENTION_KINDS, kind_spec
from slimkv.bench.entries import Entry, recipe_shape
from slimkv.cli import main
from slimkv.common.files import folder_lock
from slimkv.model import SlimKVForCausalLM
from slimkv.recall.frontier import PLOT_FILE, family, frontier_entries, render_markdown, run_recall, short_labels, task_text
from slimkv.recall.mqar import MQARTask
from slimkv.recall.recipe import RecallRecipe, model_config

TINY = RecallRecipe(task=MQARTask(vocab_size=40, seq_len=32, n_pairs=4), d_model=32, n_heads=2, train_pairs=(2, 4), steps=4, batch_size=4,
                    eval_sequences=32, eval_every=2, checkpoint_every=0, log_every=2, warmup_steps=1)


def test_frontier_covers_every_kind_at_several_cache_sizes():
    recipe = RecallRecipe()
    entries = frontier_entries(recipe)
    kinds = {k for e in entries for k in e.kinds}
    assert set(ATTENTION_KINDS) <= kinds
    shape = recipe_shape(recipe)
    for kind in ATTENTION_KINDS:
        if kind_spec(kind).presets.sizes is None:
            continue
        sizes = {_bytes(e, recipe) for e in entries if e.kinds == (kind,)}
        assert len(sizes) >= (3 if kind != "gqa" else 1), f"{kind} needs distinct cache sizes, got {sorted(sizes)}"
    mqa, gqa, mha = (_bytes(Entry(k, (k,), {k: o}), recipe) for k, o in (("mqa", {}), ("gqa", {"n_kv_heads": 2}), ("mha", {})))
    assert mqa < gqa < mha, "MHA, GQA and MQA are one curve of three cache sizes"
    hybrids = [e for e in entries if e.kinds == ("swa", "kvm")]
    assert len(hybrids) >= 3 and len({_bytes(e, recipe) for e in hybrids}) == len(hybrids)
    assert len({e.label for e in entries}) == len(entries) and shape.seq_len == 64


def _bytes(entry: Entry, recipe: RecallRecipe) -> int:
    """Analytic cache bytes of the entry's model at the training length (built on the meta device)."""
    with torch.device("meta"):
        model = SlimKVForCausalLM(model_config(entry.spec(), recipe))
    return model.cache_bytes(recipe.seq_len)


def test_sweep_writes_a_report_and_reuses_finished_runs(tmp_path, capsys):
    entries = [Entry("mha", ("mha",), {"mha": {}}), Entry("swa:window=4", ("swa",), {"swa": {"window": 4}})]
    report = run_recall(entries, TINY, [0, 1], tmp_path, progress=False)
    assert [row["label"] for row in report["aggregate"]] == ["mha", "swa:window=4"]
    row = report["aggregate"][1]
    assert row["seeds"] == [0, 1] and row["lengths"]["1x"]["accuracy"]["n"] == 2
    assert row["lengths"]["4x"]["cache_bytes_per_token"] < row["lengths"]["1x"]["cache_bytes_per_token"]
    assert (tmp_path / PLOT_FILE).stat().st_size > 0 and json.loads((tmp_path / "report.json").read_text())["runs"]
    markdown = (tmp_path / "report.md").read_text()
    assert markdown == render_markdown(report) and "| swa:window=4 |" in markdown
    capsys.readouterr()
    again = run_recall(entries, TINY, [0, 1], tmp_path, progress=False)
    assert all(run["reused"] for run in again["runs"]) and again["aggregate"] == report["aggregate"]
    assert main(["report", str(tmp_path / "report.json"), "--out", str(tmp_path / "copy")]) == 0  # regenerated from report.json alone
    assert (tmp_path / "copy" / "report.md").read_text() == render_markdown(again) and (tmp_path / "copy" / PLOT_FILE).is_file()


def test_a_run_held_by_another_process_is_left_out(tmp_path, capsys):
    entries = [Entry("mha", ("mha",), {"mha": {}}), Entry("mqa", ("mqa",), {"mqa": {}})]
    with folder_lock(tmp_path / "runs" / "mqa" / "seed0"):
        report = run_recall(entries, TINY, [0], tmp_path, progress=False)
    assert [row["label"] for row in report["aggregate"]] == ["mha"]
    assert report["busy_runs"] == [str(tmp_path / "runs" / "mqa" / "seed0")]
    assert "another process is training" in capsys.readouterr().out
    assert family({"kinds": ["mqa"]}) == family({"kinds": ["gqa"]}) != family({"kinds": ["swa", "kvm"]})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--gap", "normal"], "gap='normal' is not allowed; allowed values: power, uniform"),
        (["--kinds", "mha,nope"], "nope"),
        (["--lengths", "2,4"], "including 1"),
        (["--train-pairs", "2,x"], "--train-pairs must be comma-separated integers"),
        (["--seeds", "0,0"], "--seeds"),
        (["--threads", "0"], "--threads"),
        (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
        (["--workers", "2", "--threads", "2"], "--threads 2 with --workers 2"),
        (["--kinds", "lrkv:rnk=2"], "rnk"),
    ],
)
def test_bad_options_are_named_before_any_work(tmp_path, capsys, arguments, message):
    out = tmp_path / "out"
    assert main(["eval", "recall", "--out", str(out), "--steps", "2", *arguments]) != 0
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_plot_labels_drop_the_options_a_family_shares():
    rows = [{"label": label, "kinds": kinds} for label, kinds in [
        ("mha", ["mha"]), ("gqa:n_kv_heads=2", ["gqa"]), ("mqa", ["mqa"]),
        ("swa+kvm:swa.window=8,kvm.min_rows=4", ["swa", "kvm"]), ("swa+kvm:swa.window=8,kvm.min_rows=16", ["swa", "kvm"]),
        ("lrkv:rank=1", ["lrkv"])]]
    assert short_labels(rows) == {"mha": "mha", "gqa:n_kv_heads=2": "gqa:n_kv_heads=2", "mqa": "mqa", "swa+kvm:swa.window=8,kvm.min_rows=4": "kvm.min_rows=4",
                                  "swa+kvm:swa.window=8,kvm.min_rows=16": "kvm.min_rows=16", "lrkv:rank=1": "lrkv:rank=1"}


def test_needles_task_text_names_the_value_kind():
    """The report's task sentence says what the values are: words or digits, never both."""
    base = {"task": "needles", "n_pairs": 4, "seq_len": 128, "dataset": "shakespeare", "digits": 2, "value_words": 64}
    assert "word values" in task_text({**base, "values": "words"}) and "digit" not in task_text({**base, "values": "words"})
    assert "2-digit values" in task_text({**base, "values": "digits"})


@pytest.mark.slow
def test_two_workers_give_the_serial_numbers(tmp_path, capsys):
    """The same sweep one run at a time and in two worker processes: the same results (timings and
    folders aside), in the same order."""
    entries = [Entry("mha", ("mha",), {"mha": {}}), Entry("swa:window=4", ("swa",), {"swa": {"window": 4}})]
    serial = run_recall(entries, TINY, [0, 1], tmp_path / "serial", progress=False)
    capsys.readouterr()
    parallel = run_recall(entries, TINY, [0, 1], tmp_path / "parallel", progress=False, workers=2)
    printed = capsys.readouterr().out
    assert "2 worker processes" in printed and len(re.findall(r"^\[\d/4\] .* seed \d: accuracy 1x ", printed, re.M)) == 4

    def numbers(report):
        return [{k: v for k, v in run.items() if k not in ("run_dir", "train_seconds", "threads")} for run in report["runs"]]

    assert numbers(parallel) == numbers(serial) and len({run["final_loss"] for run in serial["runs"]}) == 4
    assert [(run["label"], run["seed"]) for run in parallel["runs"]] == [("mha", 0), ("mha", 1), ("swa:window=4", 0), ("swa:window=4", 1)]
    assert {run["threads"] for run in parallel["runs"]} == {1}
