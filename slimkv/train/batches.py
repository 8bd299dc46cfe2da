"""Where training batches come from: random windows of a token array, seeded, with the generator
state as the data position (so a checkpoint can hold it), optionally mixed with needle documents."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from slimkv.data.ruler_needles import NeedleMixture


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


class LMBatches:
    """Training batches of a language-model run: ``BatchSampler`` windows of the train split, with
    a fraction replaced by needle documents when ``needle_mix`` > 0 (a stateless function of
    (needle_seed, step), so only the sampler's state needs checkpointing)."""

    def __init__(self, dataset: Any, seq_len: int, seed: int, needle_mix: float = 0.0, needle_seed: int = 0) -> None:
        self.sampler = BatchSampler(dataset.train, seq_len, seed)
        self.needles = NeedleMixture(dataset, seq_len, needle_mix, needle_seed) if needle_mix > 0 else None

    def sample(self, step: int, n: int) -> torch.Tensor:
        """(n, seq_len + 1) token ids for optimizer step ``step``."""
        batch = self.sampler.sample(n)
        return self.needles.apply(batch, step) if self.needles is not None else batch

    def state(self) -> dict[str, torch.Tensor]:
        return {"sampler": self.sampler.state()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.sampler.load_state(state["sampler"])
