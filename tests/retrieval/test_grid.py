"""The grid both retrieval stacks share (slimkv.retrieval.grid): the one --lengths / --depths
grammar, the recall form of it, the runner, the depth x length table and the heatmaps."""

from __future__ import annotations

import numpy as np
import pytest

from slimkv.cli import main
from slimkv.retrieval import grid, models, runs
from slimkv.retrieval.grid import (
    Cell,
    grid_cells,
    grid_table,
    length_factors,
    lengths_syntax,
    parse_depths,
    parse_lengths,
    plot_grids,
    run_grid,
)


def test_every_stack_parses_with_the_one_grammar():
    assert models.parse_lengths is runs.parse_lengths is grid.parse_lengths
    assert models.parse_depths is runs.parse_depths is grid.parse_depths


def test_lengths_are_token_counts_thousands_and_multiples():
    assert parse_lengths("1024, 2K,1.5k,") == [1024, 2048, 1536]  # spaces, case and a trailing comma ignored
    assert parse_lengths("1x,2X,300,0.5x", 128) == [128, 256, 300, 64]
    assert parse_lengths("2k,3x", 100) == [2048, 300]  # every spelling where a command has a reference length
    assert parse_lengths("1.5x", 101) == [152]  # rounded to the nearest token


@pytest.mark.parametrize(("text", "reference", "message"), [
    ("2x", None, r"^--lengths 2x: a multiple like 2x needs a reference length .* give comma-separated token counts like 2048, or counts of 1024 tokens like 2k$"),
    ("1k,abc", None, r"^--lengths: 'abc' is not a length; give comma-separated token counts like 2048"),
    ("1.5", 64, r"^--lengths: '1.5' is not a length; give .*or multiples of the training length like 2x$"),
    ("infk", None, r"^--lengths: 'infk' is not a length"),
    ("nanx", 32, r"^--lengths: 'nanx' is not a length"),
    ("2k,2048", None, r"^--lengths lists 2048 tokens twice \(2k and 2048\); give each length once$"),
    ("0", None, r"^--lengths 0: a length is at least 1 token, got 0$"),
    ("-1k", None, r"^--lengths -1k: a length is at least 1 token"),
    (" , ", None, r"^--lengths is empty"),
])
def test_other_spellings_are_refused_naming_the_accepted_form(text, reference, message):
    with pytest.raises(ValueError, match=message):
        parse_lengths(text, reference)


def test_the_syntax_says_what_2x_multiplies_where_there_is_a_reference():
    assert "2x" not in lengths_syntax() and lengths_syntax("--seq-len").endswith("or multiples of --seq-len like 2x")


def test_recall_lengths_are_whole_multiples_of_the_sequence_length_with_1x():
    assert length_factors("1x,2x,4x", 64) == (1, 2, 4)
    assert length_factors("64, 256", 64) == (1, 4)  # token counts that are multiples
    for text, message in (("1,2,4", r"^--lengths 1: recall tests at whole multiples of --seq-len \(64\), including 1x; write them as factors like "
                                    r"1x,2x,4x \(a bare number is a token count\); 1 tokens is not a multiple of 64$"),
                          ("1x,1.5x", r"^--lengths 1.5x: .*96 tokens is not a multiple of 64$"),
                          ("2x,4x", r"^--lengths 2x,4x: recall tests at whole multiples of --seq-len including 1x")):
        with pytest.raises(ValueError, match=message):
            length_factors(text, 64)


def test_recall_refuses_the_old_factor_spelling_before_any_work(tmp_path, capsys):
    from slimkv.cli.eval import recall_recipe_from_args, task_parser

    parser = task_parser("recall")
    assert recall_recipe_from_args(parser.parse_args(["--out", str(tmp_path / "o"), "--seq-len", "128", "--lengths", "1x,256"])).lengths == (1, 2)
    out = tmp_path / "out"
    assert main(["eval", "recall", "--out", str(out), "--steps", "2", "--lengths", "1,2,4"]) != 0
    assert "write them as factors like 1x,2x,4x" in capsys.readouterr().err and not out.exists()


def test_a_pretrained_model_refuses_multiples_before_it_loads(tmp_path, capsys):
    assert main(["eval", "niah", "--model", str(tmp_path / "absent"), "--lengths", "2x", "--out", str(tmp_path / "o")]) != 0
    assert "--lengths 2x: a multiple like 2x needs a reference length" in capsys.readouterr().err


def test_depths_are_distinct_fractions_a_cell_apart():
    assert parse_depths("0, 0.5,1,") == [0.0, 0.5, 1.0]
    for text in ("0.5,1.5", "0.5,0.5", "", "a", "-0.1"):
        with pytest.raises(ValueError, match=r"^--depths must be comma-separated fractions of the haystack in \[0, 1\]"):
            parse_depths(text)
    with pytest.raises(ValueError, match=r"^--depths 0\.5 and 0\.504 are one cell"):
        parse_depths("0.5,0.504")


def test_the_runner_measures_each_cell_once_in_order_and_skips_the_done():
    cells = grid_cells(["a", "b"], [10, 20], [0.0, 1.0])
    assert cells[:3] == [Cell("a", 10, 0.0), Cell("a", 10, 1.0), Cell("a", 20, 0.0)] and len(cells) == 8
    seen: list[Cell] = []
    kept: dict[Cell, int] = {}
    run_grid(cells, lambda cell: seen.append(cell) or cell.length, kept.__setitem__, done={cells[0]}, progress=False)
    assert seen == cells[1:] and kept == {cell: cell.length for cell in cells[1:]}


def test_the_table_has_a_row_per_depth_and_a_column_per_length():
    table = grid_table([256, 512], [0.0, 0.5], lambda n, d: n / 1024 + d, summary=[("mean", ["0.50", "0.75"])])
    assert table == ("| depth | 256 | 512 |\n| ---: | ---: | ---: |\n| 0.00 | 0.25 | 0.50 |\n| 0.50 | 0.75 | 1.00 |\n| mean | 0.50 | 0.75 |")


def test_the_heatmaps_are_one_png_and_refuse_a_grid_of_another_shape(tmp_path):
    plot_grids({"s1": np.zeros((2, 3)), "s2": np.ones((2, 3))}, [1, 2, 3], [0.0, 1.0], tmp_path / "g.png", suptitle="t",
               length_labels={"s1": ["a", "b", "c"], "s2": ["d", "e", "f"]})
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"panel 's1' has scores of shape \(3, 2\), not \(depths, lengths\) = \(2, 3\)"):
        plot_grids({"s1": np.zeros((3, 2))}, [1, 2, 3], [0.0, 1.0], tmp_path / "h.png")


def test_tasks_are_named_once_each_or_all_in_both_stacks():
    from slimkv.retrieval import prompts

    assert runs.parse_tasks("S1, s3") == ["s1", "s3"] and runs.parse_tasks("all") == list(runs.TASKS)
    assert [t.name for t in prompts.parse_tasks("all")] == list(prompts.TASKS)
    with pytest.raises(ValueError, match=r"^--tasks: 's9' is not allowed; allowed values: s1, s2, s3 \(or all\)$"):
        runs.parse_tasks("s1,s9")
    with pytest.raises(ValueError, match=r"^--tasks must name each of s1, s2, s3 at most once, got 's1,s1'$"):
        runs.parse_tasks("s1,s1")
