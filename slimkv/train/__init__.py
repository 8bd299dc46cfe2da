"""Training small slimkv LMs: ``TrainConfig``, ``train`` (resumable, DDP under torchrun), ``load_run``."""

from slimkv.train.checkpoint import load_run
from slimkv.train.config import TrainConfig, load_config
from slimkv.train.trainer import TrainingDiverged, train

__all__ = ["TrainConfig", "TrainingDiverged", "load_config", "load_run", "train"]
