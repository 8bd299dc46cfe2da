"""A prepared dataset on disk and :class:`TokenDataset`, its in-memory view.

Layout of ``cache_dir()/datasets/<name>/``:

- ``train.npy``, ``val.npy``: token ids, stored as uint16 (vocabularies up to 65536) and loaded
  as int64; each split is its documents joined with ``"\\n\\n"`` and encoded in one piece;
- ``token_bytes.npy``: int64 (vocab_size,), UTF-8 byte length of each id;
- ``tokenizer.json``: the byte-level BPE (``tokenizers`` format);
- ``val.txt``: the exact UTF-8 text whose tokens are ``val.npy``;
- ``manifest.json``: sources, split, options, counts, library versions and the sha256 of every
  file above (checked on load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from slimkv.common.checks import check_name
from slimkv.common.files import sha256_file
from slimkv.common.paths import cache_dir

SHAKESPEARE = "shakespeare"
MANIFEST = "manifest.json"


def check_dataset_name(name: str) -> None:
    """ValueError naming ``name`` unless it is a safe folder name (letters, digits, ``_.-``)."""
    check_name("name", name)


def datasets_dir() -> Path:
    """``cache_dir()/datasets`` (created on first use)."""
    folder = cache_dir() / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def prepare_command(name: str) -> str:
    """The CLI command that builds dataset ``name`` (for error messages)."""
    if name == SHAKESPEARE:
        return "slimkv data prepare shakespeare"
    return f"slimkv data prepare --text PATH [PATH ...] --name {name}"


def file_problem(folder: Path, manifest: dict[str, Any]) -> str | None:
    """Why the files in ``folder`` do not match the manifest's sizes and hashes (None if they do)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "the manifest lists no files"
    for filename, expected in files.items():
        path = folder / filename
        if not path.is_file():
            return f"{filename} is missing"
        if path.stat().st_size != expected.get("bytes"):
            return f"{filename} has {path.stat().st_size} bytes, the manifest says {expected.get('bytes')}"
        if sha256_file(path) != expected.get("sha256"):
            return f"{filename} does not match its sha256 in the manifest"
    return None


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``folder``, or None when absent or unreadable."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


@dataclass(eq=False)
class TokenDataset:
    """A prepared dataset: token arrays, per-token byte lengths and the tokenizer.

    ``train``/``val`` are 1-D int64 arrays of token ids (stored as uint16 on disk, converted once on
    load). ``token_bytes`` is int64 (vocab_size,): the UTF-8 byte length of each id, so the bytes of
    any token span are ``token_bytes[ids].sum()`` and ``token_bytes[val].sum() == len(val_text()
    .encode("utf-8"))`` holds exactly.
    """

    name: str
    path: Path
    train: np.ndarray
    val: np.ndarray
    token_bytes: np.ndarray
    tokenizer: Tokenizer = field(repr=False)
    vocab_size: int
    manifest: dict[str, Any] = field(repr=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens are added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Any) -> str:
        """Text of a sequence of ids (list, numpy array or CPU/GPU tensor of any shape, flattened)."""
        flat = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.tokenizer.decode(np.asarray(flat, dtype=np.int64).reshape(-1).tolist(), skip_special_tokens=False)

    def val_text(self) -> str:
        """The exact text whose tokens are ``val`` (documents joined with ``"\\n\\n"``)."""
        return (self.path / "val.txt").read_text(encoding="utf-8")


def load_dataset(name: str = SHAKESPEARE) -> TokenDataset:
    """Load a prepared dataset from ``cache_dir()/datasets/<name>`` after checking its file hashes.

    FileNotFoundError naming the ``slimkv data prepare ...`` command when it is not prepared;
    ValueError when its files do not match the manifest (rerunning the command rebuilds it).
    """
    check_dataset_name(name)
    folder = cache_dir() / "datasets" / name
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"dataset {name!r} is not prepared in {folder}: run `{prepare_command(name)}`")
    problem = file_problem(folder, manifest)
    if problem:
        raise ValueError(f"dataset {name!r} in {folder} is damaged ({problem}): rebuild it with `{manifest.get('prepare_command', prepare_command(name))}`")
    token_bytes = np.load(folder / "token_bytes.npy", allow_pickle=False).astype(np.int64)
    return TokenDataset(
        name=name,
        path=folder,
        train=np.load(folder / "train.npy", allow_pickle=False).astype(np.int64),
        val=np.load(folder / "val.npy", allow_pickle=False).astype(np.int64),
        token_bytes=token_bytes,
        tokenizer=Tokenizer.from_file(str(folder / "tokenizer.json")),
        vocab_size=int(manifest["vocab_size"]),
        manifest=manifest,
    )
