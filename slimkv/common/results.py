"""Where the repository keeps its results: one folder of ``benchmarks/results/`` per experiment, named by
what the files' names begin with, each with a ``manifest.json`` (``benchmarks/results_manifest.py``
writes it: which script or command made each file, with what command line, when, at which commit).

``experiment_folder(name)`` is the folder of a results file (``convert_kvm_smollm2.json`` ->
``convert``), None for the one file that stays at the top (``claims.md``). Writers pass
``results_dir(ROOT, name)`` to ``write_results``; readers open ``results_path(ROOT, name)``.

``ruler/`` also holds runs, a folder each (``ruler/smollm2/2048/``: ``slimkv eval ruler``'s runner
writes its ``ruler.json``, pages and ``cells/`` there); ``RUNS`` names, per experiment folder that
has them, the file that marks a run's folder and what writes it.
"""

from __future__ import annotations

from pathlib import Path

# (folder, the prefix of the names it holds, what writes them); the first matching prefix wins
EXPERIMENTS: tuple[tuple[str, str, str], ...] = (
    ("compare", "compare_", "slimkv compare (its report copied here)"),
    ("compress", "compress_", "benchmarks/compress_sweep.py, benchmarks/compress_robustness.py, benchmarks/compress_time.py"),
    ("convert", "convert_kvm_", "benchmarks/convert_kvm.py"),
    ("convert", "convert_hybrid_heads_", "benchmarks/hybrid_heads.py"),
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
    ("decode", "decode_all_", "benchmarks/decode_all.py"),
    ("decode", "decode_torch_path_", "benchmarks/decode_all.py --name decode_torch_path (SLIMKV_NATIVE=0)"),
    ("decode", "decode_roofline_layer", "benchmarks/decode_native.py --layers"),
    ("decode", "decode_roofline_", "benchmarks/decode_all.py --name decode_roofline"),
    ("decode", "decode_native_", "benchmarks/decode_native.py"),
    ("decode", "decode_quantized_", "benchmarks/decode_quantized.py"),
    ("decode", "decode_smollm2_", "benchmarks/decode_smollm2.py"),
    ("decode", "decode_threads_", "benchmarks/decode_threads.py"),
    ("decode", "decode_prefetch_", "benchmarks/decode_prefetch.py"),
    ("decode", "decode_linear_", "benchmarks/decode_linear.py"),
    *(("decode", f"decode_{variant}_smollm2_", f"benchmarks/decode_smollm2.py --name decode_{variant}_smollm2_<threads>thread")
      for variant in ("budget", "kvm", "latent", "mla_kvm")),
    ("decode", "decode_", "benchmarks/decode_all.py, decode_native.py, decode_quantized.py or decode_smollm2.py under --name"),
    ("budget", "budget_smollm2", "benchmarks/budget_smollm2.py"),
    ("ruler", "budget_comparison", "benchmarks/budget_smollm2.py report"),
)
# experiment folder -> (the file that marks a run's folder under it, what writes the runs)
RUNS: dict[str, tuple[str, str]] = {
    "ruler": ("ruler.json", "slimkv eval ruler's runner (slimkv.eval.ruler: benchmarks/ruler_smollm2.py, slimkv eval ruler --out)"),
}
MANIFEST = "manifest.json"
README = "README.md"  # a folder's own page, written by hand: listed in its manifest, no results file


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
