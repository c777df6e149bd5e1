"""One object for how a run is spread over processes: single, DDP, FSDP or DeepSpeed ZeRO.

    parallel = Parallel.choose(cfg, accelerator)      # resolves distributed.strategy=auto
    model = parallel.shard(model, cfg, dtype)          # FSDP: before the optimizer exists
    model, optimizer = parallel.prepare(model, optimizer)    # DDP: distributed.grad_compression's hook too
    with parallel.gradient_sync(model, last_micro_batch):
        accelerator.backward(loss)       # DeepSpeed: the last micro-batch's backward also steps the engine

Every strategy branch of the trainer lives here; the loop asks, never checks names.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError
from finetune.hardware import release_free_heap
from finetune.memory import techniques
from finetune.model.load import head_owner, model_source
from finetune.model.partial import Split
from finetune.parallel import compression, ddp_hooks, layout, zero_config
from finetune.parallel.context import ContextParallel
from finetune.parallel.context import runtime_problems as context_runtime_problems
from finetune.parallel.distribute import (
    check_strategy,
    full_optimizer_state,
    full_trainable_state,
    place_sharded,
    resolve_strategy,
    shard_model,
    zero_full_optimizer_state,
    zero_full_weights,
    zero_optimizer,
)
from finetune.parallel.grads import sum_over
from finetune.parallel.pipeline import Pipeline, balanced_layers, stage_placement
from finetune.parallel.rank_state import RankState, rng_states
from finetune.parallel.split_checks import split_problems, text_config
from finetune.parallel.tensor import TensorParallel, draw_lora_as_one_process, narrowed, split_dim

SETUP_TIMEOUT_S = 1800  # collectives' timeout before training starts and after it ends (gloo's default)


def make_accelerator(precision: str, cfg: RecipeConfig | None = None):
    """accelerate's Accelerator for this launch; with DeepSpeed's plugin when the recipe asks for
    distributed.strategy=deepspeed and torchrun started several processes (one process: no ZeRO)."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    # accelerate keeps one mixed-precision setting per process and refuses a second Trainer with
    # another; the setting is ours to choose per run (the process group, in PartialState, is kept).
    AcceleratorState._reset_state()
    mixed, cpu = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[precision], not torch.cuda.is_available()
    # Setup (rank 0 tokenizing, models loading) may wait long; from the first step, distributed.timeout_s (faults.py).
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=max(SETUP_TIMEOUT_S, cfg.distributed.timeout_s if cfg else 0)))
    if cfg is None or cfg.distributed.strategy != "deepspeed" or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set for good by an earlier DeepSpeed Accelerator
        return Accelerator(mixed_precision=mixed, cpu=cpu, kwargs_handlers=[timeout])
    zero_config.require()
    from accelerate.utils import DeepSpeedPlugin

    if cpu:
        # accelerate turns DeepSpeed off for cpu=True, and without it finds no backend on a machine
        # with no GPU: the process group is made for CPUs first (gloo, torchrun's ranks), and
        # DeepSpeed (its CPU accelerator) runs on it.
        PartialState(cpu=True, **timeout.to_kwargs())
    plugin = DeepSpeedPlugin(hf_ds_config=zero_config.ds_config(cfg, precision, on_gpu=not cpu), zero3_init_flag=False)
    accelerator = Accelerator(mixed_precision=mixed, deepspeed_plugin=plugin, kwargs_handlers=[timeout])
    # accelerate tells transformers about ZeRO-3 at once, and from_pretrained then refuses the
    # device_map our loader places the model with: the weights load whole, and ZeRO-3 partitions
    # them when the engine is built (Parallel.prepare tells transformers again).
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return accelerator


