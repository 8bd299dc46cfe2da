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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from slimkv.common.files import (
    atomic_directory,
    check_folder_target,
    existing_directory,
    read_json,
    write_json,
)
from slimkv.common.quiet import quiet_transformers
from slimkv.common.vocabulary import current_attention_fields
from slimkv.data import load_dataset
from slimkv.model import load_model_folder
from slimkv.train.config import TrainConfig

CHECKPOINT_FORMAT = 1
CONFIG_FILE = "train_config.json"
MODEL_DIR = "model"
CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


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


def load_checkpoint(run_dir: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore weights and optimizer from ``RUN_DIR/checkpoint``; (state.json, rng tensors).
    ValueError naming the file when the checkpoint is missing, damaged or does not fit."""
    run_dir = Path(run_dir)
    folder = existing_directory(run_dir / CHECKPOINT_DIR)
    if folder is None:
        raise ValueError(f"nothing to resume: {run_dir} has no {CHECKPOINT_DIR}/ (it holds: {describe_folder(run_dir)}); "
                         "start the run again without --resume")
    state = read_json(folder / "state.json", expect=dict)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder / 'state.json'} has checkpoint format {state.get('format')!r}; this slimkv reads format {CHECKPOINT_FORMAT}")
    for key in ("step", "tokens_seen"):
        if isinstance(state.get(key), bool) or not isinstance(state.get(key), int) or state[key] < 0:
            raise ValueError(f"{folder / 'state.json'}: {key} must be an integer >= 0, got {state.get(key)!r} (the file was edited or damaged)")
    if state.get("config") is not None and state["config"].get("steps") is not None and state["step"] > state["config"]["steps"]:
        raise ValueError(f"{folder / 'state.json'}: step {state['step']} is past the run's {state['config']['steps']} steps (the file was edited or damaged)")
    device = next(model.parameters()).device
    missing, unexpected = read_safetensors(folder / "model.safetensors", lambda path: load_model(model, path, strict=False, device=str(device)))
    if missing or unexpected:
        raise ValueError(f"{folder / 'model.safetensors'}: checkpoint weights do not fit the model (missing {sorted(missing)}, unexpected {sorted(unexpected)})")
    tensors = read_safetensors(folder / "optimizer.safetensors", lambda path: load_file(path, device=str(device)))
    try:
        optimizer.load_state_dict(unflatten_optimizer_state(tensors, read_json(folder / "optimizer.json", expect=dict)))
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"{folder / 'optimizer.json'} does not fit this run's optimizer ({err})") from None
    optimizer_steps = {int(entry["step"]) for entry in optimizer.state.values() if "step" in entry}
    if optimizer_steps and optimizer_steps != {state["step"]}:
        raise ValueError(f"{folder / 'state.json'} says step {state['step']} but the optimizer state was saved at step {sorted(optimizer_steps)}; "
                         "the checkpoint was edited or mixed from two runs")
    rng = read_safetensors(folder / "rng.safetensors", load_file)
    return state, rng


def read_safetensors(path: Path, read: Callable[[str], Any]) -> Any:
    """``read(path)`` of a safetensors file, with the file named when it is missing or damaged."""
    if not Path(path).is_file():
        raise ValueError(f"{path} is missing; the checkpoint is incomplete")
    try:
        return read(str(path))
    except RuntimeError as err:
        if "size mismatch" in str(err):  # a readable file whose tensors have other shapes than the model's
            raise ValueError(f"{path}: the weights do not fit the model they are loaded into ({str(err).strip()[:300]})") from None
        raise ValueError(f"{path} cannot be read as safetensors ({err}); the file is truncated or damaged") from None
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} cannot be read as safetensors ({err}); the file is truncated or damaged") from None


def describe_folder(folder: Path) -> str:
    """A short list of what a folder holds (for error messages)."""
    if not folder.is_dir():
        return "nothing: it does not exist"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return ", ".join(names) if names else "nothing"


# Files a run writes before its first checkpoint: a folder holding only these (a run that died
# before checkpointing) may be started again without --resume.
RESTARTABLE = {CONFIG_FILE, METRICS_FILE, SUMMARY_FILE}


def prepare_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool) -> None:
    """Refuse to mix runs: a new run needs an empty folder (or one left by a run that never
    checkpointed); a resumed one needs a checkpoint and the same config."""
    run_dir = Path(run_dir)
    check_folder_target(run_dir)
    if resume:
        if existing_directory(run_dir / CHECKPOINT_DIR) is None:
            raise ValueError(f"nothing to resume: {run_dir} has no {CHECKPOINT_DIR}/ (it holds: {describe_folder(run_dir)}); "
                             "start the run again without --resume")
        stored = read_run_config(run_dir)
        differences = stored.diff(cfg)
        if differences:
            lines = "\n".join(f"  {k}: stored {a!r}, requested {b!r}" for k, a, b in ((k, *v) for k, v in differences.items()))
            raise ValueError(
                f"--resume: {run_dir} was trained with a different configuration:\n{lines}\n"
                "resume with the same options (or no options at all), or start a new run with another --out"
            )
    elif run_dir.exists() and {p.name for p in run_dir.iterdir()} - RESTARTABLE:
        if existing_directory(run_dir / CHECKPOINT_DIR) is not None:
            raise ValueError(f"{run_dir} is not empty: continue that run with --resume, or choose another --out (it holds: {describe_folder(run_dir)})")
        raise ValueError(f"{run_dir} is not empty and holds no run to resume: choose another --out (it holds: {describe_folder(run_dir)})")


def has_checkpoint(run_dir: Path) -> bool:
    return existing_directory(Path(run_dir) / CHECKPOINT_DIR) is not None


def save_model_dir(run_dir: Path, save: Callable[[Path], None]) -> None:
    """``save(folder)`` (e.g. a model's ``save_pretrained``) into ``RUN_DIR/model/``, atomically."""
    with atomic_directory(Path(run_dir) / MODEL_DIR) as folder, quiet_transformers():
        save(folder)


# ---------------------------------------------------------------- reading a finished run


def read_run_config(run_dir: Path) -> TrainConfig:
    """The TrainConfig stored in ``RUN_DIR/train_config.json`` (layer options renamed since it was
    written read as today's: ``slimkv.common.vocabulary.current_attention_fields``)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a training run (no {CONFIG_FILE}); create one with `slimkv train --attention KIND --out {run_dir}`")
    try:
        return TrainConfig.from_dict(current_attention_fields(read_json(path, expect=dict)))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def load_run(run_dir: str | Path):
    """(model in eval mode, TrainConfig, TokenDataset) of a run directory.

    The model is the latest good weights (``RUN_DIR/model``); the dataset is loaded by name and
    must be the one the run was trained on (same build of the tokenizer and splits).
    """
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    folder = existing_directory(run_dir / MODEL_DIR)
    if folder is None:
        raise FileNotFoundError(f"{run_dir} has no trained weights yet ({MODEL_DIR}/); continue it with `slimkv train --out {run_dir} --resume`")
    with quiet_transformers():
        model = load_model_folder(folder)
    check_model_matches_run(model.config, cfg, run_dir)
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


# The ModelConfig fields a run's train_config.json decides (the vocabulary comes from the dataset).
RUN_MODEL_FIELDS = ("d_model", "n_layers", "n_heads", "head_dim", "attention", "attention_options", "kind_options", "mlp", "d_ff", "tie_word_embeddings")


def check_model_matches_run(config: Any, cfg: TrainConfig, run_dir: Path) -> None:
    """The saved model's config.json must describe the model the run trained (an edited file would
    evaluate something else): ValueError listing every difference."""
    expected = cfg.model_config(config.vocab_size)
    differences = [f"{name}: config.json {getattr(config, name, None)!r}, run {getattr(expected, name)!r}"
                   for name in RUN_MODEL_FIELDS if getattr(config, name, None) != getattr(expected, name)]
    if differences:
        raise ValueError(f"{run_dir / MODEL_DIR / 'config.json'} does not describe the model this run trained ({'; '.join(differences)}); "
                         f"it was edited or belongs to another run")


def dataset_key(dataset: Any) -> str | None:
    """What identifies a dataset build (its manifest's build key), or None if it has none."""
    manifest = getattr(dataset, "manifest", None) or {}
    return manifest.get("build_key")


def _trained_dataset_key(run_dir: Path) -> str | None:
    for path in (run_dir / SUMMARY_FILE, run_dir / CHECKPOINT_DIR / "state.json"):
        if path.is_file():
            return read_json(path, expect=dict).get("dataset_build_key")
    return None
