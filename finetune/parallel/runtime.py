"""One object for how a run is spread over processes; each strategy's room answers for it.

    parallel = Parallel.choose(cfg, accelerator)      # resolves distributed.strategy=auto; the room that runs
    model = parallel.shard(model, dtype)               # FSDP: before the optimizer exists
    model, optimizer = parallel.prepare(model, optimizer)    # DDP: distributed.grad_compression's hook too
    loss, sums = parallel.train_window(model, batches, objective, scale, micro_step, saving)

The rooms (room.py: one process; ddp.py, fsdp.py, zero.py, pipeline.py, tensor.py, context.py) hold every
strategy's behaviour; this object chooses one, hands it the loop's questions and owns what every strategy
shares (sums over processes, every rank's state, the process group). Nothing here compares a strategy's name.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.declarations import compression, layout, techniques
from finetune.declarations.splits import CONTEXT, PIPELINE, TENSOR, Split
from finetune.declarations.strategies import of_recipe
from finetune.errors import ConfigError
from finetune.parallel import zero
from finetune.parallel.context import ContextParallel
from finetune.parallel.ddp import DDP
from finetune.parallel.distribute import resolve_strategy, vision_problems
from finetune.parallel.fsdp import FSDP
from finetune.parallel.mesh import build_mesh
from finetune.parallel.pipeline import Pipeline
from finetune.parallel.rank_state import RankState, rng_states
from finetune.parallel.room import Room
from finetune.parallel.split_checks import split_problems, text_config
from finetune.parallel.tensor import TensorParallel

SETUP_TIMEOUT_S = 1800  # collectives' timeout before training starts and after it ends (gloo's default)
# distributed.strategy (as resolve_strategy resolves it for a launch) -> its room.
ROOMS: dict[str, type[Room]] = {room.name: room for room in (Room, DDP, FSDP, zero.Zero)}
# The split strategies' rooms, outermost first: the first a recipe asks runs (a pipeline holds its stages'
# tensor-parallel split, and so does context parallelism; a pipeline with context parallelism splits the rows itself).
SPLIT_ROOMS: tuple[tuple[Split, type[Room]], ...] = ((PIPELINE, Pipeline), (CONTEXT, ContextParallel), (TENSOR, TensorParallel))


def make_accelerator(precision: str, cfg: RecipeConfig | None = None):
    """accelerate's Accelerator for this launch; with DeepSpeed's plugin when the recipe asks for
    distributed.strategy=deepspeed and torchrun started several processes (one process: no ZeRO)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    # accelerate keeps one mixed-precision setting per process and refuses a second Trainer with
    # another; the setting is ours to choose per run (the process group, in PartialState, is kept).
    AcceleratorState._reset_state()
    mixed, cpu = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[precision], not torch.cuda.is_available()
    # Setup (rank 0 tokenizing, models loading) may wait long; from the first step, distributed.timeout_s (faults.py).
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=max(SETUP_TIMEOUT_S, cfg.distributed.timeout_s if cfg else 0)))
    if cfg is not None and of_recipe(cfg).deepspeed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return zero.accelerator_for(cfg, precision, mixed, timeout, cpu)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set for good by an earlier DeepSpeed Accelerator
    return Accelerator(mixed_precision=mixed, cpu=cpu, kwargs_handlers=[timeout])


