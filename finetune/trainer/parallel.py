"""One object for how a run is spread over processes: single, DDP or FSDP.

    parallel = Parallel.choose(cfg, accelerator)      # resolves distributed.strategy=auto
    model = parallel.shard(model, cfg, dtype)          # FSDP: before the optimizer exists
    model, optimizer = parallel.prepare(model, optimizer)
    with parallel.gradient_sync(model, last_micro_batch):
        loss.backward()

Every strategy branch of the trainer lives here; the loop asks, never checks names.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch

from finetune import memory_modes
from finetune.checkpoint import rng_states
from finetune.config import RecipeConfig
from finetune.distributed import (
    check_strategy,
    full_optimizer_state,
    full_trainable_state,
    place_sharded,
    resolve_strategy,
    shard_model,
)
from finetune.errors import ConfigError
from finetune.hardware import release_free_heap


class Parallel:
    def __init__(self, accelerator, strategy: str):
        self.accelerator = accelerator
        self.strategy = strategy  # single | ddp | fsdp

    @classmethod
    def choose(cls, cfg: RecipeConfig, accelerator) -> Parallel:
        """The strategy for this launch (auto: DDP unless a replica would not fit), checked against the recipe."""
        strategy = resolve_strategy(cfg, accelerator.num_processes, accelerator.device)
        check_strategy(cfg, strategy)
        problems = memory_modes.problems(
            memory_modes.launch_settings(cfg, strategy, accelerator.num_processes), (memory_modes.LAUNCH,)
        )
        if problems:
            raise ConfigError(problems)
        return cls(accelerator, strategy)

    # ------------------------------------------------------------------ who and where

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def describe(self) -> str | None:
        return None if self.strategy == "single" else f"parallel: {self.strategy} over {self.world} processes"

    def load_device(self, streaming: bool) -> torch.device:
        """Where the model is loaded. FSDP loads into CPU RAM and moves only this rank's shard to the
        GPU, and streaming keeps the decoder layers there: a whole 4-bit 70B model (~37 GB) would not
        fit one 24 GB card even for a moment."""
        return torch.device("cpu") if self.sharded or streaming else self.device

    # ------------------------------------------------------------------ wrapping

    def shard(self, model, cfg: RecipeConfig, compute_dtype: torch.dtype):
        """FSDP: shard the model before the optimizer exists (its state is then sharded too)."""
        if not self.sharded:
            return model
        shard_model(model, cfg, compute_dtype)
        place_sharded(model, self.device, keep_params_on_cpu=cfg.distributed.cpu_offload)
        release_free_heap()  # the whole model each process loaded, now that it keeps only its shards
        return model

    def prepare(self, model, optimizer):
        """accelerate's wrappers: DDP for the model (not for FSDP, which prepare() would wrap in DDP)."""
        if self.sharded:
            return model, self.accelerator.prepare(optimizer)
        return self.accelerator.prepare(model, optimizer)

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    # ------------------------------------------------------------------ the step

    def gradient_sync(self, model, last: bool):
        """Only the last micro-batch of the window all-reduces (DDP) or reduce-scatters (FSDP) gradients."""
        if self.sharded:
            model.set_requires_gradient_sync(last)
            return nullcontext()
        return self.accelerator.no_sync(model) if not last else nullcontext()

    def global_sum(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(self.accelerator.reduce(t, reduction="sum").item())

    def eval_rounds(self, n_batches: int, mine: int) -> int:
        """Forwards this rank runs to evaluate its share of n_batches. FSDP gathers weights inside every
        forward, so all ranks must run as many; ranks with fewer batches repeat one and discard it."""
        return math.ceil(n_batches / self.world) if self.sharded else mine

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ what a checkpoint needs whole

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """(trainable weights, optimizer state) gathered whole under FSDP (a collective: every rank
        calls, rank 0 writes); (None, None) when the process holds them whole already."""
        if not self.sharded:
            return None, None
        return full_trainable_state(model), full_optimizer_state(optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return full_trainable_state(model) if self.sharded else None

    def every_rank_rng(self) -> list[dict[str, torch.Tensor]] | None:
        """Each rank's generator states (its own dropout streams), for a resume that continues each."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        states: list[Any] = [None] * self.world
        dist.all_gather_object(states, rng_states())
        return states

    def close(self) -> None:
        if self.world > 1:
            # A process group left to interpreter exit can abort a finished worker (seen once in
            # 10+ FSDP runs: SIGABRT, "terminate called without an active exception"); torch
            # asks for destroy_process_group before exit.
            self.accelerator.state.destroy_process_group()
