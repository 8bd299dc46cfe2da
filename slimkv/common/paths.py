"""Where slimkv keeps downloaded and converted assets: ``$SLIMKV_CACHE`` or ``~/.cache/slimkv``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (created on first use); never inside the git checkout unless asked."""
    root = Path(os.environ.get("SLIMKV_CACHE") or Path.home() / ".cache" / "slimkv").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root
