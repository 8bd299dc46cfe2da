"""Healing a converted model by distillation: the converted model (the student) is trained to
match the original model's (the teacher's) next-token distribution, KL(teacher || student) per
token, on text windows; by default only the parameters the conversion changed are trained.

It reuses the training loop (``slimkv.train.trainer``): AdamW with warmup and cosine decay,
progress bar, NaN stop, atomic checkpoints and exact resume, in the run folder ``OUT/healing``
(``heal_config.json``, ``checkpoint/``, ``model/``, ``metrics.jsonl``, ``summary.json``). The
last 5% of the healing text's tokens are held out: the loop reports KL and the student's CE there.

A healing run belongs to one conversion and one text: ``heal_config.json`` and every checkpoint
record the conversion's fingerprint (the sha256 of its one-shot weights and config, ``conversion_sha256`` in
the manifest), ``heal_config.json`` the healing text's (``text_sha256``), and ``--resume`` refuses
a run of another conversion, or a text changed since, before anything is loaded.

Retrieval is taught back with ``copy_fraction`` (``--heal-copy-fraction``): that share of the
windows carries a span shown once and repeated at the window's end (``CopyMixBatches``), in the
head-role formats of ``slimkv.convert.roles`` (random word lists, JSON records, a paragraph of the
training prose) and never an evaluation's template, so the student learns to copy from far back as
the teacher does, on windows as long as ``--heal-seq-len``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from slimkv.common.checks import check_choice, check_float, check_int
from slimkv.common.files import folder_lock, read_json, write_json
from slimkv.convert.roles import FORMATS, copy_words, source_text
from slimkv.data.texts import DOC_SEPARATOR, MIXED_CALIBRATION, calibration_sources, text_sha256, tokenize
from slimkv.train.batches import BatchSampler
from slimkv.train.checkpoint import METRICS_FILE, SUMMARY_FILE, existing_directory
from slimkv.train.config import check_optimizer_settings
from slimkv.train.trainer import Trainer, make_optimizer, run_loop

HEAL_CONFIG = "heal_config.json"
HEAL_DIR = "healing"
CONVERSION_KEY = "conversion_sha256"  # the fingerprint of the conversion a healing run belongs to
TEXT_KEY = "text_sha256"  # the fingerprint of the healing text a run started on (heal_config.json)
PARAMETER_SETS = ("changed", "attention", "all")
CHECKPOINTING_SETTINGS = ("auto", "on", "off")
CHECKPOINTING_FROM = 8192  # "auto" recomputes activations from steps of this many tokens (seq_len x batch_size), where what a
# step keeps for its backward pass outgrows the rest of a run's memory (benchmarks/heal_memory.py: results/heal/heal_memory_smollm2.md)
HELD_OUT_FRACTION = 0.05


@dataclass
class HealConfig:
    """One healing run. ``tokens`` is the total number of training tokens (steps = tokens /
    (batch_size x seq_len), rounded up); the rest has the meaning of the same TrainConfig field."""

    tokens: int
    text: str = MIXED_CALIBRATION  # the calibration mix, as compress and convert use (slimkv.data.texts)
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
    copy_fraction: float = 0.0  # the share of windows carrying a repeated span (CopyMixBatches)
    activation_checkpointing: str = "auto"  # "on", "off" or "auto" (on from CHECKPOINTING_FROM tokens a step): memory, not results

    def validate(self) -> None:
        """ValueError naming the command-line option (``--heal-*``, ``--seed``) of a bad field."""
        check_int("--heal-tokens", self.tokens, 1)
        check_choice("--heal-params", self.params, PARAMETER_SETS)
        for name in ("seq_len", "batch_size", "log_every", "eval_windows", "grad_accum"):
            check_int(f"--heal-{name.replace('_', '-')}" if name in ("seq_len", "batch_size") else f"heal {name}", getattr(self, name), 1)
        for name in ("seed", "eval_every", "checkpoint_every"):
            check_int("--seed" if name == "seed" else f"heal {name}", getattr(self, name), 0)
        check_float("heal warmup_fraction", self.warmup_fraction, 0.0, 1.0)
        check_float("--heal-copy-fraction", self.copy_fraction, 0.0, 1.0)
        check_choice("--heal-activation-checkpointing", self.activation_checkpointing, CHECKPOINTING_SETTINGS)
        check_optimizer_settings(self, prefix="--heal-")

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.batch_size * self.seq_len)))

    @property
    def recomputes_activations(self) -> bool:
        """Whether the student's blocks keep only their inputs and recompute the rest in the backward pass."""
        return self.activation_checkpointing == "on" or (self.activation_checkpointing == "auto" and self.seq_len * self.batch_size >= CHECKPOINTING_FROM)

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_fraction * self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | Path = HEAL_CONFIG) -> HealConfig:
        """The config ``to_dict`` wrote (other keys, as the conversion's fingerprint, are ignored);
        ValueError naming ``source`` when it does not hold one."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        try:
            cfg = cls(**{**values, "betas": tuple(values.get("betas", cls.betas))})
            cfg.validate()
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source} does not hold a valid healing configuration ({err}); the file was edited or damaged") from None
        return cfg


def heal_documents(text: str) -> list[str]:
    """The documents of a healing text, a mix's sources interleaved document by document, so the
    held-out tail holds every source, not only the last one."""
    sources = [documents for _name, documents in calibration_sources(text, option="--heal-text")]
    return [doc for group in itertools.zip_longest(*sources) for doc in group if doc is not None]


def split_heal_ids(tokenizer: Any, documents: list[str], cfg: HealConfig) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids) of the healing text: the last 5% (at least one window) held out;
    ValueError naming --heal-text and --heal-seq-len when the text is too short for both."""
    ids = np.asarray(tokenize(tokenizer, DOC_SEPARATOR.join(documents)), dtype=np.int64)
    held = max(cfg.seq_len + 2, int(len(ids) * HELD_OUT_FRACTION))
    if len(ids) - held < cfg.seq_len + 2:
        raise ValueError(f"--heal-text {cfg.text!r} has {len(ids)} tokens, too few for --heal-seq-len {cfg.seq_len} with a held-out part "
                         f"(it needs at least {2 * (cfg.seq_len + 2)})")
    return ids[:-held], ids[-held:]


