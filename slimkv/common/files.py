"""Files and folders that readers never see half-written, and locks that keep runs apart.

* ``write_text`` / ``write_json`` fill a temporary sibling (named after the process, so
  concurrent writers do not collide) and move it into place with ``os.replace``.
* ``read_json`` names the file in every error (a corrupt file says which file is corrupt).
* ``atomic_directory`` stages a whole folder and swaps it in; ``existing_directory`` finds the
  complete copy even if a swap was interrupted.
* ``slimkv.common.output_folder.OutputFolder`` publishes a whole output folder (a compressed or converted model): the
  destination is checked before any work (what is there, and that it can be written), the new
  folder is written beside it and swapped in, and nothing slimkv did not write is ever deleted:
  the temporary folders of a swap are created fresh by this process (``fresh_sibling``), never
  taken over from a name that happens to exist.
* ``folder_lock`` holds an exclusive advisory lock on a folder (the folder itself, no lock file)
  for the life of a run, so a second process writing into the same folder gets a clear error
  instead of interleaved files. ``OutputFolder.lock`` holds one on a published folder across its
  swaps (on a hidden ``.NAME.lock`` file beside it, since the folder itself is replaced), from
  before the first publish until the last write of a run.
* A write that fails for lack of space, a read-only filesystem or a path that is not a folder
  (``WriteFailed``) names the file, removes its temporary file and replaces nothing.
* An output path that is a symbolic link writes into the folder it points to (the link is kept).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class FolderBusyError(RuntimeError):
    """Another process holds the lock on a folder."""


class WriteFailed(RuntimeError):
    """Writing an output failed for a reason the user can fix (no space, a read-only filesystem, a
    path component that is not a folder); the message names the file and nothing was replaced."""


# errno -> what to tell the user
LIBRARY_ERRNO = re.compile(r"(?:os error |Os \{ code: )(\d+)")  # how Rust's io::Error prints an errno inside safetensors' errors
WRITE_FAILURES = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "the filesystem is read-only", errno.ENOTDIR: "a part of the path is a file, not a folder"}


def _write_failure(err: BaseException) -> str | None:
    """What ``WRITE_FAILURES`` says of ``err``: an OSError's errno, or the errno a library reports in
    its own exception's text (safetensors: 'IoError(Os { code: 28, ... })' or '(os error 28)');
    no other text is guessed at."""
    if isinstance(err, OSError):
        return WRITE_FAILURES.get(err.errno)
    match = LIBRARY_ERRNO.search(str(err))
    return WRITE_FAILURES.get(int(match.group(1))) if match else None


@contextmanager
def write_errors(path: str | Path) -> Iterator[None]:
    """Turn a failed write under ``path`` (``_write_failure``) into one ``WriteFailed`` naming it."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as err:
        reason = _write_failure(err)
        if reason is None:
            raise
        raise WriteFailed(f"could not write {path}: {reason}; nothing there was replaced (free space or choose another place, "
                          "then run again)") from err


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")


def resolve_link(path: str | Path, option: str = "--out") -> Path:
    """``path`` with ``~`` expanded, or the folder it points to when it is a symbolic link (so a
    publish writes into the user's target and keeps the link); ValueError naming ``option`` when
    the link points nowhere."""
    path = Path(path).expanduser()
    if not path.is_symlink():
        return path
    real = path.resolve()
    if not real.exists():
        raise ValueError(f"{option} {path} is a symbolic link to {os.readlink(path)}, which does not exist; create that folder or give a real path")
    return real


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating the parent folder; ``WriteFailed``
    naming the file (and no temporary file left) when the disk is full or read-only."""
    path = resolve_link(Path(path), "the output file")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file path to write to")
    tmp = _temporary(path)
    with write_errors(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


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


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return sha256_file(path)


def content_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a folder's tree (each file's relative path and sha256, in
    order); a file's is remembered for as long as its size, mtime and inode stay the same."""
    path = Path(path)
    if path.is_dir():
        digest = hashlib.sha256()
        for item in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{item.relative_to(path).as_posix()}\0{content_sha256(item)}\n".encode())
        return digest.hexdigest()
    info = path.stat()
    return _file_sha256(str(path), info.st_size, info.st_mtime_ns, info.st_ino)


