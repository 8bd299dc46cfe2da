"""A converted folder's manifest (``slimkv_conversion.json``) read back: the folder's conversion,
whether it was made with given options (what ``convert`` and the benchmarks reuse instead of
converting again), its ``--to`` text in today's spelling (``slimkv.common.vocabulary``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from slimkv.common.files import read_json
from slimkv.common.vocabulary import current_method, written_in
from slimkv.convert.methods import parse_method
from slimkv.pretrained.loading import CONVERTED_MANIFEST


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """The manifest of the conversion in ``out_dir``; ValueError when the folder is not one."""
    out_dir = Path(out_dir).expanduser()
    if not (out_dir / CONVERTED_MANIFEST).is_file():
        raise ValueError(f"--out {out_dir} holds no conversion ({CONVERTED_MANIFEST} is missing); convert a model there first")
    return read_json(out_dir / CONVERTED_MANIFEST, expect=dict)


def finished_conversion(out_dir: str | Path, options: Any) -> dict[str, Any] | None:
    """The manifest of ``out_dir`` when it holds a finished conversion made with exactly
    ``options``, else None: what the benchmarks and the demo reuse instead of converting again
    (the manifest's ``healing`` says whether and how it was healed since)."""
    path = Path(out_dir).expanduser() / CONVERTED_MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path, expect=dict)
    return manifest if same_options(stored_options(manifest), asdict(options)) else None


def stored_options(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's ``options`` with its ``--to`` text spelled as today (``slimkv.common.vocabulary``):
    a folder converted before the renames (``mla+kvm``, ``kvm:rows``, ``lrkv:rope``, the old kvm defaults) reads as it was made."""
    options = dict(manifest.get("options") or {})
    if isinstance(options.get("method"), str):
        options["method"] = current_method(options["method"], written_in=written_in(manifest))
    return options


def same_options(stored: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether two ``ConvertOptions`` (as dicts) make the same conversion: every field equal, the
    ``--to`` texts by the method and settings they parse to (``kvm:a=1,b=2`` is ``kvm:b=2,a=1``); a
    field a folder's manifest predates (``budget_windows``) reads as None, the default of every such field."""
    if any(stored.get(k) != wanted.get(k) for k in (stored.keys() | wanted.keys()) - {"method"}):
        return False
    return same_method(stored.get("method"), wanted.get("method"))


def same_method(a: Any, b: Any) -> bool:
    """Whether two ``--to`` texts name the same method with the same settings (defaults filled in)."""
    if a == b:
        return True
    try:
        (method_a, settings_a), (method_b, settings_b) = parse_method(str(a)), parse_method(str(b))
    except ValueError:
        return False
    return method_a.name == method_b.name and settings_a == settings_b