def check_heal_text(tokenizer: Any, cfg: HealConfig) -> None:
    """Before any work: the healing text holds enough tokens for ``cfg`` (``split_heal_ids``).
    Documents are counted one by one until there are clearly enough, so a long text is not
    tokenized whole; a short one is split exactly as healing will split it."""
    documents = heal_documents(cfg.text)
    count = 0
    for document in documents:
        count += len(tokenize(tokenizer, document))
        if count >= 4 * (cfg.seq_len + 2):
            return
    split_heal_ids(tokenizer, documents, cfg)


def stored_heal_config(run_dir: Path) -> tuple[HealConfig, str | None]:
    """(the config, the conversion fingerprint) a healing run folder recorded."""
    data = read_json(Path(run_dir) / HEAL_CONFIG, expect=dict)
    return HealConfig.from_dict(data, Path(run_dir) / HEAL_CONFIG), data.get(CONVERSION_KEY)


def check_resumable(run_dir: Path, cfg: HealConfig | None, conversion: str) -> HealConfig:
    """Before anything is loaded (and again under the run's lock): ``run_dir`` holds a healing
    checkpoint of the conversion ``conversion`` made with ``cfg`` (None: whatever it was made
    with); returns the run's config. ValueError saying what is wrong and what to do; nothing is
    created or changed."""
    run_dir = Path(run_dir)
    out = run_dir.parent
    restart = f"heal this conversion from the start with `slimkv convert --model ... --heal-tokens N --out {out}` (without --resume)"
    checkpoint = existing_directory(run_dir / "checkpoint")
    if not (run_dir / HEAL_CONFIG).is_file() or checkpoint is None:
        raise ValueError(f"nothing to resume: {run_dir} holds no healing checkpoint; {restart}")
    stored, recorded = stored_heal_config(run_dir)
    saved = read_json(checkpoint / "state.json", expect=dict).get(CONVERSION_KEY) if (checkpoint / "state.json").is_file() else None
    if recorded is None or saved is None:
        raise ValueError(f"--resume: {run_dir} does not record which conversion it heals (it was written by an older slimkv), so it cannot be "
                         f"resumed safely; {restart}")
    if recorded != conversion or saved != conversion:
        raise ValueError(f"--resume: the healing run in {run_dir} belongs to another conversion than the one published in {out} "
                         f"(it started from one-shot weights with sha256 {saved[:12]}..., {out} holds a conversion with {conversion[:12]}...): "
                         f"it was left by an earlier conversion into this folder and cannot continue this one; {restart}")
    if cfg is not None and stored != cfg:
        requested, kept = cfg.to_dict(), stored.to_dict()
        differences = ", ".join(f"{k}: stored {kept.get(k)!r}, requested {v!r}" for k, v in requested.items() if kept.get(k) != v)
        raise ValueError(f"--resume: {run_dir} was healed with other options ({differences}); resume with the same options, or with none")
    started_on = read_json(run_dir / HEAL_CONFIG, expect=dict).get(TEXT_KEY)
    now = heal_text_sha256(heal_documents(stored.text)) if started_on is not None else None
    if started_on is not None and started_on != now:
        raise ValueError(f"--resume: the healing text {stored.text!r} changed since the run in {run_dir} started (its sha256 was {started_on[:12]}..., "
                         f"it is now {now[:12]}...): continuing would train on another text than the run records; restore the text, or {restart}")
    return stored


