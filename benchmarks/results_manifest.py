"""Write the manifest.json of each experiment folder of benchmarks/results/ (``slimkv.common.results``),
or with ``--check`` exit 1 when a folder's files and its manifest's list differ.

    .venv/bin/python benchmarks/results_manifest.py            # after a benchmark wrote into a folder
    .venv/bin/python benchmarks/results_manifest.py --check

A manifest lists every file of its folder: what writes it (the folder's rule), and for a JSON file
the provenance it records (``write_results``: the command line, the commit, the time, the
``vocabulary`` its methods are spelled in; older files lack some, then null), and for every file
the commit that added it to the repository and its date (``git log --follow``). A Markdown or PNG
file names the JSON it was rendered from when there is one of its stem.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from slimkv.common.files import write_json
from slimkv.common.results import EXPERIMENTS, MANIFEST, experiment_folder, writer_of

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def added_in(path: Path) -> dict[str, str] | None:
    """The commit that first added ``path`` (following renames) and its date; None outside git or for a new file."""
    try:
        log = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%h %cI", "--", str(path.relative_to(ROOT))],
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


def manifest(folder: Path, *, history: bool = True) -> dict[str, Any]:
    """The manifest of one experiment folder."""
    files = []
    for name in listed(folder):
        path, entry = folder / name, {"file": name, "written_by": writer_of(name)}
        if path.suffix == ".json":
            entry.update(provenance(path))
        else:
            stem = name.rsplit(".", 1)[0]
            source = next((f"{s}.json" for s in (stem, stem.removesuffix("_state")) if (folder / f"{s}.json").is_file()), None)
            entry["rendered_from"] = source
        if history:
            entry["added_in"] = added_in(path)
        files.append(entry)
    writers = sorted({writer for f, _, writer in EXPERIMENTS if f == folder.name})
    return {"experiment": folder.name, "writers": writers, "layout": "slimkv/common/results.py", "regenerate": "benchmarks/results_manifest.py",
            "files": files}


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
        recorded = [f["file"] for f in json.loads(path.read_text(encoding="utf-8"))["files"]]
        if recorded != listed(folder):
            found.append(f"{path.relative_to(ROOT)} lists {sorted(set(recorded) ^ set(listed(folder)))} differently from the folder")
        found += [f"{folder.name}/{name} belongs in {experiment_folder(name)}/" for name in listed(folder) if experiment_folder(name) != folder.name]
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
