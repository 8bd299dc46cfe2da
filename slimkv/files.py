"""Atomic file writes shared by every command: a reader never sees a half-written file.

Each writer fills a temporary sibling (named after the process, so concurrent writers do not
collide) and moves it into place with ``os.replace``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON (UTF-8, non-ASCII kept) atomically."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def save_figure(fig: Any, path: str | Path, *, tight: bool = True) -> None:
    """Save a matplotlib figure as PNG atomically (dpi 120; ``tight`` crops to the drawn area) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    fig.savefig(tmp, dpi=120, **({"bbox_inches": "tight"} if tight else {}))
    plt.close(fig)
    os.replace(tmp, path)
