"""What each process holds alone: its generators, its gradient compressor's state, its objective's state.

The Parallel object collects one RankState per process for a checkpoint (save_rank_states writes
their files into it); a resume gives each rank back its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

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
    objective: dict[str, torch.Tensor] | None = None  # Loss.state_dict(): grpo's completions sampled ahead


COMPRESSION_DIR = "grad_compression"
OBJECTIVE_DIR = "objective"


def save_rank_states(directory: Path, states: list[RankState]) -> None:
    """rng.safetensors (`name.rankN`, and rank 0's plain), and each rank's PowerSGD state and objective state in
    files of their own (into a checkpoint's temporary directory: the checkpoint's manifest covers them). Rank 0's
    plain states are those gathered with the others (a write in the background runs after the step moved them on)."""
    rng = {name: t.clone() for name, t in states[0].rng.items()} if states else rng_states()
    for r, state in enumerate(states):
        rng.update({f"{name}.rank{r}": t.clone() for name, t in state.rng.items()})  # own storage each
        if state.powersgd is not None:
            tensors, scalars = state.powersgd
            (directory / COMPRESSION_DIR).mkdir(exist_ok=True)
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / COMPRESSION_DIR / f"rank{r}.safetensors"))
            text = json.dumps({"method": "powersgd", **scalars}, indent=2, sort_keys=True) + "\n"
            (directory / COMPRESSION_DIR / f"rank{r}.json").write_text(text, encoding="utf-8")
        if state.objective:
            save_objective_state(directory, r, state.objective)
    save_file(rng, str(directory / "rng.safetensors"))


def read_powersgd(directory: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool] | None:
    """(tensors, scalars, own rank) of this rank's PowerSGD state, rank 0's when the checkpoint came from
    fewer processes; None when the run that wrote it did not use PowerSGD."""
    for r in (rank, 0):
        path = directory / COMPRESSION_DIR / f"rank{r}.safetensors"
        if path.is_file():
            scalars = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
            if scalars.get("method") != "powersgd" or "iter" not in scalars:
                raise ValueError(f"{path.with_suffix('.json').name} is not a PowerSGD state this version reads")
            return load_file(str(path)), scalars, r == rank
    return None


def save_objective_state(directory: Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """One rank's objective state, in a file of its own (objective/rankN.safetensors)."""
    (directory / OBJECTIVE_DIR).mkdir(exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / OBJECTIVE_DIR / f"rank{rank}.safetensors"))


def read_objective_state(directory: Path, rank: int) -> dict[str, torch.Tensor]:
    """This rank's objective state ({} when the checkpoint holds none for it: never another rank's)."""
    path = Path(directory) / OBJECTIVE_DIR / f"rank{rank}.safetensors"
    try:
        return load_file(str(path)) if path.is_file() else {}
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"checkpoint '{directory}': {OBJECTIVE_DIR}/{path.name} cannot be read: {exc}") from None