class Parallel:
    def __init__(self, accelerator, room: Room):
        self.accelerator = accelerator
        self.room = room  # the strategy that runs: every question about it goes there
        self._gloo = None

    @classmethod
    def choose(cls, cfg: RecipeConfig, accelerator) -> Parallel:
        """The strategy for this launch (auto: DDP unless a replica would not fit), checked against the recipe."""
        world = accelerator.num_processes
        grid = layout.Layout.of(cfg, accelerator.process_index, world)
        asked = [room for split, room in SPLIT_ROOMS if split.asked(cfg)]
        config = text_config(cfg) if asked else None  # before any weight loads: config.json alone
        kind = (asked[0] if asked else ROOMS[resolve_strategy(cfg, world, accelerator.device)]).variant(cfg)
        problems = split_problems(cfg, world, config) + kind.problems(cfg, accelerator)  # [] when nothing is split
        problems += vision_problems(cfg, world)
        if problems:
            raise ConfigError(problems)
        # A context-parallel rank streams its own copy of the layers (no DDP wrapper holds them on one device);
        # under FSDP it holds its shards, as any FSDP process does.
        processes = 1 if kind.trains_alone else world
        problems = techniques.problems(
            techniques.launch_settings(cfg, fsdp=kind.wraps_layers, processes=processes), (techniques.LAUNCH,)
        )
        if cfg.distributed.strategy == "auto":
            problems += compression.problems(cfg, kind.name, kind.replicates)
        if problems:
            raise ConfigError(problems)
        mesh = build_mesh(grid, accelerator.device) if asked else None  # every rank, here: a collective
        return cls(accelerator, kind.build(accelerator, cfg, grid, config, mesh))

    # ------------------------------------------------------------------ who and where

    @property
    def strategy(self) -> str:
        """The room's name, as a run's choices.json records it (single, ddp, fsdp, deepspeed, pipeline, ...)."""
        return self.room.name

    @property
    def layout(self) -> layout.Layout:
        return self.room.layout

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
    def updates_in_backward(self) -> bool:
        """The engine steps inside the last micro-batch's backward, before the trainer sees the step's loss: a
        non-finite step is then skipped only by fp16's loss scaler, and the weights after it are not "the last
        good state"."""
        return self.room.updates_in_backward

    def after_nonfinite(self, good_checkpoint) -> str:
        """What became of a non-finite step's update, for the message; good_checkpoint: where the last good
        state was saved (None: on_nonfinite=skip)."""
        if self.updates_in_backward:
            return "DeepSpeed applied its update inside backward (fp16's loss scaler alone skips one)" + (
                "; resume from the last periodic checkpoint" if good_checkpoint is not None else ""
            )
        if good_checkpoint is None:
            return "update skipped"
        return f"the update was not applied. Checkpoint of the last good state: {good_checkpoint}"

    @property
    def sharded(self) -> bool:
        """The weights are partitioned over the processes (FSDP, ZeRO-3): the 4-bit storage must be
        the compute dtype, and every rank must run each forward together."""
        return self.room.sharded

    @property
    def partitions_root(self) -> bool:
        """The LM head's weight is a partition again once the model's forward has run (ZeRO-3): a loss that runs
        the head after the forward (memory.loss=chunked) cannot have it."""
        return self.room.partitions_root

    def describe(self) -> str | None:
        return self.room.describe()

    def placement(self) -> dict[str, Any] | None:
        """What this process loads where (a pipeline stage: its own modules, the rest on the meta device,
        never read), or None: the whole model on load_device."""
        return self.room.placement(self.device)

    def split(self) -> Any:
        """A tensor-parallel rank's reading (model.partial.Split: its share of every split weight, its narrowed
        config), or None."""
        return self.room.split()

    def loaded(self, model) -> None:
        """The model as read, finished by the room (a tensor-parallel rank's shares cut from the whole weights'
        quantization) before the memory techniques move its weights (memory.base_weights streams them)."""
        self.room.loaded(model)

    def load_device(self, streaming: bool) -> torch.device:
        """Where the model is loaded (FSDP and streaming: CPU RAM)."""
        return self.room.load_device(self.device, streaming)

    # ------------------------------------------------------------------ wrapping

    def shard(self, model, compute_dtype: torch.dtype):
        """The model as this process trains it, before the optimizer exists (FSDP's shards, a tensor-parallel
        rank's share of each layer, a pipeline's stages, context parallelism's attention)."""
        return self.room.shard(model, compute_dtype)

    def prepare(self, model, optimizer):
        return self.room.prepare(model, optimizer)

    def unwrap(self, model):
        return self.room.unwrap(model)

    # ------------------------------------------------------------------ the step

    def train_window(self, model, batches: list, objective, scale: float, micro_step, saving) -> tuple[float, dict[str, float]]:
        """The window's micro-batches trained (their summed loss and metric sums, counted where this rank counts the
        window): a pipeline's schedule runs them through the stages at once; otherwise each in turn, the gradients
        synced on the last. micro_step(batch, scale): one micro-batch's forward and backward, its summed loss;
        saving: the activations' context (a pipeline holds it over the whole schedule)."""
        return self.room.train_window(model, batches, objective, scale, micro_step, saving)

    @property
    def holds_whole_model(self) -> bool:
        """Some process holds the whole model, to generate with or score pairs (a pipeline's each hold a stage)."""
        return self.room.holds_whole_model

    def fit_objective(self, trainer_class: Any, base_compute_loss, objective) -> None:
        """Give a room that runs the objective itself (a pipeline's last stage) the objective."""
        self.room.fit_objective(trainer_class, base_compute_loss, objective)

    @property
    def ideal_idle(self) -> float:
        """The schedule's idle share of a window (0 without stages)."""
        return self.room.ideal_idle

    @property
    def window_waited(self) -> float | None:
        """Seconds of the last window this rank waited on the others inside it (a pipeline's; None where untimed)."""
        return self.room.window_waited

    def staged_held_out_sums(self, batches: list[dict[str, torch.Tensor]], rows: int) -> tuple[float, float]:
        """The held-out loss's (sum, count) of this rank's batches, run through a pipeline's stages."""
        return self.room.held_out_sums(batches, rows)

    def stage_times(self) -> list[tuple[float, ...]] | None:
        """Each stage's (busy, whole) seconds in the last window, and None without stages. A collective where there
        are stages: every rank calls it."""
        return self.room.stage_times(self.every_rank)

    @property
    def sums_own_gradients(self) -> bool:
        """A pipeline, tensor or context parallelism: no DDP wrapper, the gradients summed, not averaged (by
        sync_gradients; under cp x FSDP by FSDP's reduce-scatter set to a sum)."""
        return self.room.sums_own_gradients

    def local_part(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What this rank trains of a micro-batch its replica holds: a context-parallel rank its part of each row."""
        return self.room.local_part(batch)

    def row_group(self) -> tuple[Any, int] | None:
        """The group whose ranks train parts of the same rows and its first rank (context parallelism), or None."""
        return self.room.row_group()

    @property
    def counts_window(self) -> bool:
        """Whether this rank's micro-batches count in the window's totals (tokens, targets, loss)."""
        return self.room.counts_window

    @property
    def gradient_scale(self) -> int:
        """What the window's mean loss is multiplied by in backward: the processes' number where the
        strategy averages gradients over them (DDP, FSDP, ZeRO), 1 where they are summed (a split strategy)."""
        return 1 if self.sums_own_gradients else self.world

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """After the window's backward: a split strategy sums its gradients (the others synced inside backward)."""
        self.room.sync_gradients(params)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """The norm of the whole gradient before clipping, and clipping to max_norm."""
        return self.room.clip_grad_norm(params, max_norm)

    def global_sum(self, value: float) -> float:
        return self.global_sums(value)[0]

    def global_sums(self, *values: float) -> list[float]:
        """Each value summed over the processes, in one collective (a step's totals travel together)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.accelerator.reduce(t, reduction="sum").tolist()

    def every_rank(self, *values: float) -> list[tuple[float, ...]]:
        """Each rank's values, in rank order, on every rank (a collective)."""
        if self.world == 1:
            return [tuple(values)]
        t = torch.tensor([values], dtype=torch.float64, device=self.device)
        return [tuple(row) for row in self.accelerator.gather(t).tolist()]

    def eval_rounds(self, n_batches: int, mine: int) -> int:
        """Forwards this rank runs to evaluate its share of n_batches. FSDP gathers weights inside every
        forward, so all ranks must run as many (a replica's: a context-parallel group's ranks run the same ones);
        ranks with fewer batches repeat one and discard it."""
        return math.ceil(n_batches / self.layout.replicas) if self.sharded else mine

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ what a checkpoint needs whole

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """(trainable weights, optimizer state) gathered whole under FSDP, ZeRO and the splits (a collective: every
        rank calls, rank 0 writes); (None, None) when the process holds them whole already."""
        return self.room.full_states(model, optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        """The trained weights whole (a collective), or None: `model` holds them."""
        return self.room.full_weights(model)

    def every_rank_state(self, objective: dict[str, Any] | None = None) -> list[RankState] | None:
        """What each rank holds alone, for a resume that continues each: its generator states (its own dropout
        streams), PowerSGD's state (its own error feedback), its objective's. A collective; rank 0 gets the list."""
        import torch.distributed as dist

        kept = self.room.rank_state()
        mine = RankState(rng_states(), kept, objective or None)
        if self.world == 1:
            return [mine] if objective else None
        states: list[Any] | None = [None] * self.world if self.is_main else None
        dist.gather_object(mine, states, dst=0, group=self._cpu_group(kept is not None))
        return states

    def _cpu_group(self, large: bool):
        """Over NCCL an object gathered passes through GPU memory, and PowerSGD's error feedback is as
        large as the trainable weights, once per rank: it travels in a gloo group, in host RAM."""
        import torch.distributed as dist

        if not large or dist.get_backend() == "gloo":
            return None
        if self._gloo is None:
            self._gloo = dist.new_group(backend="gloo")  # every rank gets here: a checkpoint is a collective
        return self._gloo

    def close(self, all_finished: bool = False) -> None:
        """Destroy the process group (torchrun's one process has one too). all_finished: every rank got through the run."""
        if all_finished and self.world > 1:
            # A rank that tore its group down while a gloo peer still worked, or whose FSDP groups
            # (held by the sharded model) were left to interpreter exit, aborted after a good run
            # ("terminate called without an active exception", SIGABRT; seen in CI with FSDP).
            # So: every rank done, the prepared model and optimizer freed while the interpreter
            # is whole, then the group destroyed. Not after a failure: the barrier would wait
            # on a rank that is gone.
            self.wait()
            self.accelerator.free_memory()
        self.accelerator.state.destroy_process_group()
