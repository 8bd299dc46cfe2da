"""TrainConfig: defaults, YAML + overrides, clear errors for unknown keys and invalid values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from slimkv.train.config import TrainConfig, load_config, parse_override
from slimkv.train.trainer import learning_rate, make_optimizer


def test_defaults_validate_and_round_trip_through_dict():
    cfg = TrainConfig()
    cfg.validate()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.tokens_per_step == cfg.batch_size * cfg.grad_accum * cfg.seq_len


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("attention: swa\nattention_options: {window: 32}\nsteps: 40\nlr: 3e-4\n")
    cfg = load_config(path, {"steps": 50, "attention_options.window": 16, "kind_options.swa.rope": "none"})
    assert (cfg.attention, cfg.steps, cfg.attention_options) == ("swa", 50, {"window": 16})
    assert cfg.kind_options == {"swa": {"rope": "none"}}
    assert cfg.lr == pytest.approx(3e-4) and isinstance(cfg.lr, float)  # YAML 1.1 reads 3e-4 as a string


def test_comma_separated_attention_is_a_pattern():
    cfg = load_config(None, {"attention": "swa,mha", "kind_options.swa.window": 8})
    assert cfg.attention == ["swa", "mha"] and cfg.kind_options == {"swa": {"window": 8}}


def test_unknown_key_names_close_matches(tmp_path):
    with pytest.raises(ValueError, match=r"unknown training option 'stpes'.*did you mean steps"):
        load_config(None, {"stpes": 5})
    path = tmp_path / "bad.yaml"
    path.write_text("warmup_step: 3\n")
    with pytest.raises(ValueError, match=r"'warmup_step' in .*bad.yaml.*did you mean warmup_steps"):
        load_config(path, {})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtype": "fp16"}, r"dtype='fp16' is not allowed; allowed values: auto, float32, bfloat16"),
        ({"device": "tpu"}, r"device='tpu' is not allowed; allowed values: auto, cpu, cuda"),
        ({"mlp": "gelu"}, r"mlp='gelu' is not allowed; allowed values: swiglu, relu2"),
        ({"steps": 0}, r"steps must be an integer >= 1"),
        ({"lr": math.inf}, r"lr must be a finite number"),
        ({"betas": [0.9]}, r"betas must be two numbers"),
        ({"attention": "mah"}, r"unknown attention kind 'mah' \(did you mean .*mha"),
        ({"attention": "gqa"}, r"attention kind 'gqa' cannot be built .*n_kv_heads"),
        ({"attention": "gqa", "attention_options.n_kv_heads": 3}, r"n_kv_heads=3 must divide n_heads=4"),
        ({"attention_options.windw": 4, "attention": "swa"}, r"unknown option 'windw'.*did you mean window"),
    ],
)
def test_invalid_values_name_the_option(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_parse_override_reads_yaml_values():
    assert parse_override("steps=12") == ("steps", 12)
    assert parse_override("attention=[swa, mha]") == ("attention", ["swa", "mha"])
    assert parse_override("tie_embeddings=false") == ("tie_embeddings", False)
    with pytest.raises(ValueError, match="key=value"):
        parse_override("steps")


def test_diff_lists_changed_keys():
    a, b = TrainConfig(), TrainConfig(steps=7, lr=1e-3)
    assert a.diff(b) == {"steps": (a.steps, 7), "lr": (a.lr, 1e-3)}


def test_learning_rate_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=11, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [learning_rate(s, cfg) for s in range(cfg.steps)]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[2 + 4] == pytest.approx(0.55)  # half-way through the cosine
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_weight_decay_only_on_matrices():
    from slimkv.model import SlimKVForCausalLM

    cfg = TrainConfig(d_model=32, n_layers=1, n_heads=4, attention_options={"bias": True})
    model = SlimKVForCausalLM(cfg.model_config(64))
    decayed, plain = make_optimizer(model, cfg).param_groups
    assert decayed["weight_decay"] == cfg.weight_decay and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert any("norm" in names[id(p)] for p in plain["params"]) and any("bias" in names[id(p)] for p in plain["params"])
    assert sum(p.numel() for g in (decayed, plain) for p in g["params"]) == sum(p.numel() for p in model.parameters())
    assert isinstance(decayed["params"][0], torch.nn.Parameter)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path, {})
    cfg.validate()


def test_small_yaml_spells_out_the_defaults():
    assert load_config(Path(__file__).parents[2] / "configs" / "small.yaml", {}) == TrainConfig()


def test_a_checkpoint_of_other_shapes_is_not_called_damaged(tmp_path):
    """A readable safetensors file whose tensors do not fit the model says so (not "truncated")."""
    import torch
    from safetensors.torch import load_model, save_model

    from slimkv.train.checkpoint import read_safetensors

    save_model(torch.nn.Linear(2, 2), str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="do not fit the model") as err:
        read_safetensors(tmp_path / "w.safetensors", lambda path: load_model(torch.nn.Linear(3, 3), path))
    assert "damaged" not in str(err.value)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="truncated or damaged"):
        read_safetensors(tmp_path / "bad.safetensors", lambda path: load_model(torch.nn.Linear(3, 3), path))
