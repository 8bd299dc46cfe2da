"""Write the manifest.json of each experiment folder of benchmarks/results/ (``slimkv.common.results``),
or with ``--check`` exit 1 when a folder's files and its manifest's list differ.

    .venv/bin/python benchmarks/results_manifest.py            # after a benchmark wrote into a folder
    .venv/bin/python benchmarks/results_manifest.py --check

A manifest lists every file of its folder: what writes it (the folder's rule), and for a JSON file
the provenance it records (``write_results``: the command line, the commit, the time, the
``vocabulary`` its methods are spelled in; older files lack some, then null), and for every file
the commit that added it to the repository and its date (``git log --follow``). A Markdown or PNG
file names the JSON it was rendered from when there is one of its stem. A folder's README.md is its
page, written by hand. A folder of runs (``ruler/``: ``RUNS``) also lists each run's folder, found by
the file a run writes (``ruler.json``): what writes it, its files, the provenance that file records,
and the keys of its cells (``<cache>/<task>/<length>``), not the cells' own files.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from slimkv.common.files import write_json
from slimkv.common.results import EXPERIMENTS, MANIFEST, README, RUNS, experiment_folder, writer_of

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


@functools.cache
def staged_renames() -> dict[str, str]:
    """New path -> old path of the renames staged and not yet committed (``git mv``), relative to the repository."""
    try:
        diff = subprocess.run(["git", "diff", "--cached", "-M", "--name-status"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [line.split("\t") for line in diff.stdout.splitlines()] if diff.returncode == 0 else []
    return {p[2]: p[1] for p in parts if len(p) == 3 and p[0].startswith("R")}


def added_in(path: Path, *, follow: bool = True) -> dict[str, str] | None:
    """The commit that first added ``path`` (following renames, a staged ``git mv`` too, unless ``follow`` is false: a
    run's record, written in place, which --follow would take for a copy of a like file) and its date; None outside
    git or for a new file."""
    relative = path.relative_to(ROOT).as_posix()
    try:
        log = subprocess.run(["git", "log", *(["--follow"] if follow else []), "--diff-filter=A", "--format=%h %cI", "--",
                              staged_renames().get(relative, relative)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = log.stdout.split("\n") if log.returncode == 0 else []
    lines = [line for line in lines if line.strip()]
    if not lines:
        return None
    commit, _, date = lines[-1].partition(" ")
    return {"commit": commit, "date": date}


def provenance(path: Path) -> dict[str, Any]:
    """What a JSON results file records of how it was made (null where it records nothing)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    machine = data.get("machine") if isinstance(data, dict) and isinstance(data.get("machine"), dict) else {}
    return {"command": machine.get("command"), "git_commit": machine.get("git_commit"), "time": data.get("time") if isinstance(data, dict) else None,
            "vocabulary": data.get("vocabulary", 1) if isinstance(data, dict) else None,
            "cpu": machine.get("cpu_model"), "instruction_set": machine.get("instruction_set"), "threads": machine.get("threads")}


def listed(folder: Path) -> list[str]:
    """The results files of ``folder`` (its manifest aside)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def runs(folder: Path) -> list[Path]:
    """The run folders under ``folder`` (``RUNS``: each holds the file a run writes), at any depth."""
    marker = RUNS.get(folder.name)
    return sorted(path.parent for path in folder.rglob(marker[0])) if marker else []


def run_files(run: Path) -> list[str]:
    """The files of a run's folder itself (its pages and record; not its subfolders)."""
    return sorted(p.name for p in run.iterdir() if p.is_file() and not p.name.startswith("."))


def run_entry(folder: Path, run: Path, *, history: bool = True) -> dict[str, Any]:
    """One run of a folder of runs: where, what wrote it, its files, its record's provenance and the keys of its cells."""
    marker, writer = RUNS[folder.name]
    path = run / marker
    entry: dict[str, Any] = {"run": run.relative_to(folder).as_posix(), "written_by": writer, "files": run_files(run), **provenance(path)}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    converted = (settings.get("identity") or {}).get("converted") or {}
    entry.update({"model": settings.get("model"), "cache_budget": (converted.get("options") or {}).get("cache_budget"),
                  "limit": settings.get("limit"), "cells": sorted(data.get("cells") or {})})
    if history:
        entry["added_in"] = added_in(path, follow=False)
    return entry


def manifest(folder: Path, *, history: bool = True) -> dict[str, Any]:
    """The manifest of one experiment folder."""
    files = []
    for name in listed(folder):
        path, entry = folder / name, {"file": name, "written_by": "by hand (the folder's page)" if name == README else writer_of(name)}
        if path.suffix == ".json":
            entry.update(provenance(path))
        elif name != README:
            stem = name.rsplit(".", 1)[0]
            source = next((f"{s}.json" for s in (stem, stem.removesuffix("_state")) if (folder / f"{s}.json").is_file()), None)
            entry["rendered_from"] = source
        if history:
            entry["added_in"] = added_in(path)
        files.append(entry)
    writers = sorted({writer for f, _, writer in EXPERIMENTS if f == folder.name} | ({RUNS[folder.name][1]} if folder.name in RUNS else set()))
    result = {"experiment": folder.name, "writers": writers, "layout": "slimkv/common/results.py", "regenerate": "benchmarks/results_manifest.py",
              "files": files}
    if folder.name in RUNS:
        result["runs"] = [run_entry(folder, run, history=history) for run in runs(folder)]
    return result


def folders() -> list[Path]:
    return [RESULTS / name for name in dict.fromkeys(f for f, _, _ in EXPERIMENTS) if (RESULTS / name).is_dir()]


def problems() -> list[str]:
    """Where the folders and their manifests disagree, and files that sit in the wrong folder."""
    found = []
    for folder in folders():
        path = folder / MANIFEST
        if not path.is_file():
            found.append(f"{path.relative_to(ROOT)} is missing")
            continue
        written = json.loads(path.read_text(encoding="utf-8"))
        recorded = [f["file"] for f in written["files"]]
        if recorded != listed(folder):
            found.append(f"{path.relative_to(ROOT)} lists {sorted(set(recorded) ^ set(listed(folder)))} differently from the folder")
        found += [f"{folder.name}/{name} belongs in {experiment_folder(name)}/" for name in listed(folder)
                  if name != README and experiment_folder(name) != folder.name]
        recorded_runs = {r["run"]: r["files"] for r in written.get("runs", [])}
        present = {run.relative_to(folder).as_posix(): run_files(run) for run in runs(folder)}
        if recorded_runs != present:
            differ = sorted(k for k in set(recorded_runs) | set(present) if recorded_runs.get(k) != present.get(k))
            found.append(f"{path.relative_to(ROOT)} lists the runs {differ} differently from the folder")
    found += [f"{p.name} belongs in {experiment_folder(p.name)}/" for p in RESULTS.iterdir() if p.is_file() and experiment_folder(p.name)]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a folder's files and its manifest differ (nothing written)")
    args = p.parse_args(argv)
    if args.check:
        found = problems()
        for line in found:
            print(line, file=sys.stderr)
        if found:
            print("run .venv/bin/python benchmarks/results_manifest.py", file=sys.stderr)
        return 1 if found else 0
    for folder in folders():
        write_json(folder / MANIFEST, manifest(folder))
        print(f"wrote {(folder / MANIFEST).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
