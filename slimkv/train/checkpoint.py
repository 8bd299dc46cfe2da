"""Run-directory files: atomic writes, full training checkpoints (safetensors + JSON, no pickle), ``load_run``.

Layout of a run directory (other commands rely on it)::

    RUN_DIR/train_config.json   the full TrainConfig
    RUN_DIR/model/              save_pretrained() of the latest good weights (config.json + model.safetensors)
    RUN_DIR/checkpoint/         the latest full training state (see ``save_checkpoint``)
    RUN_DIR/metrics.jsonl       one JSON record per log/eval event
    RUN_DIR/summary.json        the outcome of the latest invocation

Directories are written into a staging folder and swapped into place, so a run killed at any
moment leaves either the previous or the new checkpoint, never a mixture.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from slimkv.files import read_json, write_json
from slimkv.train.config import TrainConfig

CHECKPOINT_FORMAT = 1
CONFIG_FILE = "train_config.json"
MODEL_DIR = "model"
CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


# ---------------------------------------------------------------- atomic folders (files: slimkv.files)


def _retired(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target`` (the old one is moved
    aside first and deleted last, so ``existing_directory`` always finds a complete one)."""
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


def existing_directory(target: Path) -> Path | None:
    """``target``, or the copy moved aside by an interrupted swap, or None."""
    target = Path(target)
    if target.is_dir():
        return target
    return _retired(target) if _retired(target).is_dir() else None


# ---------------------------------------------------------------- optimizer state without pickle


def flatten_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (``state.<param>.<name>``) and JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, entry in state_dict["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{param_id}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    meta = {"param_groups": state_dict["param_groups"], "scalars": scalars}
    return tensors, json.loads(json.dumps(meta))  # tuples -> lists: what JSON will give back


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``flatten_optimizer_state``."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, param_id, name = key.split(".", 2)
        state.setdefault(int(param_id), {})[name] = value
    for param_id, entry in meta["scalars"].items():
        state.setdefault(int(param_id), {}).update(entry)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------- training checkpoints


def save_checkpoint(run_dir: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    """Write the full training state atomically into ``RUN_DIR/checkpoint/``:

    ``model.safetensors`` (weights), ``optimizer.safetensors`` + ``optimizer.json`` (moments and
    hyper-parameters), ``rng.safetensors`` (generator states: torch CPU/CUDA and the batch
    sampler's, i.e. the data position) and ``state.json`` (step, tokens seen, config, ...).
    """
    tensors, meta = flatten_optimizer_state(optimizer.state_dict())
    with atomic_directory(Path(run_dir) / CHECKPOINT_DIR) as folder:
        save_model(model, str(folder / "model.safetensors"))
        save_file(tensors, str(folder / "optimizer.safetensors"))
        write_json(folder / "optimizer.json", meta)
        save_file({k: v.contiguous() for k, v in rng.items()}, str(folder / "rng.safetensors"))
        write_json(folder / "state.json", {"format": CHECKPOINT_FORMAT, **state})


def load_checkpoint(run_dir: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """Restore weights and optimizer from ``RUN_DIR/checkpoint``; (state.json, rng tensors), or None."""
    folder = existing_directory(Path(run_dir) / CHECKPOINT_DIR)
    if folder is None:
        return None
    state = read_json(folder / "state.json")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder} has checkpoint format {state.get('format')!r}; this slimkv reads format {CHECKPOINT_FORMAT}")
    device = next(model.parameters()).device
    missing, unexpected = load_model(model, str(folder / "model.safetensors"), device=str(device))
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint weights do not fit the model (missing {missing}, unexpected {unexpected})")
    tensors = load_file(str(folder / "optimizer.safetensors"), device=str(device))
    optimizer.load_state_dict(unflatten_optimizer_state(tensors, read_json(folder / "optimizer.json")))
    return state, load_file(str(folder / "rng.safetensors"))


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' own progress bars (a "Writing model shards" bar per checkpoint) meanwhile."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def save_model_dir(run_dir: Path, model: Any) -> None:
    """``save_pretrained`` of ``model`` into ``RUN_DIR/model/``, atomically."""
    with atomic_directory(Path(run_dir) / MODEL_DIR) as folder, quiet_transformers():
        model.save_pretrained(folder)


# ---------------------------------------------------------------- reading a finished run


def read_run_config(run_dir: Path) -> TrainConfig:
    """The TrainConfig stored in ``RUN_DIR/train_config.json``."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a training run (no {CONFIG_FILE}); create one with `slimkv train --attention KIND --out {run_dir}`")
    return TrainConfig.from_dict(read_json(path))


def load_run(run_dir: str | Path):
    """(model in eval mode, TrainConfig, TokenDataset) of a run directory.

    The model is the latest good weights (``RUN_DIR/model``); the dataset is loaded by name and
    must be the one the run was trained on (same build of the tokenizer and splits).
    """
    from slimkv.data import load_dataset
    from slimkv.model import SlimKVForCausalLM

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    folder = existing_directory(run_dir / MODEL_DIR)
    if folder is None:
        raise FileNotFoundError(f"{run_dir} has no trained weights yet ({MODEL_DIR}/); continue it with `slimkv train --out {run_dir} --resume`")
    with quiet_transformers():
        model = SlimKVForCausalLM.from_pretrained(folder).eval()
    dataset = load_dataset(cfg.dataset)
    trained_on = _trained_dataset_key(run_dir)
    if trained_on is not None and trained_on != dataset_key(dataset):
        raise ValueError(
            f"dataset {cfg.dataset!r} was rebuilt since {run_dir} was trained (its tokenizer or splits differ); "
            "its numbers would be meaningless: prepare the same data again or retrain"
        )
    if model.config.vocab_size != dataset.vocab_size:
        raise ValueError(f"{run_dir}: the model has {model.config.vocab_size} vocabulary ids, dataset {cfg.dataset!r} has {dataset.vocab_size}")
    return model, cfg, dataset


def dataset_key(dataset: Any) -> str | None:
    """What identifies a dataset build (its manifest's build key), or None if it has none."""
    manifest = getattr(dataset, "manifest", None) or {}
    return manifest.get("build_key")


def _trained_dataset_key(run_dir: Path) -> str | None:
    for path in (run_dir / SUMMARY_FILE, run_dir / CHECKPOINT_DIR / "state.json"):
        if path.is_file():
            return read_json(path).get("dataset_build_key")
    return None
