"""The one markdown table helper (slimkv.common.markdown): alignment, escaping, and errors that
name what is wrong."""

from __future__ import annotations

import pytest

from slimkv.common.markdown import markdown_table


def test_a_table_has_a_header_an_alignment_row_and_one_line_per_row():
    assert markdown_table(["model", "ppl"], [["original", "12.34"], ["mla 0.5", 13.0]], align=["left", "right"]) == (
        "| model | ppl |\n| --- | ---: |\n| original | 12.34 |\n| mla 0.5 | 13.0 |")
    assert markdown_table(["a", "b"], [], align="center") == "| a | b |\n| :---: | :---: |"
    assert markdown_table([1024, 2048], [["", "x"]]) == "| 1024 | 2048 |\n| --- | --- |\n|  | x |"  # an empty cell stays a cell


def test_a_pipe_inside_a_cell_is_escaped():
    assert markdown_table(["label"], [["a|b"]]).splitlines()[-1] == "| a\\|b |"


def test_bad_alignments_and_rows_are_named():
    with pytest.raises(ValueError, match="align='middle' is not allowed; allowed values: left, right, center"):
        markdown_table(["a"], [["1"]], align="middle")
    with pytest.raises(ValueError, match="align names 1 columns, the headers 2"):
        markdown_table(["a", "b"], [], align=["left"])
    with pytest.raises(ValueError, match="row 1 has 1 cells, the headers 2"):
        markdown_table(["a", "b"], [["1", "2"], ["3"]])