class Parallel:
    def __init__(self, accelerator, strategy: str, cfg: RecipeConfig):
        self.accelerator = accelerator
        self.strategy = strategy  # single | ddp | fsdp | deepspeed | pipeline | tensor | context
        self.cfg = cfg
        self.powersgd: ddp_hooks.PowerSGD | None = None  # its state goes into every checkpoint, per rank
        self._gloo = None
        self._zero_groups: list[list[torch.nn.Parameter]] = []  # deepspeed: the optimizer's parameters, as built
        self.layout = layout.Layout.of(cfg, accelerator.process_index, accelerator.num_processes)
        self.pipeline: Pipeline | None = None  # distributed.pipeline_parallel > 1: built by shard()
        self.tensor: TensorParallel | None = None  # distributed.tensor_parallel > 1: built by shard()
        self.context: ContextParallel | None = None  # distributed.context_parallel > 1: built by choose()
        self.full_config: Any = None  # a tensor-parallel rank's model config, narrowed by split()
        self.model_config: Any = None  # a pipeline's model (text) config, read by choose() before loading

    @classmethod
    def choose(cls, cfg: RecipeConfig, accelerator) -> Parallel:
        """The strategy for this launch (auto: DDP unless a replica would not fit), checked against the recipe."""
        world, config = accelerator.num_processes, None
        split = cfg.distributed.tensor_parallel > 1
        context = cfg.distributed.context_parallel > 1
        if cfg.distributed.pipeline_parallel > 1 or split or context:  # before any weight loads: config.json alone
            config = text_config(cfg)
            problems = split_problems(cfg, world, config) + context_runtime_problems(cfg, accelerator.device)
            if problems:
                raise ConfigError(problems)
            # pipeline: split stages too; context: each rank a whole replica of its own, its gradients summed by hand
            strategy = "pipeline" if cfg.distributed.pipeline_parallel > 1 else "context" if context else "tensor"
        else:
            strategy = resolve_strategy(cfg, world, accelerator.device)
        check_strategy(cfg, strategy, world)
        # A context-parallel rank streams its own copy of the layers (no DDP wrapper holds them on one device).
        processes = 1 if context else accelerator.num_processes
        problems = techniques.problems(
            techniques.launch_settings(cfg, fsdp=strategy == "fsdp", processes=processes),
            (techniques.LAUNCH,),
        )
        if cfg.distributed.strategy == "auto":
            problems += compression.problems(cfg, strategy)
        if strategy == "deepspeed" and accelerator.distributed_type != "DEEPSPEED":
            problems.append(  # make_accelerator builds DeepSpeed's accelerator from the recipe: a given one lacks it
                "distributed.strategy=deepspeed needs the accelerator built with the recipe (finetune.parallel.runtime."
                f"make_accelerator(precision, cfg)); this one runs {accelerator.distributed_type}."
            )
        if problems:
            raise ConfigError(problems)
        chosen = cls(accelerator, strategy, cfg)
        chosen.model_config = config
        if context:
            chosen.context = ContextParallel(chosen.layout, cfg.distributed.context_parallel_mode)
        if strategy == "pipeline" and cfg.distributed.pipeline_layers == "auto":
            chosen.layout = replace(chosen.layout, splits=balanced_layers(cfg, world, accelerator.device))
        return chosen

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
    def fsdp(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def updates_in_backward(self) -> bool:
        """DeepSpeed's engine steps inside the last micro-batch's backward, before the trainer sees the
        step's loss: a non-finite step is then skipped only by fp16's loss scaler, and the weights
        after it are not "the last good state"."""
        return self.strategy == "deepspeed"

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
        return self.fsdp or (self.strategy == "deepspeed" and self.cfg.distributed.zero_stage == 3)

    def describe(self) -> str | None:
        method = self.cfg.distributed.grad_compression
        if self.strategy == "single":
            if self.cfg.distributed.strategy == "deepspeed":
                return "distributed.strategy=deepspeed: one process, trained without DeepSpeed (ZeRO partitions over processes)"
            if method == "none":
                return None
            return f"distributed.grad_compression={method} has no effect: one process has no gradients to all-reduce"
        if self.pipeline is not None:
            return f"parallel: {self.pipeline.describe()}"
        if self.context is not None:
            return f"parallel: {self.context.describe(self.layout.replicas)}"
        if self.tensor is not None:
            many = f"{self.layout.replicas} replica{'s' if self.layout.replicas > 1 else ''}"
            return f"parallel: tensor parallel, each decoder layer split over {self.layout.tp} processes x {many}"
        where = f"parallel: {self.strategy} over {self.world} processes"
        if self.strategy == "deepspeed":
            return f"{where} ({zero_config.describe(self.cfg)})"
        return where if method == "none" else f"{where}, {compression.describe(self.cfg)}"

    def placement(self) -> dict[str, Any] | None:
        """What this process loads where (a pipeline stage: its own modules, the rest on the meta device,
        never read), or None: the whole model on load_device."""
        config = self.model_config
        if not self.layout.pipelined or config is None:
            return None
        tied = bool(getattr(config, "tie_word_embeddings", False))
        return stage_placement(self.layout, config.num_hidden_layers, tied, self.device)

    def split(self) -> Split | None:
        """A tensor-parallel rank's reading: its share of every split weight, its narrowed config; or None."""
        if self.layout.tp <= 1:
            return None
        from transformers import AutoConfig

        whole = AutoConfig.from_pretrained(
            model_source(self.cfg), revision=self.cfg.model.revision, trust_remote_code=self.cfg.model.trust_remote_code
        )
        return Split(split_dim, self.layout.tp_rank, self.layout.tp, narrowed(whole, self.layout.tp))

    def load_device(self, streaming: bool) -> torch.device:
        """Where the model is loaded. FSDP loads into CPU RAM and moves only this rank's shard to the
        GPU, and streaming keeps the decoder layers there: a whole 4-bit 70B model (~37 GB) would not
        fit one 24 GB card even for a moment."""
        return torch.device("cpu") if self.fsdp or streaming else self.device

    # ------------------------------------------------------------------ wrapping

    def shard(self, model, cfg: RecipeConfig, compute_dtype: torch.dtype):
        """FSDP: shard the model before the optimizer exists (its state is then sharded too). Tensor
        parallelism: this rank's share of each layer; a pipeline: this rank's stages (of its shares)."""
        split = [
            f"distributed.{k}={v}"
            for k, v in (("pipeline_parallel", self.layout.pp), ("tensor_parallel", self.layout.tp))
            if v > 1
        ]
        if split and compute_dtype == torch.float16:  # precision=auto chose fp16 (a GPU without bf16)
            raise ConfigError(
                [
                    f"{' x '.join(split)} with fp16: each rank's GradScaler would decide alone whether a step is skipped "
                    "(from its own part of the gradients). Set precision=fp32."
                ]
            )
        if self.layout.tp > 1:
            self._split_layers(model, cfg)
        if self.context is not None:
            self.context.attach(model)
        if self.strategy == "pipeline":
            owner: Any = head_owner(model)
            if owner is not None:  # a model given in memory (Trainer.from_parts) is checked here
                text = owner.config.get_text_config()
                problems = layout.launch_problems(cfg, self.world, text.num_hidden_layers, text.model_type)
                if problems:
                    raise ConfigError(problems)
            self.pipeline = Pipeline(model, self.layout, cfg, self.device)
            self.pipeline.tensor = self.tensor
        if not self.fsdp:
            return model
        shard_model(model, cfg, compute_dtype)
        place_sharded(model, self.device, keep_params_on_cpu=cfg.distributed.cpu_offload)
        release_free_heap()  # the whole model each process loaded, now that it keeps only its shards
        return model

    def _split_layers(self, model, cfg: RecipeConfig) -> None:
        """Tensor parallelism: this rank's share of each layer (loaded split), its LoRA drawn as one process's."""
        narrow = self.layout.tp
        config = model.config.get_text_config()
        if config.num_attention_heads * narrow != getattr(self.model_config, "num_attention_heads", None):
            raise ConfigError(
                [
                    f"distributed.tensor_parallel={narrow}: the model was not loaded split (a model given in memory "
                    "holds every head); let the trainer load it from model.path, or set distributed.tensor_parallel=1"
                ]
            )
        self.tensor = TensorParallel(model, self.layout, self.device)
        draw_lora_as_one_process(model, self.tensor, cfg.seed)
        model.finetune_local_slice = self.tensor.local  # a checkpoint's whole tensors, sliced

    def prepare(self, model, optimizer):
        """accelerate's wrappers: DDP for the model (not for FSDP, which prepare() would wrap in DDP),
        with distributed.grad_compression's communication hook. (accelerate's own comm_hook option
        keeps PowerSGD's state where a checkpoint cannot reach it, and refuses bf16 on gloo.)"""
        if self.fsdp or self.sums_own_gradients:
            return model, self.accelerator.prepare(optimizer)
        if self.strategy == "deepspeed":
            # ZeRO replaces the optimizer's parameters with flat partitions: its state is read and
            # written per parameter through these (distributed.zero_full_optimizer_state).
            self._zero_groups = [list(g["params"]) for g in optimizer.param_groups]
            self.accelerator.state.deepspeed_plugin.set_deepspeed_weakref()  # transformers: ZeRO-3 from now on
            zero_config.fill_sizes(self.accelerator.state.deepspeed_plugin, model)
            model, optimizer = self.accelerator.prepare(model, optimizer)
            zero_optimizer(optimizer).finetune_param_groups = self._zero_groups  # for checkpoint.load_checkpoint
            return model, optimizer
        model, optimizer = self.accelerator.prepare(model, optimizer)
        if self.strategy == "ddp":
            self.powersgd = ddp_hooks.register(model, self.cfg)
        return model, optimizer

    def unwrap(self, model):
        if self.strategy == "deepspeed":
            return self.accelerator.unwrap_model(model)
        # Not accelerate's unwrap_model: it imports deepspeed whenever it is installed (a warning line in every
        # run). DDP's wrapper is the only one the other strategies put around a model (FSDP2 shards in place).
        return model.module if isinstance(model, DistributedDataParallel) else model

    # ------------------------------------------------------------------ the step

    def gradient_sync(self, model, last: bool):
        """Only the last micro-batch of the window all-reduces (DDP) or reduce-scatters (FSDP) gradients.
        DeepSpeed: accelerate's sync_gradients marks the engine's accumulation boundary, where its
        backward steps (clipping, the update, zeroed gradients; optimizer.step() is then a no-op)."""
        if self.fsdp:
            model.set_requires_gradient_sync(last)
            return nullcontext()
        if self.strategy == "deepspeed":
            self.accelerator.gradient_state._set_sync_gradients(last)
            return nullcontext()
        return self.accelerator.no_sync(model) if not last else nullcontext()

    def train_window(self, model, batches: list, objective, scale: float, micro_step, saving) -> tuple[float, dict[str, float]]:
        """The window's micro-batches trained (their summed loss and metric sums, counted where this rank counts the
        window): a pipeline's schedule runs them through the stages at once; otherwise each in turn, the gradients
        synced on the last. micro_step(batch, scale): one micro-batch's forward and backward, its summed loss;
        saving: the activations' context (a pipeline holds it over the whole schedule)."""
        if self.pipeline is not None:
            with saving(), self.accelerator.autocast():  # no prepared model to cast
                return self.pipeline.train_window(batches, objective, scale)
        loss_sum, sums, counts = (
            0.0,
            dict[str, float](),
            self.counts_window,
        )  # a tensor-parallel group computed one loss: one reports it
        for i, batch in enumerate(batches):
            with self.gradient_sync(model, last=i == len(batches) - 1):
                loss_sum += float(micro_step(batch, scale)) * counts
            for key, value in objective.metric_sums().items():  # every rank the same keys: summed together
                sums[key] = sums.get(key, 0.0) + value * counts
        return loss_sum, sums

    @property
    def holds_whole_model(self) -> bool:
        """Some process holds the whole model, to generate with or score pairs (a pipeline's each hold a stage)."""
        return self.pipeline is None

    def fit_objective(self, trainer_class: Any, base_compute_loss, objective) -> None:
        """Give a pipeline the objective its last stage runs (the others run a Trainer's compute_loss)."""
        if self.pipeline is not None:
            self.pipeline.fit_objective(trainer_class, base_compute_loss, objective, self.is_main)

    @property
    def ideal_idle(self) -> float:
        """The pipeline schedule's idle share of a window (0 without stages)."""
        return self.pipeline.ideal_idle if self.pipeline is not None else 0.0

    def staged_held_out_sums(self, batches: list[dict[str, torch.Tensor]], rows: int) -> tuple[float, float]:
        """The held-out loss's (sum, count) of this rank's batches, run through a pipeline's stages."""
        assert self.pipeline is not None, "only a pipeline's processes hold no whole model"
        return self.pipeline.held_out_sums(batches, rows)

    def stage_times(self) -> list[tuple[float, ...]] | None:
        """Each stage's (busy, whole) seconds in the last window, of replica 0's pipeline (tensor-parallel rank 0's),
        and None without stages. A collective where there are stages: every rank calls it."""
        if self.pipeline is None:
            return None
        every = self.every_rank(*self.pipeline.clock.last)
        return [every[r] for r in self.layout.pipeline_ranks(0, 0)]

    @property
    def sums_own_gradients(self) -> bool:
        """A pipeline, tensor or context parallelism: no DDP wrapper, the gradients summed by sync_gradients."""
        return self.pipeline is not None or self.tensor is not None or self.context is not None

    def local_part(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What this rank trains of a micro-batch its replica holds: a context-parallel rank its part of each row."""
        return self.context.part(batch) if self.context is not None else batch

    @property
    def counts_window(self) -> bool:
        """Whether this rank's micro-batches count in the window's totals (tokens, targets, loss). A
        pipeline's stages all hold their replica's window: its last stage counts it, once."""
        if self.pipeline is not None:
            return self.pipeline.reports
        return self.layout.tp_rank == 0  # a tensor-parallel group's ranks hold one window: its first counts it

    @property
    def gradient_scale(self) -> int:
        """What the window's mean loss is multiplied by in backward: the processes' number where the
        strategy averages gradients over them (DDP, FSDP, ZeRO), 1 where they are summed (a pipeline)."""
        return 1 if self.sums_own_gradients else self.world

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """After the window's backward: a pipeline sums each stage's gradients over its replicas (the other
        strategies synced theirs inside backward)."""
        if self.pipeline is not None:  # a split stage's group sums first, inside
            self.pipeline.sum_gradients(params)
        elif self.tensor is not None:
            self.tensor.sum_gradients(params)
        elif self.context is not None:  # every rank's gradient is of its own part of the rows (and replicas')
            sum_over(params, None)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """The norm of the whole gradient before clipping, and clipping to max_norm. A pipeline's stages each
        hold a part: the norm is summed over them."""
        split = self.pipeline or self.tensor
        if split is None:
            return float(self.accelerator.clip_grad_norm_(params, max_norm))
        self.accelerator.unscale_gradients()  # fp16: the GradScaler's factor out first, as accelerate does
        return split.clip_grad_norm(params, max_norm)

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
        forward, so all ranks must run as many; ranks with fewer batches repeat one and discard it."""
        return math.ceil(n_batches / self.world) if self.sharded else mine

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ what a checkpoint needs whole

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """(trainable weights, optimizer state) gathered whole under FSDP and ZeRO (a collective: every
        rank calls, rank 0 writes); (None, None) when the process holds them whole already."""
        if self.strategy == "deepspeed":
            return zero_full_weights(self.unwrap(model)), zero_full_optimizer_state(zero_optimizer(optimizer), self._zero_groups)
        split = self.pipeline or self.tensor
        if split is not None:
            unwrapped = self.unwrap(model)
            return split.whole_trainable_state(unwrapped), split.whole_optimizer_state(unwrapped, optimizer)
        if not self.fsdp:
            return None, None
        return full_trainable_state(model), full_optimizer_state(optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        """The trained weights whole (FSDP, ZeRO: a collective), or None: `model` holds them."""
        if self.strategy == "deepspeed":
            return zero_full_weights(model)
        split = self.pipeline or self.tensor
        if split is not None:
            return split.whole_trainable_state(model)
        return full_trainable_state(model) if self.fsdp else None

    def every_rank_state(self, objective: dict[str, Any] | None = None) -> list[RankState] | None:
        """What each rank holds alone, for a resume that continues each: its generator states (its own dropout
        streams), PowerSGD's state (its own error feedback), its objective's. A collective; rank 0 gets the list."""
        import torch.distributed as dist

        mine = RankState(rng_states(), self.powersgd.state_dict() if self.powersgd else None, objective or None)
        if self.world == 1:
            return [mine] if objective else None
        states: list[Any] | None = [None] * self.world if self.is_main else None
        dist.gather_object(mine, states, dst=0, group=self._cpu_group())
        return states

    def _cpu_group(self):
        """Over NCCL an object gathered passes through GPU memory, and PowerSGD's error feedback is as
        large as the trainable weights, once per rank: it travels in a gloo group, in host RAM."""
        import torch.distributed as dist

        if self.powersgd is None or dist.get_backend() == "gloo":
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
