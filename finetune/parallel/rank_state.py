"""What each process holds alone: its generators and its gradient compressor's state.

The Parallel object collects one RankState per process for a checkpoint
(runs/checkpoint.py writes them); a resume gives each rank back its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from finetune.errors import CheckpointError


def rng_states() -> dict[str, torch.Tensor]:
    """This process's generator states: CPU, and the current GPU's (dropout on a GPU draws from it)."""
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(saved: dict[str, torch.Tensor], rank: int) -> None:
    """Each process takes its own saved generator states (`name.rankN`), or rank 0's when the
    checkpoint came from another number of processes (or from one)."""
    own = {name: saved.get(f"{name}.rank{rank}", saved.get(name)) for name in ("torch_cpu", "torch_cuda")}
    cpu, cuda = own["torch_cpu"], own["torch_cuda"]
    if cpu is None:
        raise CheckpointError("rng.safetensors holds no CPU generator state (torch_cpu)")
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


@dataclass
class RankState:
    """What one process holds alone, for a resume that gives each rank back its own."""

    rng: dict[str, torch.Tensor]  # rng_states()
    powersgd: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None  # (tensors, JSON scalars)
