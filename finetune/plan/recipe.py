"""A RecipeConfig on a GPU: its model shape, precision, Setup and estimate (`plan_recipe`)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.declarations import objectives
from finetune.declarations.splits import CONTEXT, PIPELINE, SPLITS, TENSOR
from finetune.declarations.strategies import DDP, STRATEGIES, Strategy, of_recipe
from finetune.declarations.techniques import modes
from finetune.gpus import GpuSpec
from finetune.model.load import model_source
from finetune.plan.inputs import RecipeFacts, Setup
from finetune.plan.memory import Estimate, estimate
from finetune.plan.shape import ModelShape, read_model_shape
from finetune.plan.stages import balanced_layers, layout_choices, near_even, plan_setup, row_shares, tensor_rank_shape


def plan_precision(cfg: RecipeConfig, gpu: GpuSpec | None) -> str:
    """The precision the run would use on `gpu` (precision=auto follows hardware.resolve_precision's rule)."""
    if cfg.precision != "auto":
        return cfg.precision
    if gpu is None:
        from finetune.hardware import resolve_precision

        return resolve_precision("auto")
    return "bf16" if gpu.supports_bf16 else "fp16"


def model_shape_of(cfg: RecipeConfig) -> ModelShape:
    return read_model_shape(model_source(cfg), cfg.model.trust_remote_code, cfg.model.revision)


def _shard_bytes(cfg: RecipeConfig) -> int | None:
    """The largest weight file of a local model directory (host RAM while loading), if visible."""
    src = Path(model_source(cfg))
    files = list(src.glob("*.safetensors")) if src.is_dir() else []
    return max((f.stat().st_size for f in files), default=None)


def setup_of(cfg: RecipeConfig, gpus: int = 1) -> Setup:
    objective = objectives.get(cfg.train.objective)
    strategy = of_recipe(cfg)
    zero = strategy.deepspeed  # nvme offloads plan as cpu's on the GPU (host RAM: not counted)
    # grpo's forwards without gradients: the reference with beta > 0, the sampling policy's when a sampling serves 2+ steps
    online_passes = int(bool(cfg.train.beta)) + int(cfg.train.steps_per_generation * cfg.train.num_iterations > 1)
    return Setup(
        # grpo trains num_generations sampled completions of each prompt
        sequences_per_example=cfg.train.num_generations if objective.online else objective.sequences_per_example,
        reference_passes=0
        if cfg.train.precompute_reference
        else online_passes
        if objective.online
        else objective.reference_passes,
        head_in_chunks=objective.head_in_chunks,
        sampled_tokens=cfg.train.max_new_tokens if objective.online else 0,
        iterations=cfg.train.num_iterations if objective.online else 1,
        pp=PIPELINE.size(cfg),
        pipeline_schedule=cfg.distributed.pipeline_schedule,
        virtual_stages=cfg.distributed.virtual_stages if PIPELINE.asked(cfg) else 1,
        tp=TENSOR.size(cfg),
        cp=CONTEXT.size(cfg),
        cp_mode=cfg.distributed.context_parallel_mode,
        sp=cfg.distributed.sequence_parallel,
        vp=cfg.distributed.vocab_parallel,
        pipeline_layers=tuple(cfg.distributed.pipeline_layers) if isinstance(cfg.distributed.pipeline_layers, list) else (),
        batch_size=cfg.train.batch_size,
        grad_accum=cfg.train.grad_accum,
        gpus=gpus,
        seq_len=cfg.data.max_seq_len,
        # auto runs DDP unless a replica does not fit (finetune.parallel.distribute.resolve_strategy).
        sharding=strategy.name if gpus > 1 else DDP.name,
        cpu_offload=gpus > 1 and (cfg.distributed.cpu_offload or (zero and cfg.distributed.offload_params != "none")),
        **modes(cfg.memory)
        | {
            "optimizer_offload": cfg.memory.optimizer_offload
            or (zero and gpus > 1 and cfg.distributed.offload_optimizer != "none")
        },
    )


def planning_inputs(cfg: RecipeConfig, gpu: GpuSpec | None) -> tuple[ModelShape, RecipeFacts, dict[str, Any]]:
    """(model shape, recipe inputs, estimate()'s keyword arguments) of a recipe on `gpu`."""
    kw: dict[str, Any] = dict(
        keep_checkpoints=cfg.checkpoint.keep_last or 1,
        model_on_disk=Path(model_source(cfg)).is_dir(),
        shard_bytes=_shard_bytes(cfg),
    )
    shape = model_shape_of(cfg)
    recipe = RecipeFacts.from_config(cfg, plan_precision(cfg, gpu), on_gpu=gpu is not None, varlen_ok=shape.varlen_ok)
    return shape, recipe, kw


def plan_recipe(cfg: RecipeConfig, gpu: GpuSpec | None, gpus: int = 1, setup: Setup | None = None) -> Estimate:
    """The plan of a recipe on `gpus` GPUs (fewer than its pipeline, tensor- or context-parallel ranks: one replica
    of them), or of `setup` when given."""
    shape, recipe, kw = planning_inputs(cfg, gpu)
    if setup is None:
        ranks = replica_ranks(cfg)
        setup = setup_of(cfg, gpus if gpus >= ranks else ranks)
        if setup.pp > 1 and cfg.distributed.pipeline_layers == "auto":
            setup = replace(setup, pipeline_layers=balanced_layers(shape, recipe, setup, gpu, **kw))
    e = _watchdog_note(plan_setup(shape, recipe, setup, gpu, **kw), cfg, max(gpus, replica_ranks(cfg)))
    if objectives.get(cfg.train.objective).online:
        e = replace(e, notes=[*e.notes, ONLINE_NOTE])
    return e


ONLINE_NOTE = (
    "grpo: every completion planned at train.max_new_tokens after the longest prompt data.max_seq_len leaves room "
    "for (sampling's KV cache and decoding, the training forward's logits): upper bounds, completions that end early "
    "are shorter. Not planned: the logits' copies a temperature or top_p other than 1 adds, and the kernel launches "
    "of each decoded token (on a small model they, not memory bandwidth, set the sampling's pace)"
)


def _watchdog_note(e: Estimate, cfg: RecipeConfig, processes: int) -> Estimate:
    """Say when a step would outlast distributed.timeout_s: several processes' watchdog would end a healthy job."""
    limit = cfg.distributed.timeout_s
    if processes <= 1 or not e.step_time_s or e.step_time_s <= limit:
        return e
    note = (
        f"a step (~{e.step_time_s:.0f} s) outlasts distributed.timeout_s ({limit}): the host watchdog ends the job "
        f"after timeout_s + 20 s; set distributed.timeout_s={10 * math.ceil(1.5 * e.step_time_s / 10)}"
    )
    return replace(e, notes=[*e.notes, note])


def replica_ranks(cfg: RecipeConfig) -> int:
    """The GPUs one replica of the recipe spans: its pipeline stages x tensor- x context-parallel ranks."""
    return math.prod(split.size(cfg) for split in SPLITS)


# `finetune plan --gpus N`: the recipe under each way of spreading it over the GPUs, side by side:
# every strategy's `compared` rows (label, Setup fields), in the order declarations/strategies.py declares them.
COMPARED: tuple[tuple[str, Strategy, dict[str, Any]], ...] = tuple(
    (label, strategy, {"sharding": strategy.name, **fields})
    for strategy in STRATEGIES.values()
    for label, fields in strategy.compared
)
# memory.embeddings=cpu is for one process or DDP (finetune/declarations/techniques.py): the sharded rows place the tables on the GPUs.
SHARDED_TABLES = {"embeddings": "device"}


def compare_strategies(cfg: RecipeConfig, gpu: GpuSpec | None, gpus: int) -> list[tuple[str, Estimate]]:
    """(label, estimate) of the recipe under each of COMPARED on `gpus` GPUs; memory.* modes as written.
    A pipelined recipe's own layout comes first, the others as they would run without it, then the other
    pipeline and tensor-parallel layouts of these GPUs."""
    base = replace(setup_of(cfg, gpus), pp=1, virtual_stages=1, tp=1, cp=1)
    ddp_offload = {"optimizer_offload": cfg.memory.optimizer_offload}  # the recipe's own HostAdamW, one replica each
    pp, tp, cp, mode = PIPELINE.size(cfg), TENSOR.size(cfg), CONTEXT.size(cfg), cfg.distributed.context_parallel_mode
    # The recipe's own split layout, one row: its dimensions outermost first (a composition names each).
    grid = [
        label
        for n, label in (
            (pp, f"pipeline {pp} stages"),
            (cp, f"context parallel {cp} ranks, {mode}"),
            (tp, f"tensor parallel {tp} ranks"),
        )
        if n > 1
    ]
    own = [(f"{' x '.join(grid)} (as written)", plan_recipe(cfg, gpu, gpus))] if grid and gpus % (pp * tp * cp) == 0 else []
    return (
        own
        + [
            (
                label,
                plan_recipe(
                    cfg, gpu, gpus, setup=replace(base, **{**(ddp_offload if strategy.replicates else SHARDED_TABLES), **knobs})
                ),
            )
            for label, strategy, knobs in COMPARED
        ]
        + _layouts(cfg, gpu, gpus, base)
    )


def _layouts(cfg: RecipeConfig, gpu: GpuSpec | None, gpus: int, base: Setup) -> list[tuple[str, Estimate]]:
    """(label, estimate) of every pipeline and tensor-parallel layout of `gpus` GPUs the recipe and model can run
    (plan/stages.layout_choices) but the recipe's own: even stages, 1F1B (GPipe with fewer micro-batches than
    stages), the layers on the GPUs (a split's tables too), the recipe's batch per replica."""
    shape, recipe, kw = planning_inputs(cfg, gpu)
    own = (PIPELINE.size(cfg), TENSOR.size(cfg))
    rows = []
    for pp, tp in layout_choices(cfg, shape, gpus, plan_precision(cfg, gpu)):
        if gpus % (pp * tp) or (pp, tp) == own:
            continue
        kept: dict[str, Any] = {"embeddings": "device", "optimizer_offload": False} if tp > 1 else {}
        setup = replace(
            base,
            pp=pp,
            tp=tp,
            pipeline_schedule="1f1b" if base.grad_accum >= pp else "gpipe",
            pipeline_layers=near_even(shape.layers, pp),  # stages that cannot hold equal layers: the first one fewer
            sharding=DDP.name,
            cpu_offload=False,
            base_weights="device",
            **kept,
        )
        replicas = gpus // (pp * tp)
        parts = ([f"pipeline {pp} stages"] if pp > 1 else []) + ([f"{tp} tensor-parallel ranks"] if tp > 1 else [])
        many = f" x {replicas} replicas" if replicas > 1 else ""
        rows.append((" x ".join(parts) + many, plan_setup(shape, recipe, setup, gpu, **kw)))
    return rows


# The parts of an estimate that are weights: what loading a model for inference puts on its device.
WEIGHT_COMPONENTS = ("weights_quantized", "quant_constants", "weights_unquantized", "lora_weights")


def loaded_weight_bytes(cfg: RecipeConfig, precision: str, tp: int = 1) -> int:
    """Bytes of the model's weights when the whole model (a tensor-parallel rank: its share of every decoder linear,
    the tables whole or, under vocab_parallel where tp divides the vocabulary, its rows of them) is loaded on one
    device in `precision`: quantized per quant.bits, the LoRA adapter included. The recipe's training memory modes
    (base_weights=cpu|disk, FSDP) do not apply: generate, eval and export load every layer onto the device, and so
    does a streaming run that keeps layers there (trainer/build.py)."""
    setup = Setup(batch_size=1, grad_accum=1, seq_len=cfg.data.max_seq_len, fp32_absmax=row_shares(tp))
    shape = model_shape_of(cfg)
    rows = cfg.distributed.vocab_parallel and shape.vocab % tp == 0  # its rows of the tables (tensor.reads_vocab_rows)
    rank = tensor_rank_shape(shape, tp, vocab=rows) if tp > 1 else shape
    e = estimate(rank, RecipeFacts.from_config(cfg, precision), setup, None)
    return sum(e.component(key) for key in WEIGHT_COMPONENTS)
