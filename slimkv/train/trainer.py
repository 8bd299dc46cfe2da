"""The training loop: AdamW + warmup/cosine on random windows of a token dataset, resumable exactly.

One optimizer step sees ``batch_size x grad_accum`` windows of ``seq_len + 1`` tokens drawn at
random from the train split by a seeded generator; the generator's state is the data position
and goes into every checkpoint with the weights, the optimizer moments and the other RNG states,
so ``resume=True`` continues bitwise (on CPU) where the last checkpoint left off.

Under ``torchrun`` every process draws the same global batch and keeps its own slice of it, and
DDP averages the gradients, so the global batch (and, up to float rounding, the run) is the same
as with one process. Rank 0 writes every file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from slimkv.data.needles import NeedleMixture
from slimkv.eval.lm import eval_windows, lm_metrics, score_windows
from slimkv.files import read_json, write_json, write_text
from slimkv.model import SlimKVForCausalLM
from slimkv.train.checkpoint import (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    dataset_key,
    load_checkpoint,
    read_run_config,
    save_checkpoint,
    save_model_dir,
)
from slimkv.train.config import TrainConfig


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; nothing was written after the last good checkpoint."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None, run_dir: Path) -> None:
        kept = f"the last good checkpoint (step {last_checkpoint}) in {run_dir / 'checkpoint'} is intact" if last_checkpoint else "no checkpoint had been written yet"
        super().__init__(f"training diverged at step {step}: loss={loss}, grad_norm={grad_norm}; stopped without saving; {kept}")
        self.step, self.loss, self.grad_norm, self.last_checkpoint = step, loss, grad_norm, last_checkpoint


# ---------------------------------------------------------------- pieces of the loop


@dataclass
class Distributed:
    """This process's place in a data-parallel job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this call created the process group (and so ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_type: str) -> Distributed:
        """Join the process group that ``torchrun`` describes in the environment (gloo on CPU, nccl on GPU)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        owns_group = not dist.is_initialized()
        if owns_group:
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns_group)

    def close(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over processes."""
        if self.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world_size
        return value

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


class BatchSampler:
    """Windows of ``seq_len + 1`` tokens at uniformly random starts; the generator state is the
    data position (save ``state()``, restore with ``load_state``)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the train split has {len(tokens)} tokens, too few for seq_len={seq_len}; lower --seq-len or use more text")
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.seq_len = seq_len
        self.offsets = torch.arange(seq_len + 1)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> torch.Tensor:
        """(n, seq_len + 1) token ids."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (n,), generator=self.generator)
        return self.tokens[starts[:, None] + self.offsets]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """LR of optimizer step ``step`` (0-based): linear warmup to ``lr``, then cosine down to
    ``lr * min_lr_ratio``, reached at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices (projections, embeddings); none on 1-D
    parameters (norm gains, biases)."""
    params = list(model.parameters())  # tied weights appear once
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


