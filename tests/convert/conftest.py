"""A tiny local Llama folder with calibration and held-out texts (no downloads), for the convert tests."""

from __future__ import annotations

import pytest

import slimkv.convert.pipeline as pipeline
from slimkv.convert.pipeline import ConvertOptions
from tests.compress.conftest import (
    CALIB_LINES,
    HELD_OUT_LINES,
    one_thread,  # noqa: F401 (an autouse fixture)
    write_tiny_llama_folder,
)

CALIB = CALIB_LINES * 30
HELD_OUT = HELD_OUT_LINES * 10


@pytest.fixture
def tiny_folder(tmp_path):
    return write_tiny_llama_folder(tmp_path, CALIB, HELD_OUT)


def options(method: str, ratio: float, tmp_path) -> ConvertOptions:
    return ConvertOptions(method, ratio, calib=str(tmp_path / "calib.txt"), calib_tokens=96, calib_seq_len=32)


@pytest.fixture
def no_loading(monkeypatch):
    """Make loading the source model an error: a check that fires first happened before any work."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded: the check did not come before the work")

    monkeypatch.setattr(pipeline, "load_pretrained", refuse)
