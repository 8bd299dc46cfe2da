"""The training loop: AdamW + warmup/cosine on batches from a seeded source, resumable exactly.

One optimizer step sees ``batch_size x grad_accum`` windows of ``seq_len + 1`` tokens. The batch
source's generator state is the data position and goes into every checkpoint with the weights, the
optimizer moments and the other RNG states, so ``resume=True`` continues bitwise (on CPU) where the
last checkpoint left off.

Under ``torchrun`` every process draws the same global batch and keeps its own slice of it, and
DDP averages the gradients, so the global batch (and, up to float rounding, the run) is the same
as with one process. Rank 0 writes every file and holds the run folder's lock.

``Trainer`` holds one run's moving parts (model, optimizer, batch source, objective, files) and
``run_loop`` drives it; ``train`` builds a Trainer for a ``TrainConfig`` LM run. Other runs (the
healing of ``slimkv convert``) build a Trainer with their own batches and objective.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from slimkv.common.files import folder_lock, write_json, write_text
from slimkv.data import load_dataset
from slimkv.model import SlimKVForCausalLM
from slimkv.scoring import eval_windows, lm_metrics, score_windows
from slimkv.train.batches import LMBatches
from slimkv.train.checkpoint import (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    dataset_key,
    load_checkpoint,
    prepare_run_dir,
    save_checkpoint,
    save_model_dir,
)
from slimkv.train.config import TrainConfig
from slimkv.train.distributed import Distributed


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; nothing was written after the last good checkpoint."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None, run_dir: Path) -> None:
        kept = f"the last good checkpoint (step {last_checkpoint}) in {run_dir / 'checkpoint'} is intact" if last_checkpoint else "no checkpoint had been written yet"
        super().__init__(f"training diverged at step {step}: loss={loss}, grad_norm={grad_norm}; stopped without saving; {kept}")
        self.step, self.loss, self.grad_norm, self.last_checkpoint = step, loss, grad_norm, last_checkpoint


# ---------------------------------------------------------------- pieces of a step


class BatchSource(Protocol):
    """Where a run's batches come from (``slimkv.train.batches``)."""

    def sample(self, step: int, n: int) -> torch.Tensor: ...
    def state(self) -> dict[str, torch.Tensor]: ...
    def load_state(self, state: dict[str, torch.Tensor]) -> None: ...


def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ids (batch, T + 1): positions 1..T from the ones before."""
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


def learning_rate(step: int, cfg: Any) -> float:
    """LR of optimizer step ``step`` (0-based): linear warmup to ``lr``, then cosine down to
    ``lr * min_lr_ratio``, reached at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.AdamW:
    """AdamW over the parameters of ``model`` that require gradients, with decoupled weight decay
    on matrices (projections, embeddings) and none on 1-D parameters (norm gains, biases).
    ``cfg`` supplies lr, betas and weight_decay (a TrainConfig or alike)."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def resolve_device(cfg: TrainConfig, local_rank: int = 0) -> tuple[torch.device, torch.dtype | None]:
    """(device, autocast dtype or None for plain float32) from the config's ``device``/``dtype``."""
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but CUDA is not available here; allowed values on this machine: auto, cpu")
    device = torch.device(f"cuda:{local_rank}" if name == "cuda" else name)
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, (torch.bfloat16 if dtype == "bfloat16" else None)


