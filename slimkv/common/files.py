"""Files and folders that readers never see half-written, and locks that keep runs apart.

* ``write_text`` / ``write_json`` fill a temporary sibling (named after the process, so
  concurrent writers do not collide) and move it into place with ``os.replace``.
* ``read_json`` names the file in every error (a corrupt file says which file is corrupt).
* ``atomic_directory`` stages a whole folder and swaps it in; ``existing_directory`` finds the
  complete copy even if a swap was interrupted.
* ``check_output_folder`` / ``output_folder`` publish a whole output folder (a compressed or
  converted model): the destination is checked before any work, the new folder is written
  beside it and swapped in, and nothing slimkv did not write is ever deleted.
* ``folder_lock`` holds an exclusive advisory lock on a folder (the folder itself, no lock file)
  for the life of a run, so a second process writing into the same folder gets a clear error
  instead of interleaved files.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class FolderBusyError(RuntimeError):
    """Another process holds the lock on a folder."""


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating the parent folder."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file path to write to")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON (UTF-8, non-ASCII kept) atomically."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def read_json(path: str | Path, *, expect: type | None = None) -> Any:
    """Parse the JSON file at ``path``; ValueError naming the file if it is not valid JSON (or
    not of type ``expect``), FileNotFoundError naming it if it is missing."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise ValueError(f"{path} is not a UTF-8 JSON file ({err.__class__.__name__})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); the file is damaged or was edited by hand") from None
    if expect is not None and not isinstance(data, expect):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected a JSON {'object' if expect is dict else expect.__name__}")
    return data


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def save_figure(fig: Any, path: str | Path, *, tight: bool = True) -> None:
    """Save a matplotlib figure as PNG atomically (dpi 120; ``tight`` crops to the drawn area)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    fig.savefig(tmp, dpi=120, format="png", **({"bbox_inches": "tight"} if tight else {}))
    os.replace(tmp, path)


def check_folder_target(path: str | Path, option: str = "--out") -> None:
    """A folder slimkv will write into must not be an existing file (checked before any work)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file; give a folder")


def _retired(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target`` (the old one is moved
    aside first and deleted last, so ``existing_directory`` always finds a complete one). Only
    for folders slimkv owns entirely (a checkpoint, a saved model): the old folder is deleted."""
    target = Path(target)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = _retired(target)
    shutil.rmtree(retired, ignore_errors=True)
    if target.exists():
        os.replace(target, retired)
    os.replace(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def existing_directory(target: str | Path) -> Path | None:
    """``target``, or the copy moved aside by an interrupted ``atomic_directory`` swap, or None."""
    target = Path(target)
    if target.is_dir():
        return target
    return _retired(target) if _retired(target).is_dir() else None


@contextmanager
def folder_lock(folder: str | Path, what: str = "run") -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if missing) meanwhile; FolderBusyError at once
    if another process holds it. The lock is on the folder's own descriptor (no file is written)
    and dies with the process (kill -9 included)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise FolderBusyError(f"{folder} is in use by another slimkv {what}; wait for it to finish or use another folder") from None
            raise
        yield
    finally:
        os.close(descriptor)


class OutputFolder:
    """Rules for one kind of output folder slimkv publishes: its manifest (``marker``) lists the
    files slimkv wrote there, so a later run may replace those and must keep everything else."""

    def __init__(self, marker: str, what: str) -> None:
        self.marker, self.what = marker, what

    def check(self, target: str | Path) -> None:
        """Before any work: ``target`` is absent, an empty folder, or an earlier output of this kind."""
        target = Path(target)
        check_folder_target(target)
        if target.is_dir() and any(target.iterdir()) and not (target / self.marker).is_file():
            raise ValueError(f"--out {target} is not empty and is not an earlier {self.what} (no {self.marker}); choose an empty or new folder")

    def written_by_slimkv(self, target: Path) -> set[str]:
        """Names of the files an earlier output in ``target`` wrote (from its manifest)."""
        if not (target / self.marker).is_file():
            return set()
        manifest = read_json(target / self.marker, expect=dict)
        return {*manifest.get("files", []), self.marker}

    @contextmanager
    def publish(self, target: str | Path) -> Iterator[Path]:
        """Yield an empty staging folder beside ``target``; on success it becomes ``target``. An
        earlier output of this kind is replaced, but files slimkv did not write there are moved
        into the new folder (or the swap is refused if a new file has the same name)."""
        target = Path(target).expanduser()
        self.check(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            yield staging
            if target.is_dir():
                foreign = [p for p in target.iterdir() if p.name not in self.written_by_slimkv(target)]
                clash = [p.name for p in foreign if (staging / p.name).exists()]
                if clash:
                    raise ValueError(f"--out {target} holds files slimkv did not write with the names of new output files ({', '.join(clash)}); move them away first")
                for path in foreign:
                    os.replace(path, staging / path.name)
                retired = _retired(target)
                shutil.rmtree(retired, ignore_errors=True)
                os.replace(target, retired)
                os.replace(staging, target)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
