"""The training loop: learning, exact resume, kill recovery, NaN handling, safe files, DDP, load_run."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slimkv.common.files import read_json
from slimkv.train import TrainingDiverged, load_run, train
from slimkv.train.distributed import Distributed
from slimkv.train.trainer import Trainer
from tests.train.tiny import one_thread, tiny_config

TIMING_KEYS = {"tokens_per_s", "elapsed_s"}


def metrics(run_dir: Path) -> list[dict]:
    """The metrics log without wall-clock fields (those differ between runs by nature)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoint" / "model.safetensors")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny_cache):
    """8 steps in one go (checkpoints at 3 and 6 and the end)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("SLIMKV_CACHE", str(tiny_cache))
        summary = train(tiny_config(checkpoint_every=3, eval_every=3), run_dir, progress=False)
    return run_dir, summary


def test_loss_falls_in_a_short_run(tmp_path):
    summary = train(tiny_config(steps=30, eval_every=10, checkpoint_every=0, log_every=5), tmp_path / "run", progress=False)
    log = metrics(tmp_path / "run")
    train_losses = [r["loss"] for r in log if r["type"] == "train"]
    val = [r["ce"] for r in log if r["type"] == "eval"]
    assert train_losses[-1] < train_losses[0] - 1.0
    assert val[-1] < val[0] and val[-1] < math.log(300) - 1.5  # well below a uniform guess over 300 ids
    assert summary["status"] == "finished" and summary["step"] == 30 and summary["val_ce"] == val[-1]


def test_resume_continues_bitwise(straight_run, tmp_path):
    """4 steps, stop, resume for the other 4 == 8 steps in one go: same weights, same metrics."""
    straight, _ = straight_run
    cfg = tiny_config(checkpoint_every=3, eval_every=3)
    split = tmp_path / "run"
    first = train(cfg, split, progress=False, stop_after=3)
    assert first == {"status": "stopped", "step": 3, "last_checkpoint": 3}
    summary = train(cfg, split, resume=True, progress=False)
    assert summary["resumed_from_step"] == 3 and summary["step"] == 8
    assert_same_weights(weights(split), weights(straight))
    assert metrics(split) == metrics(straight)
    assert read_json(split / "summary.json")["val_ce"] == read_json(straight / "summary.json")["val_ce"]


def test_killed_run_loses_only_the_steps_since_the_last_checkpoint(straight_run, tmp_path):
    straight, _ = straight_run
    cfg = tiny_config(checkpoint_every=3, eval_every=3)
    run_dir = tmp_path / "run"
    train(cfg, run_dir, progress=False, stop_after=5)  # "killed" after step 5: last checkpoint at step 3
    assert read_json(run_dir / "checkpoint" / "state.json")["step"] == 3
    assert max(r["step"] for r in metrics(run_dir)) == 5
    summary = train(cfg, run_dir, resume=True, progress=False)
    assert summary["resumed_from_step"] == 3  # steps 4 and 5 were lost and are redone
    assert_same_weights(weights(run_dir), weights(straight))
    assert metrics(run_dir) == metrics(straight)  # the lost steps' log records were replaced, not duplicated


def test_resume_of_a_finished_run_trains_nothing(straight_run):
    run_dir, summary = straight_run
    before = weights(run_dir)
    again = train(tiny_config(checkpoint_every=3, eval_every=3), run_dir, resume=True, progress=False)
    assert again == summary
    assert_same_weights(weights(run_dir), before)


def test_nan_loss_stops_with_the_last_good_checkpoint_intact(tmp_path):
    run_dir = tmp_path / "run"

    def poison(step: int, model: torch.nn.Module) -> None:
        if step == 5:
            with torch.no_grad():
                model.model.norm.weight.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match=r"diverged at step 6: loss=nan.*last good checkpoint \(step 4\).*intact") as caught:
        train(tiny_config(), run_dir, progress=False, on_step=poison)
    assert caught.value.step == 6 and caught.value.last_checkpoint == 4
    assert read_json(run_dir / "checkpoint" / "state.json")["step"] == 4
    saved = weights(run_dir)
    assert all(torch.isfinite(t).all() for t in saved.values())
    model, _, _ = load_run(run_dir)
    assert torch.equal(model.model.norm.weight, saved["model.norm.weight"])
    assert read_json(run_dir / "summary.json")["status"] == "diverged"
    assert max(r["step"] for r in metrics(run_dir)) == 5


def test_run_directory_holds_only_safetensors_and_json(straight_run):
    run_dir, _ = straight_run
    files = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
    assert {"train_config.json", "metrics.jsonl", "summary.json", "model/config.json", "model/model.safetensors"} <= set(files)
    assert {f"checkpoint/{n}" for n in ("model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "state.json")} <= set(files)
    assert all(Path(f).suffix in {".safetensors", ".json", ".jsonl"} for f in files), files
    assert not any(part.startswith(".") for f in files for part in Path(f).parts), "staging leftovers"
    for f in files:
        if f.endswith(".safetensors"):
            load_file(run_dir / f)  # parses as safetensors (no pickle anywhere)
        else:
            [json.loads(line) for line in (run_dir / f).read_text().splitlines()] if f.endswith(".jsonl") else json.loads((run_dir / f).read_text())


def test_load_run_gives_the_latest_weights_and_auto_classes_load_them(straight_run):
    run_dir, _ = straight_run
    model, cfg, dataset = load_run(run_dir)
    assert cfg == tiny_config(checkpoint_every=3, eval_every=3) and dataset.name == "tiny"
    saved, state = weights(run_dir), model.state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie_embeddings survives the round trip
    assert set(state) - set(saved) <= {"model.embed_tokens.weight", "lm_head.weight"}  # a tied pair is stored once
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    auto = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    ids = torch.tensor([dataset.encode("KING: the good lord")])
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, model(ids).logits)


def test_new_run_refuses_a_non_empty_directory_and_resume_refuses_other_options(straight_run):
    run_dir, _ = straight_run
    with pytest.raises(ValueError, match="is not empty: continue that run with --resume, or choose another --out"):
        train(tiny_config(checkpoint_every=3, eval_every=3), run_dir, progress=False)
    with pytest.raises(ValueError, match=r"different configuration:\n  lr: stored 0\.01, requested 0\.02"):
        train(tiny_config(checkpoint_every=3, eval_every=3, lr=0.02), run_dir, resume=True, progress=False)


@pytest.mark.slow
def test_two_process_ddp_matches_single_process(straight_run, tmp_path, tiny_cache):
    """torchrun with 2 CPU processes (gloo): each takes half of every global batch; same loss curve."""
    straight, _ = straight_run
    run_dir = tmp_path / "ddp"
    cfg = tiny_config(checkpoint_every=3, eval_every=3)
    overrides = [f"--set={k}={json.dumps(v)}" for k, v in cfg.to_dict().items()]
    env = {**os.environ, "SLIMKV_CACHE": str(tiny_cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "slimkv", "train", "--out", str(run_dir), "--no-progress", *overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["world_size"] == 2 and summary["step"] == 8
    single, ddp = metrics(straight), metrics(run_dir)
    assert [(r["type"], r["step"]) for r in single] == [(r["type"], r["step"]) for r in ddp]
    for a, b in zip(single, ddp):
        key = "loss" if a["type"] == "train" else "ce"
        assert b[key] == pytest.approx(a[key], rel=1e-4), (a, b)  # float rounding only (seen: ~1e-7)
        if a["type"] == "eval":
            assert b["tokens"] == a["tokens"] and b["bytes"] == a["bytes"]  # every rank's share counted once
    ddp_weights = weights(run_dir)
    for name, tensor in weights(straight).items():
        assert torch.allclose(ddp_weights[name], tensor, rtol=1e-3, atol=1e-5), name


def test_closing_a_trainer_frees_its_ddp_wrapper(tmp_path):
    """DDP's reducer must not be the process group's last owner when the group ends: freed from
    there, gloo's destructor holds the GIL its worker threads need, and the process hangs after
    training (seen in CI). ``Trainer.close`` drops the wrapper first."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        trainer = Trainer(cfg=None, run_dir=tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), batches=None,
                          evaluate=dict, save_model=lambda folder: None, state={}, ddp=Distributed(rank=0, world_size=2))
        assert isinstance(trainer.trained, torch.nn.parallel.DistributedDataParallel)
        wrapper = weakref.ref(trainer.trained)
        trainer.close()
        gc.collect()
        assert wrapper() is None and trainer.trained is model
    finally:
        dist.destroy_process_group()
