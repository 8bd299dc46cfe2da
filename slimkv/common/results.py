"""Where the repository keeps its results: one folder of ``benchmarks/results/`` per experiment, named by
what the files' names begin with, each with a ``manifest.json`` (``benchmarks/results_manifest.py``
writes it: which script or command made each file, with what command line, when, at which commit).

``experiment_folder(name)`` is the folder of a results file (``convert_kvm_smollm2.json`` ->
``convert``), None for the files that stay at the top (``claims.md``; the decode and budget files,
whose writers keep their own paths; ``ruler/`` is a folder of its own). Writers pass
``results_dir(ROOT, name)`` to ``write_results``; readers open ``results_path(ROOT, name)``.
"""

from __future__ import annotations

from pathlib import Path

# (folder, the prefix of the names it holds, what writes them); the first matching prefix wins
EXPERIMENTS: tuple[tuple[str, str, str], ...] = (
    ("compare", "compare_", "slimkv compare (its report copied here)"),
    ("compress", "compress_", "benchmarks/compress_sweep.py, benchmarks/compress_robustness.py, benchmarks/compress_time.py"),
    ("convert", "convert_kvm_", "benchmarks/convert_kvm.py"),
    ("convert", "convert_", "benchmarks/convert_oneshot.py"),
    ("heal", "heal_", "benchmarks/convert_oneshot.py --heal-tokens"),
    ("kvm", "kvm_speed", "benchmarks/kvm_speed.py"),
    ("niah", "niah_kvm.", "benchmarks/niah_kvm.py"),
    ("niah", "niah_", "benchmarks/niah_smollm2.py report"),
    ("niah", "ppl_hybrid_", "benchmarks/niah_smollm2.py ppl"),
    ("recall", "recall_frontier", "slimkv eval recall (its report copied here)"),
    ("recall", "needles_", "slimkv eval recall --task needles (its report copied here)"),
    ("recall", "lm_frontier", "slimkv compare --config configs/frontier.yaml (its report copied here)"),
    ("train", "train_", "benchmarks/train_throughput.py"),
    ("demo", "demo_timings", "slimkv demo (demo_runs/demo_timings.json, copied here)"),
)
MANIFEST = "manifest.json"


def experiment_folder(name: str) -> str | None:
    """The experiment folder of the results file (or file stem) ``name``; None: it stays at the top."""
    return next((folder for folder, prefix, _ in EXPERIMENTS if name.startswith(prefix)), None)


def writer_of(name: str) -> str | None:
    """What writes the results file ``name`` (``EXPERIMENTS``), None for a file at the top."""
    return next((writer for _, prefix, writer in EXPERIMENTS if name.startswith(prefix)), None)


def results_dir(root: str | Path, name: str) -> Path:
    """The folder under ``root`` (``benchmarks/results``) that holds the results named ``name``."""
    folder = experiment_folder(name)
    return Path(root) / folder if folder else Path(root)


def results_path(root: str | Path, name: str) -> Path:
    """The path of the results file ``name`` (with its suffix) under ``root``."""
    return results_dir(root, name) / name


def relative_name(name: str) -> str:
    """``name`` as a path relative to ``benchmarks/results`` (``convert/convert_kvm_smollm2.md``)."""
    folder = experiment_folder(name)
    return f"{folder}/{name}" if folder else name
