"""What the loop asks of a parallel strategy, answered for one process: every strategy is a room of its own.

    room = FSDP(accelerator, cfg, layout)          # ddp.py, fsdp.py, zero.py, pipeline.py, tensor.py, context.py
    model = room.shard(model, compute_dtype)       # before the optimizer exists
    model, optimizer = room.prepare(model, optimizer)
    loss, sums = room.train_window(model, batches, objective, scale, micro_step, saving)
    room.sync_gradients(params); norm = room.clip_grad_norm(params, max_norm)
    weights, optimizer_state = room.full_states(model, optimizer)   # whole, for a checkpoint

A room overrides what its strategy changes and answers nothing about another's; runtime.Parallel holds the
one that runs and hands it every call (torchtitan's one parallelize step per dimension, as classes).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from finetune.config.schema import RecipeConfig
from finetune.declarations import compression
from finetune.declarations.layout import Layout
from finetune.declarations.splits import PIPELINE, TENSOR
from finetune.declarations.strategies import of_recipe
from finetune.errors import ConfigError


class Room:
    """One process holding the whole model: nothing to split, sync or gather."""

    name = "single"  # what a run's choices.json records
    replicates = True  # every process a whole replica, its gradients all-reduced (what grad_compression compresses)
    sharded = False  # the weights partitioned over the processes: 4-bit storage in the compute dtype, forwards together
    partitions_root = False  # the head a partition again once the forward has run (ZeRO-3; FSDP's root stays gathered)
    wraps_layers = False  # FSDP2's units around each decoder layer (declarations/techniques' FSDP rules apply)
    updates_in_backward = False  # the engine steps inside the last micro-batch's backward (DeepSpeed)
    sums_own_gradients = False  # no DDP wrapper: the room sums gradients after the window (split strategies)
    holds_whole_model = True  # this process can generate and score pairs (a pipeline stage cannot)
    trains_alone = False  # each rank holds and streams its own copy of the layers: the memory rules see one process
    ideal_idle = 0.0  # the schedule's idle share of a window (a pipeline's fill and drain)
    window_waited: float | None = None  # seconds of the last window spent waiting on others, where the room times them

    def __init__(self, accelerator, cfg: RecipeConfig, layout: Layout, mesh: Any = None) -> None:
        self.accelerator, self.cfg, self.layout = accelerator, cfg, layout
        self.mesh = mesh  # the split dimensions' DeviceMesh (parallel/mesh.py): a room takes its groups from its own

    @classmethod
    def build(cls, accelerator, cfg: RecipeConfig, layout: Layout, model_config: Any, mesh: Any) -> Room:
        """The room for this launch, before any weight loads (model_config: the model's text config.json where a
        split strategy needs it, else None; mesh: parallel/mesh.build_mesh's, None when nothing is split)."""
        return cls(accelerator, cfg, layout, mesh)

    @classmethod
    def variant(cls, cfg: RecipeConfig) -> type[Room]:
        """The class that runs this strategy for this recipe, asked before anything is built (a context-parallel
        group under distributed.strategy=fsdp: parallel/context.py's ShardedContext)."""
        return cls

    @classmethod
    def problems(cls, cfg: RecipeConfig, accelerator) -> list[str]:
        """What this strategy cannot run for this recipe and accelerator, found at launch (its own keys' rules
        are the recipe's)."""
        return []

    def describe(self) -> str | None:
        method = self.cfg.distributed.grad_compression
        if of_recipe(self.cfg).deepspeed:
            return "distributed.strategy=deepspeed: one process, trained without DeepSpeed (ZeRO partitions over processes)"
        if method == "none":
            return None
        return f"distributed.grad_compression={method} has no effect: one process has no gradients to all-reduce"

    # ------------------------------------------------------------------ loading and wrapping

    def placement(self, device: torch.device) -> dict[str, Any] | None:
        """What this process loads where, or None: the whole model on load_device."""
        return None

    def split(self) -> Any:
        """A rank's reading of each weight (model.partial.Split: its share), or None: every weight whole."""
        return None

    def loaded(self, model) -> None:
        """What the room does to the model it read (split()) before the memory techniques move its weights."""

    def load_device(self, device: torch.device, streaming: bool) -> torch.device:
        """Streaming keeps the decoder layers in CPU RAM and moves one at a time."""
        return torch.device("cpu") if streaming else device

    def shard(self, model, compute_dtype: torch.dtype):
        """The model as this process trains it, before the optimizer exists."""
        return model

    def prepare(self, model, optimizer):
        return self.accelerator.prepare(model, optimizer)

    def unwrap(self, model):
        # Not accelerate's unwrap_model: it imports deepspeed whenever it is installed (a warning line in every
        # run). DDP's wrapper is the only one the other strategies put around a model (FSDP2 shards in place).
        return model.module if isinstance(model, DistributedDataParallel) else model

    # ------------------------------------------------------------------ the step

    def gradient_sync(self, model, last: bool):
        """The context of one micro-batch's backward: only the window's last syncs gradients."""
        return self.accelerator.no_sync(model) if not last else nullcontext()

    @property
    def counts_window(self) -> bool:
        """Whether this rank's micro-batches count in the window's totals (tokens, targets, loss)."""
        return True

    def local_part(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What this rank trains of a micro-batch its replica holds."""
        return batch

    def row_group(self) -> tuple[Any, int] | None:
        """The process group whose ranks train parts of the same rows, and its first global rank; None when each
        rank's rows are its own (all but context parallelism)."""
        return None

    def train_window(self, model, batches: list, objective, scale: float, micro_step, saving) -> tuple[float, dict[str, float]]:
        """Each micro-batch in turn (micro_step: its forward and backward, its summed loss), the gradients synced on
        the last; the summed loss and metric sums where this rank counts the window."""
        loss_sum, sums, counts = 0.0, dict[str, float](), self.counts_window
        for i, batch in enumerate(batches):
            with self.gradient_sync(model, last=i == len(batches) - 1):
                loss_sum += float(micro_step(batch, scale)) * counts
            for key, value in objective.metric_sums().items():  # every rank the same keys: summed together
                sums[key] = sums.get(key, 0.0) + value * counts
        return loss_sum, sums

    def fit_objective(self, trainer_class: Any, base_compute_loss, objective) -> None:
        """Take the objective where a room runs it itself (a pipeline's last stage)."""

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """After the window's backward, for a room that sums its own (the others synced inside backward)."""

    def held_out_sums(self, batches: list[dict[str, torch.Tensor]], rows: int) -> tuple[float, float]:
        """The held-out loss's (sum, count) of this rank's batches where no process holds the whole model (the
        loop asks only then: holds_whole_model)."""
        raise NotImplementedError(f"{type(self).__name__} holds the whole model: evaluate it whole")

    def stage_times(self, every_rank) -> list[tuple[float, ...]] | None:
        """Each stage's (busy, whole) seconds in the last window (every_rank: the collective that gathers
        them), or None without stages."""
        return None

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """The whole gradient's norm before clipping, and clipping to max_norm."""
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    # ------------------------------------------------------------------ what a checkpoint needs whole

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """(trainable weights, optimizer state) gathered whole (a collective: every rank calls, rank 0 writes), or
        (None, None): this process holds them whole."""
        return None, None

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        """The trained weights whole (a collective), or None: `model` holds them."""
        return None

    def rank_state(self) -> Any:
        """What this rank's strategy keeps alone across a resume (PowerSGD's error feedback), or None."""
        return None


class SplitRoom(Room):
    """A strategy that splits the model or its rows over processes (pipeline, tensor, context): no DDP wrapper;
    it sums its own gradients (after the window, or in FSDP's reduce-scatter set to a sum: cp x FSDP), so the loss
    is not scaled by the number of processes."""

    replicates = False
    sums_own_gradients = True
    tensor: Any = None  # a pipeline's or context-parallel room's TensorParallel: its share of the weights (cp/pp x tp)

    def split(self) -> Any:
        return self.tensor.split() if self.tensor is not None else None

    def loaded(self, model) -> None:
        if self.tensor is not None:
            self.tensor.loaded(model)

    def prepare(self, model, optimizer):
        return model, self.accelerator.prepare(optimizer)


def refuse_fp16(cfg: RecipeConfig, compute_dtype: torch.dtype) -> None:
    """precision=auto chose fp16 (a GPU without bf16, known at launch): a split model's ranks would each decide
    from their own part of the gradients whether GradScaler skips a step."""
    split = [s.said(cfg) for s in (PIPELINE, TENSOR) if s.asked(cfg)]
    if split and compute_dtype == torch.float16:
        raise ConfigError(
            [
                f"{' x '.join(split)} with fp16: each rank's GradScaler would decide alone whether a step is skipped "
                "(from its own part of the gradients). Set precision=fp32."
            ]
        )


def data_parallel_line(room: Room) -> str:
    """The launch log's line for a strategy that holds the batch's rows apart (DDP, FSDP)."""
    where = f"parallel: {room.name} over {room.accelerator.num_processes} processes"
    return where if room.cfg.distributed.grad_compression == "none" else f"{where}, {compression.describe(room.cfg)}"
