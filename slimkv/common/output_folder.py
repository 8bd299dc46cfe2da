"""Publishing a whole output folder (a compressed or converted model) without losing what is there.

``OutputFolder``: the destination is checked before any work (what is there, and that it can be
written), the new folder is written beside it and swapped in, and nothing slimkv did not write is
ever deleted: the temporary folders of a swap are created fresh by this process
(``slimkv.common.files.fresh_sibling``), never taken over from a name that happens to exist. Its
lock (``OutputFolder.lock``) is on a hidden ``.NAME.lock`` file beside the folder, since the folder
itself is replaced, held from before the first publish until the last write of a run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from slimkv.common.files import (
    check_folder_target,
    check_writable,
    content_sha256,
    folder_lock,
    fresh_sibling,
    lock_now,
    read_json,
    resolve_link,
    write_errors,
)


class OutputFolder:
    """Rules for one kind of output folder slimkv publishes: its manifest (``marker``) lists the
    files slimkv wrote there, so a later run may replace those and must keep everything else.
    ``runs`` names the folders a slimkv run creates inside a published folder afterwards (the
    healing run of a conversion), each with the file that marks it as slimkv's: a new output
    replaces them with the rest of the earlier output unless ``publish`` is told to keep them."""

    def __init__(self, marker: str, what: str, runs: dict[str, str] | None = None) -> None:
        self.marker, self.what = marker, what
        self.runs = dict(runs or {})
        self._held: dict[Path, int] = {}  # output folders this process holds the lock of, and how many times

    @contextmanager
    def lock(self, target: str | Path) -> Iterator[None]:
        """Hold the output lock of ``target`` meanwhile: ``FolderBusyError`` naming --out at once if
        another process holds it. The lock is on ``.NAME.lock`` beside the folder (created once and
        kept: the folder itself is swapped by every publish), so a run that publishes, reads its
        output back and publishes again (convert, then heal) owns the folder the whole time.
        Re-entrant within a process."""
        target = resolve_link(target).absolute()
        if target in self._held:
            self._held[target] += 1
            try:
                yield
            finally:
                self._held[target] -= 1
            return
        with write_errors(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            lock_now(descriptor, f"--out {target} is being written by another slimkv run; wait for it to finish or use another folder")
            self._held[target] = 1
            try:
                yield
            finally:
                del self._held[target]
        finally:
            os.close(descriptor)

    def check(self, target: str | Path, names: tuple[str, ...] | list[str] = ()) -> None:
        """Before any work: ``target`` is absent, an empty folder, or an earlier output of this
        kind, can be written, is not being written by another run, and holds nothing slimkv did
        not write under the ``names`` the new output will have."""
        check_folder_target(target)
        target = resolve_link(target)
        if target.is_dir() and any(target.iterdir()) and not (target / self.marker).is_file():
            raise ValueError(f"--out {target} is not empty and is not an earlier {self.what} (no {self.marker}); choose an empty or new folder")
        check_writable(target)
        if target.is_dir():
            self._refuse_clashes(target, [p.name for p in self.foreign(target) if p.name in names])
        with self.lock(target), self._runs_held(target):  # FolderBusyError now, not after the work, if a run there is still going
            pass

    @contextmanager
    def _runs_held(self, target: Path, keep: tuple[str, ...] = ()) -> Iterator[None]:
        """Hold the lock of every run folder in ``target`` a new output would replace."""
        runs = [target / name for name in sorted(self.written_by_slimkv(target) & set(self.runs)) if name not in keep]
        with ExitStack() as stack:
            for run in runs:
                stack.enter_context(folder_lock(run, "run (a new output would replace it)"))
            yield

    def written_by_slimkv(self, target: Path) -> set[str]:
        """Names of what an earlier output in ``target`` wrote: its manifest's files whose content
        is still what slimkv wrote (``file_record``: a name added to an edited manifest, or a file
        replaced since, is the user's), and the run folders of ``runs`` that hold their marker. A
        manifest written before contents were recorded is taken at its word."""
        if not (target / self.marker).is_file():
            return set()
        manifest = read_json(target / self.marker, expect=dict)
        names = [name for name in manifest.get("files", []) if isinstance(name, str) and name and Path(name).name == name]
        recorded = manifest.get("file_sha256")
        if isinstance(recorded, dict):
            names = [name for name in names if (target / name).exists() and recorded.get(name) == content_sha256(target / name)]
        runs = {name for name, marker in self.runs.items() if (target / name / marker).is_file()}
        return {*names, self.marker, *runs}

    def file_record(self, folder: Path) -> dict[str, Any]:
        """What a manifest records of the output being written in ``folder`` (before the manifest
        itself): the names, and each one's ``content_sha256``, which later runs check before
        replacing a file (``written_by_slimkv``)."""
        names = sorted(p.name for p in folder.iterdir() if p.name != self.marker)
        return {"files": sorted([*names, self.marker]), "file_sha256": {name: content_sha256(folder / name) for name in names}}

    def foreign(self, target: Path, keep: tuple[str, ...] = ()) -> list[Path]:
        """What in ``target`` a new output must carry over: what slimkv did not write, and ``keep``."""
        if not target.is_dir():
            return []
        ours = self.written_by_slimkv(target) - set(keep)
        return [p for p in target.iterdir() if p.name not in ours]

    def _refuse_clashes(self, target: Path, clash: list[str]) -> None:
        if clash:
            raise ValueError(f"--out {target} holds files slimkv did not write with the names of new output files ({', '.join(sorted(clash))}); "
                             "move them away first")

    @contextmanager
    def publish(self, target: str | Path, keep: tuple[str, ...] = ()) -> Iterator[Path]:
        """Yield an empty staging folder beside ``target``; on success it becomes ``target``. An
        earlier output of this kind is replaced, but files slimkv did not write there (and the
        ``keep`` names) are moved into the new folder (or the swap is refused if a new file has
        the same name). Only folders this call created are ever deleted; if the swap fails, the
        earlier folder is left as it was."""
        target = resolve_link(target)
        with self.lock(target), write_errors(target):
            yield from self._publish(target, keep)

    def _publish(self, target: Path, keep: tuple[str, ...]) -> Iterator[Path]:
        self.check(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = fresh_sibling(target, "tmp")
        moved: list[str] = []
        try:
            yield staging
            if not target.is_dir():
                os.replace(staging, target)
                return
            carried = self.foreign(target, keep)
            self._refuse_clashes(target, [p.name for p in carried if (staging / p.name).exists()])
            for path in carried:
                os.replace(path, staging / path.name)
                moved.append(path.name)
            holder = fresh_sibling(target, "old")
            try:
                with self._runs_held(target, keep):
                    os.replace(target, holder / target.name)
            except BaseException:
                holder.rmdir()
                raise
            try:
                os.replace(staging, target)
            except BaseException:
                os.replace(holder / target.name, target)
                holder.rmdir()
                raise
            moved.clear()
            shutil.rmtree(holder, ignore_errors=True)
        finally:
            if staging.exists():
                for name in moved:  # a failed swap gives back what it carried over
                    os.replace(staging / name, target / name)
                shutil.rmtree(staging, ignore_errors=True)