def accumulate_gradients(model: torch.nn.Module, micro_batches: torch.Tensor, amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Forward and backward over ``micro_batches`` (accum, batch, seq_len + 1); the gradients sum to
    those of the mean loss over all of them. Returns that mean loss (detached). Under DDP, gradients
    are synchronised on the last micro-batch only."""
    accum = micro_batches.shape[0]
    loss_sum = torch.zeros((), device=micro_batches.device)
    for i, ids in enumerate(micro_batches):
        skip_sync = isinstance(model, torch.nn.parallel.DistributedDataParallel) and i < accum - 1
        with model.no_sync() if skip_sync else nullcontext():
            with torch.autocast(ids.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(ids[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            (loss / accum).backward()
        loss_sum += loss.detach()
    return loss_sum / accum


def rng_states(sampler: BatchSampler) -> dict[str, torch.Tensor]:
    """Every generator whose state matters for continuing exactly."""
    states = {"sampler": sampler.state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states.update({f"torch_cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def restore_rng_states(states: dict[str, torch.Tensor], sampler: BatchSampler) -> None:
    sampler.load_state(states["sampler"])
    torch.set_rng_state(states["torch_cpu"])
    cuda_keys = sorted((k for k in states if k.startswith("torch_cuda.")), key=lambda k: int(k.split(".")[1]))
    cuda = [states[k] for k in cuda_keys]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def prepare_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool) -> None:
    """Refuse to mix runs: a new run needs an empty folder; a resumed one the same config."""
    if resume:
        stored = read_run_config(run_dir)
        differences = stored.diff(cfg)
        if differences:
            lines = "\n".join(f"  {k}: stored {a!r}, requested {b!r}" for k, a, b in ((k, *v) for k, v in differences.items()))
            raise ValueError(
                f"--resume: {run_dir} was trained with a different configuration:\n{lines}\n"
                "resume with the same options (or no options at all), or start a new run with another --out"
            )
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} is not empty: continue that run with --resume, or choose another --out")


# ---------------------------------------------------------------- the loop


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

    ``dataset``: a loaded dataset to use instead of ``load_dataset(cfg.dataset)``.
    ``stop_after``: stop after this many optimizer steps of this call, writing nothing more (what a
    killed process leaves behind; tests use it). ``on_step(step, model)`` runs after every optimizer
    step. Raises ``TrainingDiverged`` on a non-finite loss or gradient norm.
    """
    cfg.validate()
    device, amp_dtype = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    ddp = Distributed.from_env(device.type)
    try:
        return _train(cfg, Path(out_dir), device, amp_dtype, ddp, resume=resume, progress=progress, dataset=dataset, stop_after=stop_after, on_step=on_step)
    finally:
        ddp.close()


def _train(cfg: TrainConfig, run_dir: Path, device: torch.device, amp_dtype: torch.dtype | None, ddp: Distributed, *, resume: bool, progress: bool, dataset: Any, stop_after: int | None, on_step: Callable | None) -> dict[str, Any]:
    if cfg.batch_size % ddp.world_size:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the number of processes ({ddp.world_size})")
    prepare_run_dir(run_dir, cfg, resume)
    if dataset is None:
        from slimkv.data import load_dataset

        dataset = load_dataset(cfg.dataset)
    ddp.barrier()  # every process has checked the folder before the first file appears
    if ddp.is_main and not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / CONFIG_FILE, cfg.to_dict())

    torch.manual_seed(cfg.seed)
    model = SlimKVForCausalLM(cfg.model_config(dataset.vocab_size)).to(device)
    optimizer = make_optimizer(model, cfg)
    sampler = BatchSampler(dataset.train, cfg.seq_len, cfg.seed)
    needles = NeedleMixture(dataset, cfg.seq_len, cfg.needle_mix, cfg.needle_seed) if cfg.needle_mix > 0 else None  # stateless: a function of (needle_seed, step)
    val_windows = eval_windows(dataset.val, cfg.seq_len, cfg.eval_batches * cfg.batch_size)[ddp.rank :: ddp.world_size]
    token_bytes = torch.as_tensor(dataset.token_bytes, dtype=torch.int64)
    step, tokens_seen, last_checkpoint, last_eval = 0, 0, None, None
    restored = load_checkpoint(run_dir, model=model, optimizer=optimizer) if resume else None
    if restored is not None:
        state, rngs = restored
        restore_rng_states(rngs, sampler)
        step, tokens_seen, last_eval = state["step"], state["tokens_seen"], state.get("last_eval")
        last_checkpoint = step
        if step >= cfg.steps and (run_dir / SUMMARY_FILE).is_file() and read_json(run_dir / SUMMARY_FILE).get("status") == "finished":
            return read_json(run_dir / SUMMARY_FILE)  # already finished: nothing to train
    if ddp.is_main and resume:
        _truncate_metrics(run_dir / METRICS_FILE, step)
    n_params = sum(p.numel() for p in model.parameters())
    trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) if ddp.world_size > 1 else model
    micro = cfg.batch_size // ddp.world_size

    def log(record: dict[str, Any]) -> None:
        if ddp.is_main:
            with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as f:
                f.write(_json_line(record))

    def evaluate() -> dict[str, Any]:
        model.eval()
        nll, tokens, n_bytes = score_windows(model, val_windows, token_bytes, batch_size=micro, amp_dtype=amp_dtype)
        model.train()
        totals = ddp.sum(torch.tensor([nll, tokens, n_bytes], dtype=torch.float64))
        return {"step": step, **lm_metrics(*totals.tolist())}

    def checkpoint() -> None:
        if ddp.is_main:
            state = {"step": step, "tokens_seen": tokens_seen, "last_eval": last_eval, "config": cfg.to_dict(), "dataset_build_key": dataset_key(dataset), "world_size": ddp.world_size}
            save_checkpoint(run_dir, model=model, optimizer=optimizer, rng=rng_states(sampler), state=state)
            save_model_dir(run_dir, model)
        ddp.barrier()

    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {_kind_label(cfg)}", unit="step", disable=not (progress and ddp.is_main), dynamic_ncols=True)
    start_step, train_seconds, first_step_seconds, started = step, 0.0, None, time.perf_counter()
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            lr = learning_rate(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = sampler.sample(cfg.grad_accum * cfg.batch_size)
            if needles is not None:
                batch = needles.apply(batch, step)
            batch = batch.view(cfg.grad_accum, cfg.batch_size, -1)
            shard = batch[:, ddp.rank :: ddp.world_size].to(device)
            train_loss = ddp.mean(accumulate_gradients(trained, shard, amp_dtype)).item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf).item()
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                raise TrainingDiverged(step + 1, train_loss, grad_norm, last_checkpoint, run_dir)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += cfg.tokens_per_step
            train_seconds += time.perf_counter() - t0
            if first_step_seconds is None:
                first_step_seconds = train_seconds  # kernel selection and allocator warm-up: kept out of the steady rate
            if on_step is not None:
                on_step(step, model)

            tokens_per_s = (step - start_step) * cfg.tokens_per_step / train_seconds
            bar.update()
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            if step % cfg.log_every == 0 or step == cfg.steps:
                log({"type": "train", "step": step, "loss": train_loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens_seen, "tokens_per_s": tokens_per_s, "elapsed_s": time.perf_counter() - started})
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                last_eval = evaluate()
                log({"type": "eval", **last_eval})
                if progress and ddp.is_main:
                    bar.write(f"step {step}: val CE {last_eval['ce']:.4f} nats, BPB {last_eval['bpb']:.4f} ({int(last_eval['tokens']):,} tokens)")
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                checkpoint()
                last_checkpoint = step
            if stop_after is not None and step - start_step >= stop_after and step < cfg.steps:
                return {"status": "stopped", "step": step, "last_checkpoint": last_checkpoint}
    except TrainingDiverged as err:
        if ddp.is_main:
            write_json(run_dir / SUMMARY_FILE, {"status": "diverged", "message": str(err), "step": err.step, "last_checkpoint": last_checkpoint})
        raise
    finally:
        bar.close()

    invocation_tokens = (step - start_step) * cfg.tokens_per_step
    steady_steps = step - start_step - 1
    steady_seconds = train_seconds - (first_step_seconds or 0.0)
    summary = {
        "status": "finished",
        "step": step,
        "steps": cfg.steps,
        "tokens_seen": tokens_seen,
        "val_ce": last_eval["ce"] if last_eval else None,
        "val_bpb": last_eval["bpb"] if last_eval else None,
        "val_tokens": last_eval["tokens"] if last_eval else None,
        "parameters": n_params,
        "attention": cfg.attention,
        "dataset": cfg.dataset,
        "dataset_build_key": dataset_key(dataset),
        "device": str(device),
        "autocast": str(amp_dtype).replace("torch.", "") if amp_dtype else "float32",
        "world_size": ddp.world_size,
        "threads": torch.get_num_threads(),
        "resumed_from_step": start_step if restored is not None else None,
        "train_seconds": train_seconds,
        "train_tokens_per_s": steady_steps * cfg.tokens_per_step / steady_seconds if steady_steps > 0 and steady_seconds > 0 else None,
        "train_tokens_per_s_note": "steps after this invocation's first (the first step's warm-up is excluded)",
        "first_step_seconds": first_step_seconds,
        "train_tokens_per_s_with_first_step": invocation_tokens / train_seconds if train_seconds else None,
        "wall_seconds": time.perf_counter() - started,
    }
    if ddp.is_main:
        write_json(run_dir / SUMMARY_FILE, summary)
    return summary


def _kind_label(cfg: TrainConfig) -> str:
    return cfg.attention if isinstance(cfg.attention, str) else "/".join(cfg.attention)


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record) + "\n"


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log records after ``step`` (written by an invocation that died before its next checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and json.loads(line)["step"] <= step]
    write_text(path, "".join(line + "\n" for line in kept))
