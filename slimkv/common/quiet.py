"""Quieting transformers' own progress bars (a "Writing model shards" bar per save) while slimkv
shows its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' own progress bars (a "Writing model shards" bar per checkpoint) meanwhile."""
    from transformers.utils import logging as hf_logging  # transformers is imported only when this is used

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
