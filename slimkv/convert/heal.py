"""Healing a converted model by distillation: the converted model (the student) is trained to
match the original model's (the teacher's) next-token distribution, KL(teacher || student) per
token, on text windows; by default only the parameters the conversion changed are trained.

It reuses the training loop (``slimkv.train.trainer``): AdamW with warmup and cosine decay,
progress bar, NaN stop, atomic checkpoints and exact resume, in the run folder ``OUT/healing``
(``heal_config.json``, ``checkpoint/``, ``model/``, ``metrics.jsonl``, ``summary.json``). The
last 5% of the healing text's tokens are held out: the loop reports KL and the student's CE there.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from slimkv.common.checks import check_choice, check_float, check_int
from slimkv.common.files import folder_lock, read_json, write_json
from slimkv.data.texts import DOC_SEPARATOR, calibration_sources, text_sha256, tokenize
from slimkv.train.batches import BatchSampler
from slimkv.train.checkpoint import existing_directory
from slimkv.train.config import check_optimizer_settings
from slimkv.train.trainer import Trainer, make_optimizer, run_loop

HEAL_CONFIG = "heal_config.json"
HEAL_DIR = "healing"
PARAMETER_SETS = ("changed", "attention", "all")
HELD_OUT_FRACTION = 0.05


@dataclass
class HealConfig:
    """One healing run. ``tokens`` is the total number of training tokens (steps = tokens /
    (batch_size x seq_len), rounded up); the rest has the meaning of the same TrainConfig field."""

    tokens: int
    text: str = "shakespeare"
    params: str = "changed"
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 50
    log_every: int = 10
    eval_windows: int = 8
    grad_accum: int = 1

    def validate(self) -> None:
        check_int("heal_tokens", self.tokens, 1)
        check_choice("heal_params", self.params, PARAMETER_SETS)
        for name in ("seq_len", "batch_size", "log_every", "eval_windows", "grad_accum"):
            check_int(name, getattr(self, name), 1)
        for name in ("seed", "eval_every", "checkpoint_every"):
            check_int(name, getattr(self, name), 0)
        check_float("warmup_fraction", self.warmup_fraction, 0.0, 1.0)
        check_optimizer_settings(self, prefix="heal_")

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.batch_size * self.seq_len)))

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_fraction * self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}


class TextBatches:
    """Seeded random windows of a token array (a ``BatchSource`` for the training loop)."""

    def __init__(self, ids: np.ndarray, seq_len: int, seed: int) -> None:
        self.sampler = BatchSampler(ids, seq_len, seed)

    def sample(self, step: int, n: int) -> torch.Tensor:
        return self.sampler.sample(n)

    def state(self) -> dict[str, torch.Tensor]:
        return {"sampler": self.sampler.state()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.sampler.load_state(state["sampler"])


def distillation_loss(teacher: torch.nn.Module):
    """The objective: mean over predicted tokens of KL(teacher || student) of the next-token distributions."""

    def loss(student: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(ids[:, :-1], use_cache=False).logits.float().log_softmax(-1)
        logits = student(ids[:, :-1]).logits.float().log_softmax(-1)
        return F.kl_div(logits.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")

    return loss


def select_parameters(model: torch.nn.Module, which: str, changed: list[str]) -> int:
    """Freeze all but the chosen parameters; the number of trainable elements. ``changed``:
    those the conversion changed; ``attention``: every attention parameter; ``all``: everything."""
    chosen = 0
    for name, param in model.named_parameters():
        train = which == "all" or (which == "attention" and ".attn." in name) or (which == "changed" and name in changed)
        param.requires_grad_(train)
        chosen += param.numel() if train else 0
    if not chosen:
        raise ValueError(f"heal_params={which!r} selects no parameters of this model (the conversion changed none); use --heal-params attention")
    return chosen


@torch.no_grad()
def held_out_metrics(student: torch.nn.Module, teacher: torch.nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """KL(teacher || student) and the student's and teacher's CE on held-out windows, per token."""
    kl = ce = teacher_ce = 0.0
    tokens = 0
    for ids in windows.split(2):
        target = teacher(ids[:, :-1], use_cache=False).logits.float().log_softmax(-1)
        logits = student(ids[:, :-1]).logits.float().log_softmax(-1)
        kl += float(F.kl_div(logits.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="sum"))
        ce += float(F.nll_loss(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        teacher_ce += float(F.nll_loss(target.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        tokens += ids[:, 1:].numel()
    return {"kl": kl / tokens, "ce": ce / tokens, "teacher_ce": teacher_ce / tokens}


def heal(student: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, cfg: HealConfig, out_dir: str | Path, changed: list[str], *,
         resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """Distil ``teacher`` into ``student`` per ``cfg`` in the run folder ``out_dir/healing``; the
    summary (plus what was trained and on which text). The student's weights end healed."""
    cfg.validate()
    run_dir = Path(out_dir) / HEAL_DIR
    # a mix's documents interleaved source by source, so the held-out tail holds every source, not only the last one
    sources = [documents for _name, documents in calibration_sources(cfg.text)]
    documents = [doc for group in itertools.zip_longest(*sources) for doc in group if doc is not None]
    ids = np.asarray(tokenize(tokenizer, DOC_SEPARATOR.join(documents)), dtype=np.int64)
    held = max(cfg.seq_len + 2, int(len(ids) * HELD_OUT_FRACTION))
    if len(ids) - held < cfg.seq_len + 2:
        raise ValueError(f"--heal-text {cfg.text!r} has {len(ids)} tokens, too few for --heal-seq-len {cfg.seq_len} with a held-out part")
    train_ids, eval_ids = ids[:-held], ids[-held:]
    eval_windows = torch.from_numpy(eval_ids[: (len(eval_ids) - 1) // (cfg.seq_len + 1) * (cfg.seq_len + 1)].reshape(-1, cfg.seq_len + 1))[: cfg.eval_windows]
    with folder_lock(run_dir, "healing run"):
        if resume:
            stored = read_json(run_dir / HEAL_CONFIG, expect=dict) if (run_dir / HEAL_CONFIG).is_file() else None
            if stored is None or existing_directory(run_dir / "checkpoint") is None:
                raise ValueError(f"nothing to resume: {run_dir} holds no healing checkpoint; run the conversion again with --heal-tokens")
            if stored != cfg.to_dict():
                differences = ", ".join(f"{k}: stored {stored.get(k)!r}, requested {v!r}" for k, v in cfg.to_dict().items() if stored.get(k) != v)
                raise ValueError(f"--resume: {run_dir} was healed with other options ({differences})")
        else:
            write_json(run_dir / HEAL_CONFIG, cfg.to_dict())
        trainable = select_parameters(student, cfg.params, changed)
        teacher.eval().requires_grad_(False)
        torch.manual_seed(cfg.seed)
        trainer = Trainer(cfg, run_dir, student, make_optimizer(student, cfg), TextBatches(train_ids, cfg.seq_len, cfg.seed),
                          lambda: held_out_metrics(student, teacher, eval_windows), student.save_pretrained,
                          {"heal_config": cfg.to_dict()}, objective=distillation_loss(teacher), label="heal")
        if resume:
            trainer.restore()
        summary = run_loop(trainer, progress=progress, stop_after=stop_after)
    student.requires_grad_(True)
    return {**summary, "trainable_parameters": trainable, "text": cfg.text, "text_sha256": text_sha256(DOC_SEPARATOR.join(documents)),
            "train_tokens": int(len(train_ids)), "held_out_tokens": int(len(eval_ids)), "config": cfg.to_dict()}