def save_figure(fig: Any, path: str | Path, *, tight: bool = True) -> None:
    """Save a matplotlib figure as PNG atomically (dpi 120; ``tight`` crops to the drawn area)."""
    path = Path(path)
    tmp = _temporary(path)
    with write_errors(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(tmp, dpi=120, format="png", **({"bbox_inches": "tight"} if tight else {}))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def check_folder_target(path: str | Path, option: str = "--out") -> None:
    """A folder slimkv will write into must not be an existing file nor a link to nowhere (checked
    before any work)."""
    path = resolve_link(path, option)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file; give a folder")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option} {path} cannot be created: {parent} is a file, not a folder")
            break


def check_file_target(path: str | Path, option: str) -> None:
    """A file slimkv will write (``write_json``) must not be a folder and its folder must be
    writable: ValueError naming ``option``, checked before any work."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file path to write to")
    check_writable(path, option)


def check_json_target(path: str | Path, option: str) -> None:
    """``check_file_target`` for a JSON report a user names (``--json``): an existing file there must
    be JSON (an earlier report), so a text or a model file given by mistake is never overwritten."""
    check_file_target(path, option)
    path = Path(path).expanduser()
    if path.is_file():
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{option} {path} exists and is not a JSON file (an earlier report); slimkv will not overwrite it: "
                             "choose another path") from None


def _retired(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def fresh_sibling(target: str | Path, tag: str) -> Path:
    """A new empty folder beside ``target`` (``.NAME.TAG-PID-RANDOM``), created by this call: an
    existing folder is never reused, so cleaning it up can delete nothing but what we put there."""
    target = Path(target)
    for _attempt in range(100):
        path = target.with_name(f".{target.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a new temporary folder beside {target}")


def check_writable(target: str | Path, option: str = "--out") -> None:
    """Before any work: slimkv can create ``target`` (or folders beside it, as a publish does) and
    change it if it exists; ValueError naming ``option`` and the folder otherwise (a read-only
    filesystem, /proc, no permission). The probe folder it creates is removed at once."""
    target = Path(target).expanduser().absolute()
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{option} {target} cannot be created: {ancestor} is a file, not a folder")
    try:
        fresh_sibling(ancestor / target.name, "probe").rmdir()
    except OSError as err:
        raise ValueError(f"{option} {target} cannot be written: creating a folder in {ancestor} failed ({err.strerror or err}); "
                         "choose a folder you can write to") from None
    if target.is_dir() and not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {target} cannot be written (no write permission on the folder); choose a folder you can write to")


def report_folder(run_dir: str | Path, out_dir: str | Path | None, names: tuple[str, ...]) -> Path:
    """The folder a run-directory report writes ``names`` into: ``out_dir`` if given (checked as
    --out), else RUN_DIR itself; a folder where one of the files goes fails now, not after the work."""
    if out_dir is not None:
        check_folder_target(out_dir)
        check_writable(out_dir)
    target = Path(out_dir) if out_dir is not None else Path(run_dir)
    for name in names:
        check_file_target(target / name, "--out" if out_dir is not None else "RUN_DIR")
    return target


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target`` (the old one is moved
    aside first and deleted last, so ``existing_directory`` always finds a complete one). Only
    for folders slimkv owns entirely (a checkpoint, a saved model): the old folder is deleted."""
    target = Path(target)
    with write_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = fresh_sibling(target, "tmp")
    try:
        with write_errors(target):
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


def lock_now(descriptor: int, busy: str) -> None:
    """An exclusive flock on ``descriptor`` at once, or FolderBusyError(``busy``) if another process holds it."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            raise FolderBusyError(busy) from None
        raise


@contextmanager
def waiting_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive flock on the file ``path`` (created if missing, left in place) meanwhile,
    waiting for another process that holds it: for work two processes may both start and only
    one should do (a kernel build). ``folder_lock`` refuses at once instead."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def folder_lock(folder: str | Path, what: str = "run") -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if missing) meanwhile; FolderBusyError at once
    if another process holds it. The lock is on the folder's own descriptor (no file is written)
    and dies with the process (kill -9 included)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        lock_now(descriptor, f"{folder} is in use by another slimkv {what}; wait for it to finish or use another folder")
        yield
    finally:
        os.close(descriptor)