def heal_text_sha256(documents: list[str]) -> str:
    """The fingerprint of a healing text as healing reads it (its documents, joined)."""
    return text_sha256(DOC_SEPARATOR.join(documents))


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


class CopyMixBatches(TextBatches):
    """``TextBatches`` with each window, with probability ``fraction``, rebuilt as ``[prose | SOURCE |
    prose | SOURCE]`` (the same length): the source (at most an eighth of the window, at a depth of
    5-25%) is a list of random words, JSON records or a span of the training ids, and the window ends
    with its repeat. The choice is a stateless function of (seed, step), so a resumed run sees the
    same windows and only the sampler's state is checkpointed. Shapes: (n, seq_len + 1)."""

    def __init__(self, ids: np.ndarray, seq_len: int, seed: int, fraction: float, tokenizer: Any, documents: list[str]) -> None:
        super().__init__(ids, seq_len, seed)
        self.ids, self.seq_len, self.seed, self.fraction, self.tokenizer = ids, seq_len, seed, fraction, tokenizer
        self.words = copy_words(documents, random.Random(seed))

    def source(self, fmt: str, rng: random.Random) -> list[int]:
        """The token ids of one span to repeat, in format ``fmt``."""
        length = (self.seq_len + 1) // 8
        if fmt == "paragraph":  # from the training ids only: the held-out tokens never enter training
            start = rng.randrange(0, len(self.ids) - length)
            return [int(t) for t in self.ids[start:start + length]]
        return tokenize(self.tokenizer, "\n" + source_text(fmt, self.words, [], rng) + "\n")[:length]

    def sample(self, step: int, n: int) -> torch.Tensor:
        batch = super().sample(step, n)
        rng = random.Random(self.seed * 1_000_003 + step)
        width = batch.shape[1]
        for row in range(n):
            if rng.random() >= self.fraction:
                continue
            source = torch.tensor(self.source(rng.choice(FORMATS), rng), dtype=batch.dtype)
            depth = int(width * rng.uniform(0.05, 0.25))
            gap = width - depth - 2 * len(source)
            batch[row] = torch.cat([batch[row, :depth], source, batch[row, depth:depth + gap], source])
        return batch


LOSS_CHUNK = 512  # tokens whose next-token distributions the distillation loss holds at once


