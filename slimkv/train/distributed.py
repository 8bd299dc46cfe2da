"""This process's place in a data-parallel job (``torchrun``): rank, world size, reductions."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
        """End the process group this object created. Wrappers holding the group (DDP's reducer)
        must be gone by now, so that the group's Python handle is its last owner: that handle frees
        it with the GIL released, letting gloo's worker threads finish. ``gc.collect()`` frees a
        wrapper caught in a reference cycle now rather than at some later, GIL-holding moment."""
        if self.owns_group:
            gc.collect()
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
