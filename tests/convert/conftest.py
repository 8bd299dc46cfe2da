"""A tiny local Llama folder with calibration and held-out texts (no downloads), for the convert tests."""

from __future__ import annotations

import pytest

from slimkv.convert.pipeline import ConvertOptions
from tests.compress.conftest import char_tokenizer, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

CALIB = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 30
HELD_OUT = "Is this a dagger which I see before me,\nThe handle toward my hand? Come, let me clutch thee.\n" * 10


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(CALIB)
    (tmp_path / "held.txt").write_text(HELD_OUT)
    return folder


def options(method: str, ratio: float, tmp_path) -> ConvertOptions:
    return ConvertOptions(method, ratio, calib=str(tmp_path / "calib.txt"), calib_tokens=96, calib_seq_len=32)