def final_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's last hidden states (after its final norm: what its LM head reads), (batch,
    time, d_model), without the logits of every position (transformers' ``logits_to_keep``)."""
    return model(ids, use_cache=False, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]


def log_probs(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities from last hidden states (batch, chunk, d_model), flattened to
    (batch * chunk, vocabulary), in float32."""
    return head(hidden).float().log_softmax(-1).flatten(0, 1)


def distillation_loss(teacher: torch.nn.Module):
    """The objective: mean over predicted tokens of KL(teacher || student) of the next-token
    distributions. Both models' logits are made ``LOSS_CHUNK`` tokens at a time from their last
    hidden states, and remade in the backward pass (``torch.utils.checkpoint``; the teacher's too:
    kept, they would add up to what chunking saves), so a window never holds (time x vocabulary)
    logits: 0.8 GB each for SmolLM2 at 4K tokens."""
    teacher_head = teacher.get_output_embeddings()

    def chunk_kl(student_head: torch.nn.Module, hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = log_probs(teacher_head, teacher_hidden)
        return F.kl_div(log_probs(student_head, hidden), target, log_target=True, reduction="sum")

    def loss(student: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        inputs = ids[:, :-1]
        with torch.no_grad():
            teacher_hidden = final_hidden(teacher, inputs)
        hidden = final_hidden(student, inputs)
        head = getattr(student, "module", student).get_output_embeddings()  # under DDP, the wrapped model's
        total = sum(checkpoint(chunk_kl, head, hidden[:, start:start + LOSS_CHUNK], teacher_hidden[:, start:start + LOSS_CHUNK], use_reentrant=False)
                    for start in range(0, inputs.shape[1], LOSS_CHUNK))
        return total / inputs.numel()  # batchmean over the (batch x time) predicted tokens

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
    """KL(teacher || student) and the student's and teacher's CE on held-out windows, per token
    (the logits ``LOSS_CHUNK`` tokens at a time, as the training loss makes them)."""
    kl = ce = teacher_ce = 0.0
    tokens = 0
    student_head, teacher_head = student.get_output_embeddings(), teacher.get_output_embeddings()
    for ids in windows.split(2):
        hidden, teacher_hidden = final_hidden(student, ids[:, :-1]), final_hidden(teacher, ids[:, :-1])
        for start in range(0, hidden.shape[1], LOSS_CHUNK):
            target = log_probs(teacher_head, teacher_hidden[:, start:start + LOSS_CHUNK])
            logits = log_probs(student_head, hidden[:, start:start + LOSS_CHUNK])
            labels = ids[:, 1 + start:1 + start + LOSS_CHUNK].flatten()
            kl += float(F.kl_div(logits, target, log_target=True, reduction="sum"))
            ce += float(F.nll_loss(logits, labels, reduction="sum"))
            teacher_ce += float(F.nll_loss(target, labels, reduction="sum"))
        tokens += ids[:, 1:].numel()
    return {"kl": kl / tokens, "ce": ce / tokens, "teacher_ce": teacher_ce / tokens}


def heal(student: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, cfg: HealConfig, out_dir: str | Path, changed: list[str], *,
         conversion: str, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """Distil ``teacher`` into ``student`` per ``cfg`` in the run folder ``out_dir/healing``; the
    summary (plus what was trained and on which text). The student's weights end healed.
    ``conversion`` is the fingerprint of the conversion being healed (recorded with the run)."""
    cfg.validate()
    run_dir = Path(out_dir) / HEAL_DIR
    if resume:
        check_resumable(run_dir, cfg, conversion)  # before the lock creates the folder
    documents = heal_documents(cfg.text)
    train_ids, eval_ids = split_heal_ids(tokenizer, documents, cfg)
    eval_windows = torch.from_numpy(eval_ids[: (len(eval_ids) - 1) // (cfg.seq_len + 1) * (cfg.seq_len + 1)].reshape(-1, cfg.seq_len + 1))[: cfg.eval_windows]
    with folder_lock(run_dir, "healing run"):
        if resume:
            check_resumable(run_dir, cfg, conversion)
        else:
            if existing_directory(run_dir / "checkpoint") is not None:
                raise ValueError(f"{run_dir} holds a healing checkpoint: continue it with `slimkv convert --out {Path(out_dir)} --resume`, "
                                 "or convert again to start over")
            for name in (METRICS_FILE, SUMMARY_FILE):  # left by a run of this conversion that stopped before its first checkpoint
                (run_dir / name).unlink(missing_ok=True)
            write_json(run_dir / HEAL_CONFIG, {**cfg.to_dict(), CONVERSION_KEY: conversion, TEXT_KEY: heal_text_sha256(documents)})
        trainable = select_parameters(student, cfg.params, changed)
        if cfg.recomputes_activations:
            student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        teacher.eval().requires_grad_(False)
        torch.manual_seed(cfg.seed)
        batches = (CopyMixBatches(train_ids, cfg.seq_len, cfg.seed, cfg.copy_fraction, tokenizer, documents) if cfg.copy_fraction > 0
                   else TextBatches(train_ids, cfg.seq_len, cfg.seed))
        trainer = Trainer(cfg, run_dir, student, make_optimizer(student, cfg), batches,
                          lambda: held_out_metrics(student, teacher, eval_windows), student.save_pretrained,
                          {"heal_config": cfg.to_dict(), CONVERSION_KEY: conversion}, objective=distillation_loss(teacher), label="heal")
        if resume:
            trainer.restore()
        load_before = os.getloadavg()[0]  # the machine load beside this run's training time (at the resume, for a resumed run)
        summary = run_loop(trainer, progress=progress, stop_after=stop_after)
        load = {"before": load_before, "after": os.getloadavg()[0]}
    student.requires_grad_(True)
    if cfg.recomputes_activations:
        student.activation_checkpointing_disable()
    return {**summary, "load_average_1min": load, "trainable_parameters": trainable, "text": cfg.text, "text_sha256": heal_text_sha256(documents),
            "train_tokens": int(len(train_ids)), "held_out_tokens": int(len(eval_ids)), "activation_checkpointing": cfg.recomputes_activations,
            "config": cfg.to_dict()}