def accumulate_gradients(model: torch.nn.Module, micro_batches: torch.Tensor, amp_dtype: torch.dtype | None = None,
                         objective: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = next_token_loss) -> torch.Tensor:
    """Forward and backward over ``micro_batches`` (accum, batch, seq_len + 1); the gradients sum to
    those of the mean loss over all of them. Returns that mean loss (detached). Under DDP, gradients
    are synchronised on the last micro-batch only."""
    accum = micro_batches.shape[0]
    loss_sum = torch.zeros((), device=micro_batches.device)
    for i, ids in enumerate(micro_batches):
        skip_sync = isinstance(model, torch.nn.parallel.DistributedDataParallel) and i < accum - 1
        with model.no_sync() if skip_sync else nullcontext():
            with torch.autocast(ids.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = objective(model, ids)
            (loss / accum).backward()
        loss_sum += loss.detach()
    return loss_sum / accum


def rng_states(batches: BatchSource) -> dict[str, torch.Tensor]:
    """Every generator whose state matters for continuing exactly."""
    states = {**batches.state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states.update({f"torch_cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def restore_rng_states(states: dict[str, torch.Tensor], batches: BatchSource) -> None:
    batches.load_state(states)
    torch.set_rng_state(states["torch_cpu"])
    cuda_keys = sorted((k for k in states if k.startswith("torch_cuda.")), key=lambda k: int(k.split(".")[1]))
    cuda = [states[k] for k in cuda_keys]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------- one run


@dataclass
class Trainer:
    """One run's moving parts. ``cfg`` supplies the optimisation and bookkeeping fields of a
    ``TrainConfig`` (steps, lr schedule, batch_size, grad_accum, seq_len, grad_clip, *_every);
    ``evaluate()`` returns val metrics (reduced over processes), ``save_model(folder)`` writes the
    loadable model, ``state`` goes into every checkpoint's state.json."""

    cfg: Any
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: BatchSource
    evaluate: Callable[[], dict[str, Any]]
    save_model: Callable[[Path], None]
    state: dict[str, Any]
    ddp: Distributed = field(default_factory=Distributed)
    amp_dtype: torch.dtype | None = None
    objective: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = next_token_loss
    label: str = "train"
    step: int = 0
    tokens_seen: int = 0
    last_eval: dict[str, Any] | None = None
    last_checkpoint: int | None = None
    resumed_from: int | None = None

    def __post_init__(self) -> None:
        self.device = next(self.model.parameters()).device
        self.trained = self.model
        if self.ddp.world_size > 1:
            self.trained = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def close(self) -> None:
        """Drop the DistributedDataParallel wrapper before the process group ends. Its reducer must
        not be the group's last owner: a group freed from there is freed holding the GIL, and gloo's
        worker threads, which need the GIL to free the tensors of a finished collective, then never
        stop (a hang after training, seen under load; see ``Distributed.close``)."""
        self.trained = self.model

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.cfg.seq_len

    def restore(self) -> None:
        """Continue from the run folder's checkpoint (ValueError if there is none)."""
        state, rngs = load_checkpoint(self.run_dir, model=self.model, optimizer=self.optimizer)
        restore_rng_states(rngs, self.batches)
        self.step, self.tokens_seen, self.last_eval = state["step"], state["tokens_seen"], state.get("last_eval")
        self.last_checkpoint = self.resumed_from = self.step
        if self.ddp.is_main:
            _truncate_metrics(self.run_dir / METRICS_FILE, self.step)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; TrainingDiverged on a non-finite loss or gradient norm."""
        cfg = self.cfg
        lr = learning_rate(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.batches.sample(self.step, cfg.grad_accum * cfg.batch_size).view(cfg.grad_accum, cfg.batch_size, -1)
        shard = batch[:, self.ddp.rank :: self.ddp.world_size].to(self.device)
        loss = self.ddp.mean(accumulate_gradients(self.trained, shard, self.amp_dtype, self.objective)).item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf).item()  # frozen parameters have no gradient
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(self.step + 1, loss, grad_norm, self.last_checkpoint, self.run_dir)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens_seen}

    def due(self, every: int) -> bool:
        """Whether something done every ``every`` steps (0: only at the end) is due now."""
        return bool(every and self.step % every == 0) or self.step == self.cfg.steps

    def log(self, record: dict[str, Any]) -> None:
        if self.ddp.is_main:
            with open(self.run_dir / METRICS_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def run_evaluation(self) -> dict[str, Any]:
        self.model.eval()
        self.last_eval = {"step": self.step, **self.evaluate()}
        self.model.train()
        self.log({"type": "eval", **self.last_eval})
        return self.last_eval

    def checkpoint(self) -> None:
        if self.ddp.is_main:
            state = {"step": self.step, "tokens_seen": self.tokens_seen, "last_eval": self.last_eval, **self.state, "world_size": self.ddp.world_size}
            save_checkpoint(self.run_dir, model=self.model, optimizer=self.optimizer, rng=rng_states(self.batches), state=state)
            save_model_dir(self.run_dir, self.save_model)
        self.ddp.barrier()
        self.last_checkpoint = self.step


@dataclass
class StepClock:
    """Seconds spent in optimizer steps; the first step of an invocation (kernel selection,
    allocator warm-up) is kept out of the steady rate."""

    seconds: float = 0.0
    first: float | None = None
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1
        self.first = seconds if self.first is None else self.first

    def steady_rate(self, tokens_per_step: int) -> float | None:
        steady = self.seconds - (self.first or 0.0)
        return (self.steps - 1) * tokens_per_step / steady if self.steps > 1 and steady > 0 else None


def run_loop(t: Trainer, *, progress: bool = True, stop_after: int | None = None, on_step: Callable[[int, torch.nn.Module], None] | None = None) -> dict[str, Any]:
    """Drive ``t`` to ``t.cfg.steps``: step, log, evaluate, checkpoint; the summary (rank 0 writes it).
    ``stop_after``: stop after this many steps of this call, writing nothing more (what a killed
    process leaves behind; tests use it). ``on_step(step, model)`` runs after every step."""
    t.model.train()
    clock, start_step = StepClock(), t.step
    bar = tqdm(total=t.cfg.steps, initial=t.step, desc=t.label, unit="step", disable=not (progress and t.ddp.is_main), dynamic_ncols=True)
    try:
        while t.step < t.cfg.steps:
            started = time.perf_counter()
            record = t.train_step()
            clock.add(time.perf_counter() - started)
            if on_step is not None:
                on_step(t.step, t.model)
            tokens_per_s = (t.step - start_step) * t.tokens_per_step / clock.seconds
            bar.update()
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            if t.due(t.cfg.log_every):
                t.log({"type": "train", **record, "tokens_per_s": tokens_per_s, "elapsed_s": time.perf_counter() - clock.started})
            if t.due(t.cfg.eval_every):
                evaluation = t.run_evaluation()
                if progress and t.ddp.is_main:
                    bar.write(f"step {t.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items() if isinstance(v, float)))
            if t.due(t.cfg.checkpoint_every):
                t.checkpoint()
            if stop_after is not None and t.step - start_step >= stop_after and t.step < t.cfg.steps:
                return {"status": "stopped", "step": t.step, "last_checkpoint": t.last_checkpoint}
    except TrainingDiverged as err:
        if t.ddp.is_main:
            write_json(t.run_dir / SUMMARY_FILE, {"status": "diverged", "message": str(err), "step": err.step, "last_checkpoint": t.last_checkpoint})
        raise
    finally:
        bar.close()
    return finish(t, clock, start_step)


def finish(t: Trainer, clock: StepClock, start_step: int) -> dict[str, Any]:
    """The summary of a finished run (written to summary.json by rank 0)."""
    evaluation = t.last_eval or {}
    summary = {
        "status": "finished",
        "step": t.step,
        "steps": t.cfg.steps,
        "tokens_seen": t.tokens_seen,
        **{f"val_{k}": evaluation.get(k) for k in ("ce", "bpb", "tokens")},
        **{f"val_{k}": v for k, v in evaluation.items() if k not in ("step", "ce", "bpb", "tokens")},
        "parameters": sum(p.numel() for p in t.model.parameters()),
        **{k: v for k, v in t.state.items() if k != "config"},
        "device": str(t.device),
        "autocast": str(t.amp_dtype).replace("torch.", "") if t.amp_dtype else "float32",
        "world_size": t.ddp.world_size,
        "threads": torch.get_num_threads(),
        "resumed_from_step": t.resumed_from,
        "train_seconds": clock.seconds,
        "train_tokens_per_s": clock.steady_rate(t.tokens_per_step),
        "train_tokens_per_s_note": "steps after this invocation's first (the first step's warm-up is excluded)",
        "first_step_seconds": clock.first,
        "train_tokens_per_s_with_first_step": (t.step - start_step) * t.tokens_per_step / clock.seconds if clock.seconds else None,
        "wall_seconds": time.perf_counter() - clock.started,
    }
    if t.ddp.is_main:
        write_json(t.run_dir / SUMMARY_FILE, summary)
    return summary


# ---------------------------------------------------------------- a TrainConfig LM run


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    dataset: Any = None,
    stop_after: int | None = None,
    on_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` into run directory ``out_dir`` (layout: ``slimkv.train.checkpoint``); the summary.

    ``dataset``: a loaded dataset to use instead of ``load_dataset(cfg.dataset)``. ``stop_after``
    and ``on_step``: see ``run_loop``. Raises ``TrainingDiverged`` on a non-finite loss or gradient
    norm, FolderBusyError if another process trains into ``out_dir``.
    """
    cfg.validate()
    device, amp_dtype = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    ddp = Distributed.from_env(device.type)
    run_dir = Path(out_dir)
    try:
        if cfg.batch_size % ddp.world_size:
            raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the number of processes ({ddp.world_size})")
        prepare_run_dir(run_dir, cfg, resume)
        with folder_lock(run_dir, "training run") if ddp.is_main else nullcontext():
            trainer = lm_trainer(cfg, run_dir, device, amp_dtype, ddp, dataset, resume)
            if trainer is None:
                return _finished_summary(run_dir)
            try:
                return run_loop(trainer, progress=progress, stop_after=stop_after, on_step=on_step)
            finally:
                trainer.close()
    finally:
        ddp.close()


def lm_trainer(cfg: TrainConfig, run_dir: Path, device: torch.device, amp_dtype: torch.dtype | None, ddp: Distributed, dataset: Any, resume: bool) -> Trainer | None:
    """The Trainer of an LM run (None when a resumed run has already finished)."""
    dataset = load_dataset(cfg.dataset) if dataset is None else dataset
    torch.manual_seed(cfg.seed)
    model = SlimKVForCausalLM(cfg.model_config(dataset.vocab_size)).to(device)
    batches = LMBatches(dataset, cfg.seq_len, cfg.seed, cfg.needle_mix, cfg.needle_seed)
    val_windows = eval_windows(dataset.val, cfg.seq_len, cfg.eval_batches * cfg.batch_size)[ddp.rank :: ddp.world_size]
    token_bytes = torch.as_tensor(dataset.token_bytes, dtype=torch.int64)

    def evaluate() -> dict[str, Any]:
        nll, tokens, n_bytes = score_windows(model, val_windows, token_bytes, batch_size=cfg.batch_size // ddp.world_size, amp_dtype=amp_dtype)
        return lm_metrics(*ddp.sum(torch.tensor([nll, tokens, n_bytes], dtype=torch.float64)).tolist())

    state = {"config": cfg.to_dict(), "attention": cfg.attention, "dataset": cfg.dataset, "dataset_build_key": dataset_key(dataset)}
    trainer = Trainer(cfg, run_dir, model, make_optimizer(model, cfg), batches, evaluate, model.save_pretrained, state, ddp, amp_dtype, label=f"train {_kind_label(cfg)}")
    ddp.barrier()  # every process has checked the folder before the first file appears
    if resume:
        trainer.restore()
        if trainer.step >= cfg.steps and _finished_summary(run_dir) is not None:
            return None
    elif ddp.is_main:
        write_json(run_dir / CONFIG_FILE, cfg.to_dict())  # written once the run could be set up, so a failed setup leaves no half run
    return trainer


def _finished_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / SUMMARY_FILE
    if path.is_file():
        summary = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(summary, dict) and summary.get("status") == "finished":
            return summary
    return None


def _kind_label(cfg: TrainConfig) -> str:
    return cfg.attention if isinstance(cfg.attention, str) else "/".join(cfg.attention)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log records after ``step`` (written by an invocation that died before its next checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and json.loads(line)["step"] <= step]
    write_text(path, "".join(line + "\n" for line in kept))
