"""``TrainConfig``: everything that defines a training run, from defaults, a YAML file and overrides.

The defaults are the demo recipe: a small model (d_model 128, 4 layers, 4 heads, 128-token
context, 1.4M parameters with the 4096-id Shakespeare tokenizer) trained for 120 steps of 8
sequences (123K tokens), about a minute per attention kind on a 2-core CPU. ``load_config`` reads
an optional YAML file and applies command-line overrides; unknown keys and invalid values raise
``ValueError`` naming the option (and close matches or the allowed values) before any work.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slimkv.common.checks import check_bool, check_choice, check_float, check_int, close_matches
from slimkv.common.spec import AttentionSpec, read_value
from slimkv.model.config import MLP_KINDS, ModelConfig

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class TrainConfig:
    """One training run. ``batch_size`` x ``grad_accum`` sequences of ``seq_len`` tokens make one
    optimizer step (the global batch, whatever the number of data-parallel processes)."""

    # model shape (the vocabulary size comes from the dataset)
    attention: str | list[str] = "mha"
    attention_options: dict[str, Any] = field(default_factory=dict)
    kind_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int | None = None
    mlp: str = "swiglu"
    d_ff: int | None = None
    tie_embeddings: bool = True
    # data
    dataset: str = "shakespeare"
    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    # needle mixture: this fraction of training sequences is replaced by synthetic needle documents
    # built from the train split (slimkv.data.ruler_needles), drawn from needle_seed; 0 = plain text only
    needle_mix: float = 0.0
    needle_seed: int = 0
    # optimisation: AdamW, linear warmup then cosine from lr down to lr * min_lr_ratio
    steps: int = 120
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 12
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    # bookkeeping (0 for eval_every / checkpoint_every = only at the end)
    seed: int = 0
    eval_every: int = 40
    eval_batches: int = 8
    checkpoint_every: int = 40
    log_every: int = 10
    # where and how: auto = CUDA if available, bf16 autocast on CUDA, float32 on CPU
    device: str = "auto"
    dtype: str = "auto"

    # -- conversions ----------------------------------------------------------------

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build and validate; unknown keys raise ValueError naming close matches."""
        check_keys(values, cls.keys())
        cfg = cls(**{k: _normalise(k, v) for k, v in values.items()})
        cfg.validate()
        return cfg

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step (the global batch)."""
        return self.batch_size * self.grad_accum * self.seq_len

    def attention_spec(self) -> AttentionSpec:
        """The attention of this run's layers (``slimkv.common.spec``)."""
        return AttentionSpec.from_fields(self.attention, self.attention_options, self.kind_options)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The ``ModelConfig`` of this run for a dataset with ``vocab_size`` ids."""
        return ModelConfig(
            vocab_size=vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            attention=self.attention,
            attention_options=self.attention_options,
            kind_options=self.kind_options,
            mlp=self.mlp,
            d_ff=self.d_ff,
            tie_word_embeddings=self.tie_embeddings,
        )

    def diff(self, other: TrainConfig) -> dict[str, tuple[Any, Any]]:
        """{key: (self's value, other's value)} for every key that differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}

    # -- validation -------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError naming the option for any value that cannot train."""
        self.attention_spec()  # the attention fields are well formed (the model config below checks kinds and options)
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "log_every"):
            check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "seed", "eval_every", "checkpoint_every"):
            check_int(name, getattr(self, name), 0)
        for name in ("head_dim", "d_ff"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_choice("mlp", self.mlp, MLP_KINDS)
        check_bool("tie_embeddings", self.tie_embeddings)
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(f"dataset must be a dataset name (e.g. shakespeare), got {self.dataset!r}")
        check_optimizer_settings(self)
        if self.device not in DEVICES and not (isinstance(self.device, str) and self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r} is not allowed; allowed values: {', '.join(DEVICES)}, cuda:N")
        check_choice("dtype", self.dtype, DTYPES)
        check_float("needle_mix", self.needle_mix, 0.0, 1.0)
        check_int("needle_seed", self.needle_seed, 0)
        self.model_config(vocab_size=256)  # kinds, options and shapes (every layer built on the meta device), before any data is read


def check_optimizer_settings(cfg: Any, prefix: str = "") -> None:
    """The optimisation fields every training loop reads (``make_optimizer``, ``learning_rate``):
    lr > 0, min_lr_ratio in [0, 1], weight_decay >= 0, grad_clip >= 0 (0 = off), two betas in
    [0, 1), warmup_steps >= 0 when the config has it. ``prefix`` goes before the names in messages."""
    check_float(f"{prefix}lr", cfg.lr, 0.0, open_low=True)
    check_float("min_lr_ratio", cfg.min_lr_ratio, 0.0, 1.0)
    check_float("weight_decay", cfg.weight_decay, 0.0)
    check_float("grad_clip", cfg.grad_clip, 0.0)
    if not (isinstance(cfg.betas, (list, tuple)) and len(cfg.betas) == 2):
        raise ValueError(f"betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {cfg.betas!r}")
    for i, beta in enumerate(cfg.betas):
        check_float(f"betas[{i}]", beta, 0.0, math.nextafter(1.0, 0.0))
    if isinstance(getattr(type(cfg), "warmup_steps", None), property):
        return
    check_int("warmup_steps", cfg.warmup_steps, 0)


def check_keys(values: dict[str, Any], allowed: list[str], where: str = "") -> None:
    """ValueError for the first key of ``values`` not in ``allowed``, naming close matches."""
    for key in values:
        if key not in allowed:
            raise ValueError(f"unknown training option {key!r}{where}{close_matches(key, allowed)}; known options: {', '.join(allowed)}")


def _normalise(key: str, value: Any) -> Any:
    """Forgiving conversions for values that come from YAML, JSON or the command line."""
    default = {f.name: f for f in dataclasses.fields(TrainConfig)}[key].default
    if isinstance(default, float) and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "3e-3" as a string
        except ValueError:
            return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if key == "betas" and isinstance(value, tuple):
        return list(value)
    if key == "attention" and isinstance(value, str) and "," in value:
        return [k.strip() for k in value.split(",")]
    if key == "attention" and isinstance(value, tuple):
        return list(value)
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` from ``--set``; the value is read as every option grammar reads one
    (``slimkv.common.spec.read_value``: ``64`` -> int, ``1e-3`` -> float, ``[a, b]`` -> list)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set expects key=value (e.g. --set lr=1e-3 or --set attention_options.window=64), got {text!r}")
    try:
        value = read_value(raw)
    except yaml.YAMLError as err:
        raise ValueError(f"--set {key}: cannot read {raw!r} as a value: {err}") from None
    return key.strip(), value


def attention_overrides(text: str) -> dict[str, Any]:
    """Overrides from an attention entry (``--attention swa+kvm:swa.window=32``, grammar in
    ``slimkv.common.spec``): the kinds, and each option as a dotted ``attention_options`` /
    ``kind_options`` key, so they combine with ``--set``."""
    spec = AttentionSpec.parse(text)
    overrides: dict[str, Any] = {"attention": spec.to_fields()["attention"]}
    overrides.update({f"attention_options.{name}": value for name, value in spec.shared.items()})
    for kind, options in spec.per_kind.items():
        overrides.update({f"kind_options.{kind}.{name}": value for name, value in options.items()})
    return overrides


def apply_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` with ``overrides`` applied; a dotted key (``attention_options.window``,
    ``kind_options.swa.window``) sets an entry inside a mapping-valued option."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    for key, value in overrides.items():
        top, *path = key.split(".")
        check_keys({top: None}, TrainConfig.keys())
        if not path:
            out[top] = value
            continue
        if top not in ("attention_options", "kind_options"):
            raise ValueError(f"{key!r}: only attention_options and kind_options take dotted keys")
        node = out.setdefault(top, {})
        if not isinstance(node, dict):
            raise ValueError(f"{key!r}: {top} is not a mapping")
        node = out[top] = _deep_copy_dicts(node)
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _deep_copy_dicts(node: dict) -> dict:
    return {k: _deep_copy_dicts(v) if isinstance(v, dict) else v for k, v in node.items()}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``overrides``; validated."""
    values = TrainConfig().to_dict()
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"config file {path} is a folder; give a YAML file")
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a readable YAML file of training options (safe YAML only: no tags): {' '.join(str(err).split())}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file must be a mapping of option: value")
        check_keys(loaded, TrainConfig.keys(), where=f" in {path}")
        values.update(loaded)
    return TrainConfig.from_dict(apply_overrides(values, overrides or {}))
