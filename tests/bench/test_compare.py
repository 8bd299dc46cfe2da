"""``slimkv compare`` / ``report`` / ``sweep``: entry parsing, the default table, aggregation and
claims on hand-made numbers, and one tiny end-to-end comparison (2 kinds x 2 seeds)."""

from __future__ import annotations

import json
import math
import re

import pytest

from slimkv.attention import build_attention, kind_spec
from slimkv.bench.compare import run_compare
from slimkv.bench.entries import (
    parse_entries,
    parse_entry,
    parse_kind_overrides,
    parse_seeds,
    recipe_shape,
    split_entries,
    sweep_specs,
)
from slimkv.bench.report import PLOT_BPB, PLOT_DECODE, load_report, render_markdown
from slimkv.bench.statistics import aggregate, compare_pair, summarize
from slimkv.cli import main
from slimkv.common.files import folder_lock
from slimkv.train import TrainConfig
from tests.train.tiny import tiny_config

PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- parsing


def test_entries_take_table_defaults_overrides_and_their_own_options():
    recipe = TrainConfig()  # 4 heads of 32
    entries = parse_entries(["mha", "lrkv", "lrkv:rank=4", "gqa:n_kv_heads=1", "swa+kvm:kvm.schedule=sqrt"], recipe, parse_kind_overrides(["lrkv.rope_placement=none"]))
    by_label = {e.label: e for e in entries}
    assert by_label["lrkv"].options == {"lrkv": {"rank": 8, "rope_placement": "none"}}
    assert by_label["lrkv:rank=4"].options == {"lrkv": {"rank": 4, "rope_placement": "none"}}
    assert by_label["gqa:n_kv_heads=1"].options == {"gqa": {"n_kv_heads": 1}}
    hybrid = by_label["swa+kvm:kvm.schedule=sqrt"]
    assert hybrid.kinds == ("swa", "kvm") and hybrid.options["kvm"]["schedule"] == "sqrt" and hybrid.options["swa"] == {"window": 64}
    assert hybrid.train_values()["attention"] == ["swa", "kvm"] and hybrid.train_values()["attention_options"] == {}
    assert "comparable preset" in by_label["lrkv"].defaults["lrkv"] and "lrkv" not in by_label["gqa:n_kv_heads=1"].defaults
    # explicit split ranks replace the table's rank
    assert parse_entry("lrkv:rank_k=2,rank_v=6", recipe).options == {"lrkv": {"rank_k": 2, "rank_v": 6}}
    assert split_entries("mha, lrkv:rank=8,rope_placement=none ,gqa") == ["mha", "lrkv:rank=8,rope_placement=none", "gqa"]
    assert split_entries(["mha", "lrkv:rank=8,rope_placement=none", "gqa"]) == ["mha", "lrkv:rank=8,rope_placement=none", "gqa"]
    # an option without a kind in a pattern applies to every kind of the entry
    shared = parse_entry("swa+kvm:qk_norm=true,swa.window=8", recipe)
    assert shared.options["swa"]["qk_norm"] is True and shared.options["kvm"]["qk_norm"] is True and shared.options["swa"]["window"] == 8


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lrkv:rnk=8", r"unknown option 'rnk' for attention kind 'lrkv' \(did you mean rank"),
        ("lrkv:rank", r"option 'rank' needs a value"),
        ("mlaa", r"unknown attention kind 'mlaa' \(did you mean mla"),
        ("swa+kvm:window=3", r"entry 'swa\+kvm:window=3': unknown option 'window' for attention kind 'kvm'"),
        ("swa+kvm:mla.kv_rank=3", r"option 'mla.kv_rank=3' names kind 'mla', which the entry does not use"),
        ("gqa:n_kv_heads=3", r"entry 'gqa:n_kv_heads=3': .*n_kv_heads=3 must divide n_heads=4"),
    ],
)
def test_bad_entries_name_the_bad_option_before_work(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_entries([spec], TrainConfig())


def test_bad_kind_options_and_seeds_are_refused():
    with pytest.raises(ValueError, match=r"entry 'lrkv': unknown option 'rnk' for attention kind 'lrkv'"):
        parse_entries(["lrkv"], TrainConfig(), parse_kind_overrides(["lrkv.rnk=1"]))
    with pytest.raises(ValueError, match=r"--kind-option names lrkv, which no entry uses"):
        parse_entries(["mha"], TrainConfig(), parse_kind_overrides(["lrkv.rank=1"]))
    with pytest.raises(ValueError, match=r"KIND.NAME=VALUE"):
        parse_kind_overrides(["rank=1"])
    with pytest.raises(ValueError, match=r"same entry"):
        parse_entries(["mha", "mha"], TrainConfig())
    assert parse_seeds("3", base=5) == [5, 6, 7] and parse_seeds("0,4") == [0, 4]
    with pytest.raises(ValueError, match=r"--seeds"):
        parse_seeds("three")
    with pytest.raises(ValueError, match=r"--seeds 1000000000000: at most 1000 seeds"):  # compare too, before building the list
        parse_seeds("1000000000000")


def test_default_table_puts_tunable_kinds_at_half_of_mha():
    recipe = TrainConfig()
    mha = build_attention("mha", recipe.d_model, recipe.n_heads)
    for kind in ("gqa", "lrkv", "mla"):
        options, _ = kind_spec(kind).comparable(recipe_shape(recipe))
        attn = build_attention(kind, recipe.d_model, recipe.n_heads, **options)
        assert attn.cache_bytes(100) / mha.cache_bytes(100) == pytest.approx(0.5), kind


def test_sweep_is_a_compare_over_lrkv_ranks_plus_references():
    specs = sweep_specs("lrkv", [0, 4, 8, 4])
    assert specs == ["mha", "gqa", "mqa", "lrkv:rank=0", "lrkv:rank=4", "lrkv:rank=8"]
    entries = parse_entries(specs, TrainConfig())
    assert [e.options["lrkv"]["rank"] for e in entries[3:]] == [0, 4, 8]
    with pytest.raises(ValueError, match=r"allowed values: lrkv"):
        sweep_specs("kvm", [1])
    with pytest.raises(ValueError, match=r"--ranks must be integers >= 0"):
        sweep_specs("lrkv", [-1])


# ---------------------------------------------------------------- aggregation and claims


def test_summarize_is_mean_sample_std_min_max():
    stat = summarize([1.0, 2.0, 3.0, 4.0])
    assert stat["mean"] == 2.5 and stat["std"] == pytest.approx(math.sqrt(5 / 3)) and (stat["min"], stat["max"], stat["n"]) == (1.0, 4.0, 4)
    assert summarize([2.0])["std"] is None


def _row(label, values):
    return {"label": label, "val_bpb": summarize(values)}


def test_claims_need_three_seeds_separated_ranges_and_more_than_the_spread():
    ref = _row("mha", [2.00, 2.01, 2.02])
    assert "lrkv lower BPB than mha" in compare_pair(_row("lrkv", [1.90, 1.91, 1.92]), ref)["verdict"]
    assert "higher BPB" in compare_pair(_row("mqa", [2.10, 2.11, 2.12]), ref)["verdict"]
    assert compare_pair(_row("gqa", [1.99, 2.015, 2.03]), ref)["verdict"].startswith("within the spread")
    assert compare_pair(_row("gqa", [1.5, 1.6]), _row("mha", [2.0, 2.1]))["verdict"].startswith("no claim: 2 seed(s)")
    pair = compare_pair(_row("lrkv", [1.90, 1.91, 1.92]), ref)
    assert pair["delta_bpb"] == pytest.approx(-0.10) and pair["sum_of_stds"] == pytest.approx(0.02)


def test_aggregate_refuses_runs_of_different_shapes():
    entry = parse_entry("mha", TrainConfig())
    run = {"label": "mha", "seed": 0, "parameters": 1, "val_bpb": 1.0, "val_ce": 1.0, "diversity": {"mean_r_eff_over_heads": None}, "cache": {"ratio_to_mha": 1.0}}
    with pytest.raises(ValueError, match="cache size differs between seeds"):
        aggregate([entry], [run, {**run, "seed": 1, "cache": {"ratio_to_mha": 0.5}}])


# ---------------------------------------------------------------- end to end


def test_compare_two_kinds_two_seeds_writes_a_resumable_report(tmp_path, capsys):
    recipe = tiny_config(steps=2)
    entries = parse_entries(["mha", "gqa"], recipe)
    out = tmp_path / "cmp"
    report = run_compare(entries, recipe, [0, 1], out, eval_tokens=64, decode_contexts=[8, 16], decode_repeats=1, progress=False)
    assert [(r["label"], r["seed"], r["reused"]) for r in report["runs"]] == [("mha", 0, False), ("mha", 1, False), ("gqa", 0, False), ("gqa", 1, False)]
    mha, gqa = report["aggregate"]
    bpbs = [r["val_bpb"] for r in report["runs"] if r["label"] == "gqa"]
    assert bpbs[0] != bpbs[1]  # the seeds differ
    assert gqa["val_bpb"]["mean"] == pytest.approx(sum(bpbs) / 2) and gqa["val_bpb"]["min"] == min(bpbs)
    assert mha["cache"]["ratio_to_mha"] == 1.0 and gqa["cache"]["ratio_to_mha"] == 0.5
    assert gqa["cache"]["bytes_per_token_model"] == 2 * gqa["cache"]["bytes_per_token_per_layer"] == 2 * (2 * 2 * 8 * 4)
    assert report["comparisons"][0]["verdict"].startswith("no claim")  # 2 seeds never support a claim
    assert set(report["decode"]["per_entry"]) == {"mha", "gqa"} and report["decode"]["contexts"] == [8, 16]
    assert 0 < gqa["r_eff_over_heads"]["mean"] <= 1
    for name in (PLOT_BPB, PLOT_DECODE):
        assert (out / name).read_bytes()[:8] == PNG
    markdown = (out / "report.md").read_text()
    assert "| gqa | n_kv_heads=2 |" in markdown and "± " in markdown
    assert "[1/4] mha seed 0" in capsys.readouterr().out

    again = run_compare(entries, recipe, [0, 1], out, eval_tokens=64, decode_contexts=[8], decode_repeats=1, progress=False)
    assert all(r["reused"] for r in again["runs"]) and [r["val_bpb"] for r in again["runs"]] == [r["val_bpb"] for r in report["runs"]]
    assert "reused the finished run" in capsys.readouterr().out

    # `slimkv report` regenerates the markdown from the JSON alone
    stored = load_report(out / "report.json")
    regenerated = tmp_path / "regen"
    assert main(["report", str(out / "report.json"), "--out", str(regenerated)]) == 0
    assert (regenerated / "report.md").read_text() == (out / "report.md").read_text() == render_markdown(stored)
    assert (regenerated / PLOT_BPB).read_bytes()[:8] == PNG


def test_cli_errors_are_clean(tmp_path, capsys):
    assert main(["compare", "--kinds", "mha,lrkv:rnk=2", "--out", str(tmp_path / "x")]) == 2
    assert "unknown option 'rnk'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text(json.dumps({"format": 99}))
    assert main(["report", str(tmp_path / "bad.json")]) == 2
    assert "is not a report.json" in capsys.readouterr().err


def test_compare_evaluates_another_text_beside_val(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("An entirely different text, with its own words and lines.\n" * 40)
    recipe = tiny_config(steps=2)
    entries = parse_entries(["mha", "mqa"], recipe)
    report = run_compare(entries, recipe, [0], tmp_path / "cmp", eval_tokens=64, decode_contexts=[], other_text=str(other), progress=False)
    for run in report["runs"]:
        assert run["other"]["text"] == str(other) and run["other"]["bpb"] > 0 and run["other"]["bpb"] != run["val_bpb"]
    assert report["aggregate"][1]["other_bpb"]["mean"] == report["runs"][1]["other"]["bpb"]
    assert [c["metric"] for c in report["comparisons_other"]] == ["other_bpb"]
    assert "BPB (out of domain)" in (tmp_path / "cmp" / "report.md").read_text()
    again = run_compare(entries, recipe, [0], tmp_path / "cmp", eval_tokens=64, decode_contexts=[], progress=False)
    assert not any(r["reused"] for r in again["runs"]), "a run evaluated on another text set is evaluated again without it"


def test_a_run_held_by_another_process_is_left_out(tmp_path, capsys):
    recipe = tiny_config(steps=2)
    entries = parse_entries(["mha", "mqa"], recipe)
    with folder_lock(tmp_path / "cmp" / "runs" / "mqa" / "seed0"):
        report = run_compare(entries, recipe, [0], tmp_path / "cmp", eval_tokens=64, decode_contexts=[], progress=False)
    assert [row["label"] for row in report["aggregate"]] == ["mha"] and report["busy_runs"] == [str(tmp_path / "cmp" / "runs" / "mqa" / "seed0")]
    assert "another process is training" in capsys.readouterr().out
    assert "Left out (another process" in (tmp_path / "cmp" / "report.md").read_text()


@pytest.mark.slow
def test_two_workers_give_the_serial_numbers(tmp_path, capsys):
    """The same entries and seeds trained one at a time and in two worker processes: the same rows
    (timings and folders aside), in the same order."""
    recipe = tiny_config(steps=3)
    entries = parse_entries(["mha", "mqa"], recipe)
    serial = run_compare(entries, recipe, [0, 1], tmp_path / "serial", eval_tokens=64, decode_contexts=[], progress=False)
    capsys.readouterr()
    parallel = run_compare(entries, recipe, [0, 1], tmp_path / "parallel", eval_tokens=64, decode_contexts=[], progress=False, workers=2)
    printed = capsys.readouterr().out
    assert "2 worker processes" in printed and len(re.findall(r"^\[\d/4\] .* seed \d: val BPB ", printed, re.M)) == 4

    def numbers(report):
        return [{k: v for k, v in run.items() if k not in ("run_dir", "train_seconds", "train_tokens_per_s")} for run in report["runs"]]

    assert numbers(parallel) == numbers(serial) and len({run["val_bpb"] for run in serial["runs"]}) == 4
    assert [(run["label"], run["seed"]) for run in parallel["runs"]] == [("mha", 0), ("mha", 1), ("mqa", 0), ("mqa", 1)]
    assert parallel["aggregate"][1]["val_bpb"] == serial["aggregate"][1]["val_bpb"]


def test_bad_worker_count_is_refused_before_work(tmp_path, capsys):
    assert main(["compare", "--kinds", "mha", "--workers", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--workers must be an integer >= 1, got 0" in capsys.readouterr().err and not (tmp_path / "x").exists()
