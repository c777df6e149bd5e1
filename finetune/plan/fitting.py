"""The search: every runnable setup the knobs allow, estimated; the fastest that fits (`fit`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.declarations import techniques
from finetune.declarations.splits import trained_tables
from finetune.declarations.strategies import DDP, STRATEGIES
from finetune.declarations.techniques import TECHNIQUES, Technique
from finetune.errors import PlanError
from finetune.gpus import GiB, GpuSpec
from finetune.plan.context import context_choices
from finetune.plan.inputs import RecipeFacts, Setup, describe_setup
from finetune.plan.memory import Estimate, gib
from finetune.plan.recipe import plan_precision, plan_recipe, planning_inputs, replica_ranks, setup_of
from finetune.plan.shape import ModelShape
from finetune.plan.stages import balanced_layers, layout_choices, near_even, plan_setup

FIT_HEADROOM = 0.10  # --fit keeps 10% of the card free: the model's error on published runs reaches ~15%


@dataclass(frozen=True)
class Knob:
    """One thing the search may change. `recipe_key` is the recipe key it writes (None: the launch command)."""

    name: str  # a Setup field
    recipe_key: str | None
    candidates: Callable[[Setup, int], list[Any]]  # (the recipe's setup, max GPUs) -> values to try


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _technique_knob(t: Technique) -> Knob:
    choices = t.fit or (lambda s: [getattr(s, t.field)])
    return Knob(t.field, t.keys[0], lambda s, _: choices(s))


# The search keeps the fastest setup that fits; every offload technique costs time on the host link
# (step_time), so it wins only when nothing faster fits, and an exact tie goes to the setup with
# the lower Setup.offload_rank. base_weights=disk frees the same GPU memory as cpu, no faster,
# so it is chosen only when the host RAM (search's host_ram) cannot pin the weights.
SEARCHED = [s.name for s in STRATEGIES.values() if s.searched]  # the strategies --fit tries (ddp, fsdp)
_TECHNIQUE_KNOBS = [_technique_knob(t) for t in TECHNIQUES if t.fit]
assert _TECHNIQUE_KNOBS[0].name == "checkpoint_every"
KNOBS: list[Knob] = [
    Knob("gpus", None, lambda s, max_gpus: list(range(1, max_gpus + 1))),
    # FSDP only means something on more than one GPU; candidates() drops fsdp x 1 GPU.
    Knob("sharding", "distributed.strategy", lambda s, max_gpus: SEARCHED if max_gpus > 1 else [s.sharding]),
    Knob("cpu_offload", "distributed.cpu_offload", lambda s, max_gpus: [False, True] if max_gpus > 1 else [s.cpu_offload]),
    # Every memory technique that declares its --fit choices (finetune/declarations/techniques.py), the batch
    # after activation checkpointing: the order the search has always met (and broken ties in).
    _TECHNIQUE_KNOBS[0],
    Knob("batch_size", "train.batch_size", lambda s, _: _divisors(s.global_batch)),
    *_TECHNIQUE_KNOBS[1:],
]


def mode_settings(s: Setup, recipe: RecipeFacts | None = None) -> techniques.Settings:
    """A setup as finetune/declarations/techniques.py's rules read it (recipe None: a 4-bit LoRA recipe)."""
    # A context-parallel rank streams its own copy of the layers, as one process does, or holds FSDP's shards
    # (parallel/runtime.py).
    processes = 1 if s.cp > 1 and not s.strategy.wraps_layers else s.gpus
    settings = techniques.Settings(
        **techniques.modes(s), fsdp=s.strategy.wraps_layers and s.gpus > 1, cpu_offload=s.cpu_offload, processes=processes
    )
    if recipe is None:
        return settings
    return replace(settings, quant_bits=recipe.quant_bits, lora=recipe.lora, compile=recipe.compiled)


def runnable(s: Setup, recipe: RecipeFacts | None = None) -> bool:
    """Whether the trainer runs this combination: no rule of finetune/declarations/techniques.py's table refuses it.
    A sharding strategy on one GPU is left out too: it runs as one process, the same setup as DDP's."""
    if s.gpus == 1 and not s.strategy.replicates:
        return False
    return not techniques.problems(mode_settings(s, recipe))


def candidates(
    base: Setup,
    max_gpus: int,
    recipe: RecipeFacts | None = None,
    layouts: tuple[tuple[int, int], ...] = (),
    contexts: tuple[int, ...] = (),
    layers: int = 0,
) -> list[Setup]:
    """Every runnable setup the knobs allow that keeps the global batch (batch x accum x replicas): one replica
    per GPU (DDP, FSDP, ZeRO), each of `layouts` (pipeline stages, tensor-parallel ranks), of `contexts`
    (context-parallel ranks) and of their compositions (cp x tp, cp x pp, cp x pp x tp), on the GPUs that hold a whole
    number of its replicas. layers: the model's decoder layers (0: unknown), for pipelines whose stages cannot hold
    equal counts (uneven splits) and interleaved ones (2 virtual stages a rank)."""
    out = []
    names = [k.name for k in KNOBS]
    one = replace(base, pp=1, tp=1, virtual_stages=1, pipeline_layers=(), cp=1)
    grids = (
        (1, 1, 1),
        *((pp, tp, 1) for pp, tp in layouts),
        *((1, 1, cp) for cp in contexts),
        # a part of each sequence on each share, or stage (cp x pp: sft only, declarations/splits.py: one row a sequence)
        *((pp, tp, cp) for pp, tp in layouts for cp in contexts if pp == 1 or base.sequences_per_example == 1),
    )
    tables_train = recipe is not None and bool(trained_tables(recipe.lora_target))  # vocab_parallel refuses them
    if one.pipeline_schedule == "interleaved_1f1b":
        one = replace(one, pipeline_schedule="1f1b")  # interleaving needs virtual stages: not a pipeline's setting here
    for values in product(*(k.candidates(base, max_gpus) for k in KNOBS)):
        s = replace(one, **dict(zip(names, values)))
        # checked as each layout runs it: a context-parallel rank may stream its own layers (mode_settings)
        ok = {cp: runnable(replace(s, cp=cp), recipe) for cp in {g[2] for g in grids}}
        for pp, tp, cp in grids:
            if not ok[cp]:
                continue
            laid = _laid_out(s, base, pp, tp, cp, tables_train=tables_train, layers=layers)
            if laid is not None:
                out += [laid, *filter(None, [_interleaved(laid, layers)])]
    return out


def _laid_out(s: Setup, base: Setup, pp: int, tp: int, cp: int = 1, tables_train: bool = False, layers: int = 0) -> Setup | None:
    """`s` as `pp` stages x `tp` tensor-parallel ranks x `cp` context-parallel ranks x replicas, with the
    accumulation that keeps base's global batch and a schedule that runs it; None where it cannot run so (a
    layout keeps its layers and tables on its GPUs and sums its own gradients: DDP's row only, nothing streamed
    or sharded; but context parallelism also under FSDP)."""
    if s.gpus % (pp * tp * cp):
        return None
    sharded_parts = cp > 1 and pp == tp == 1 and s.strategy.wraps_layers  # cp x FSDP: FSDP's own rules (runnable)
    if (pp, tp, cp) != (1, 1, 1) and not sharded_parts:
        own_copy = s.base_weights == "cpu" and pp == 1  # a context-parallel rank streams its own copy, a tensor one its share
        kept = (s.base_weights == "device" or own_copy) and not (tp > 1 and (s.optimizer_offload or s.embeddings != "device"))
        if not (kept and s.sharding == DDP.name and not s.cpu_offload):
            return None
    per_replica = base.global_batch / (s.batch_size * s.gpus // (pp * tp * cp))
    if per_replica < 1 or per_replica != int(per_replica):
        return None
    m = int(per_replica)
    own = base.pipeline_layers if pp == base.pp else near_even(layers, pp)  # the recipe's split (auto: as balanced)
    # Sequence and vocabulary parallelism wherever they run (tensor parallelism with or without context parallelism;
    # vp: the loss in chunks; neither with sampling): less memory, the same traffic (sp), two all-reduces of a chunk's
    # positions (vp).
    sp = tp > 1 and pp == 1 and not s.sampled_tokens
    vp = tp > 1 and pp == 1 and not s.sampled_tokens and s.loss in ("auto", "chunked") and not tables_train
    s = replace(s, pp=pp, tp=tp, cp=cp, sp=sp, vp=vp, grad_accum=m, pipeline_layers=own)
    if pp == 1:
        return s
    if base.pp == pp and base.pipeline_schedule == "interleaved_1f1b" and m % max(1, m // pp) == 0:
        return replace(s, pipeline_schedule=base.pipeline_schedule, virtual_stages=base.virtual_stages)
    return replace(s, pipeline_schedule="1f1b" if m >= pp else "gpipe", virtual_stages=1)


def _interleaved(s: Setup, layers: int) -> Setup | None:
    """`s`'s pipeline run interleaved (2 virtual stages a rank: 1/2 the bubble, more micro-batches held) where its layers
    split evenly into them and its micro-batches into torch's rounds; else None."""
    pp, m = s.pp, s.grad_accum
    if pp == 1 or s.virtual_stages > 1 or s.pipeline_layers or not layers or layers % (2 * pp):
        return None
    if m < pp or m % max(1, m // pp):
        return None
    return replace(s, pipeline_schedule="interleaved_1f1b", virtual_stages=2)


def node_ram(e: Estimate, gpu: GpuSpec) -> float:
    """Host RAM on the fullest node the setup fills (host_ram is one machine's): its processes' share."""
    n = e.setup.gpus
    return e.host_ram_bytes / n * min(n, gpu.gpus_per_node or n)


def _fits_with_headroom(e: Estimate, gpu: GpuSpec) -> bool:
    return e.peak_bytes <= (1 - FIT_HEADROOM) * gpu.memory_bytes


def search(
    shape: ModelShape,
    recipe: RecipeFacts,
    base: Setup,
    gpu: GpuSpec,
    max_gpus: int,
    host_ram: int | None = None,
    layouts: tuple[tuple[int, int], ...] = (),
    contexts: tuple[int, ...] = (),
    **kw,
) -> tuple[Estimate | None, list[Estimate]]:
    """(fastest setup that fits with FIT_HEADROOM to spare, or None; every estimate made).
    host_ram: the machine's RAM, when known; setups that need more (offload, FSDP's load of
    the whole model per process) are left out. Ties go to less offloading, then fewer GPUs,
    then more headroom. layouts: the (pipeline stages, tensor-parallel ranks) to try besides (layout_choices);
    contexts: the context-parallel ranks (context_choices)."""
    per_node = gpu.gpus_per_node
    # Several nodes: one node's GPUs or whole nodes (torchrun starts as many processes on each).
    setups = [
        s
        for s in candidates(base, max_gpus, recipe, layouts, contexts, layers=shape.layers)
        if not per_node or s.gpus <= per_node or s.gpus % per_node == 0
    ]
    if shape.experts:  # MoE: finetune/model/moe.py's 4-bit experts are neither streamed nor sharded (model/load.py refuses)
        setups = [s for s in setups if not (s.streams_weights or s.partitions_weights)]
    estimates = [plan_setup(shape, recipe, s, gpu, **kw) for s in setups]
    fitting = [e for e in estimates if _fits_with_headroom(e, gpu) and (host_ram is None or node_ram(e, gpu) <= host_ram)]
    best = min(
        fitting,
        key=lambda e: (round(e.step_time_s, 6), e.setup.offload_rank, e.setup.gpus, -(e.headroom_bytes or 0)),
        default=None,
    )
    return best, estimates


def longest_fitting_seq(shape: ModelShape, recipe: RecipeFacts, base: Setup, gpu: GpuSpec, upper: int | None = None, **kw) -> int:
    """The longest data.max_seq_len (up to `upper`, default base's) at which batch 1 of `base` fits
    (0: not even 64 tokens)."""
    lo, hi = 0, upper or base.seq_len
    probe = replace(base, batch_size=1, grad_accum=1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_with_headroom(plan_setup(shape, recipe, replace(probe, seq_len=mid), gpu, **kw), gpu):
            lo = mid
        else:
            hi = mid - 1
    return lo if lo >= 64 else 0


def fit(
    cfg: RecipeConfig, gpu: GpuSpec, max_gpus: int = 1, gpus: int | None = None, host_ram: int | None = None
) -> tuple[Estimate, Estimate]:
    """(the recipe as written on `gpus` GPUs, the fastest setup that fits; with host_ram, one whose
    offload also fits that much RAM). Raises PlanError when none fits."""
    shape, recipe, kw = planning_inputs(cfg, gpu)
    per = setup_of(cfg).ranks_per_replica  # as written it runs on a multiple of its layout
    current = plan_recipe(cfg, gpu, gpus or max(per, max_gpus // per * per))
    layouts = layout_choices(cfg, shape, max_gpus, plan_precision(cfg, gpu))
    contexts = context_choices(cfg, shape, max_gpus)
    best, estimates = search(
        shape, recipe, current.setup, gpu, max_gpus, host_ram=host_ram, layouts=layouts, contexts=contexts, **kw
    )
    if best is None and any(_fits_with_headroom(e, gpu) for e in estimates):
        # The GPU is not the limit: every setup that fits it needs more host RAM than there is.
        least = min((e for e in estimates if _fits_with_headroom(e, gpu)), key=lambda e: node_ram(e, gpu))
        raise PlanError(
            f"every setup of '{cfg.model.path}' that fits {max_gpus} x {gpu.name} needs more host RAM than "
            f"{gib(host_ram or 0)}: the least needs {gib(node_ram(least, gpu))} ({describe_setup(least.setup)})",
            hint=f"plan for a machine with more RAM (--host-ram {math.ceil(node_ram(least, gpu) / GiB)}GB)"
            + ("" if cfg.lora is None else "; memory.base_weights=disk keeps streamed weights in a file instead of RAM"),
        )
    if best is None:
        smallest = min(estimates, key=lambda e: e.peak_bytes)
        seq = longest_fitting_seq(shape, recipe, smallest.setup, gpu, **kw)
        static = sum(c.bytes for c in smallest.components if c.key.startswith(("weights", "quant")))
        need = smallest.peak_bytes / (1 - FIT_HEADROOM)
        how = [f"a GPU with at least {gib(need)} (--gpu-mem {math.ceil(need / GiB)}GB)"]
        if seq:
            how.append(f"data.max_seq_len={seq} (fits at batch 1 with the smallest setup)")
        how.append(
            "a smaller lora.r or fewer lora.target modules" if cfg.lora else "LoRA (lora.r=16) instead of full fine-tuning"
        )
        raise PlanError(
            f"no setup of '{cfg.model.path}' at data.max_seq_len={current.setup.seq_len} fits {max_gpus} x {gpu.name} "
            f"({gib(gpu.memory_bytes)} each, {FIT_HEADROOM:.0%} kept free): the smallest needs {gib(smallest.peak_bytes)} per GPU "
            f"({describe_setup(smallest.setup)}; the weights alone take {gib(static)})",
            hint="; or ".join(how),
        )
    return current, best


LONGEST_SEQ_PROBED = 1 << 20  # plan --max-seq searches up to 1M tokens


@dataclass(frozen=True)
class LongestSeq:
    as_written: int  # with the recipe's own settings, batch 1
    best: int  # with the settings the search may choose (checkpointing, offload, the chunked loss, GPUs)
    best_setup: Setup | None


def longest_trainable_seq(cfg: RecipeConfig, gpu: GpuSpec, max_gpus: int = 1, host_ram: int | None = None) -> LongestSeq:
    """The longest sequence a recipe trains at batch 1 on `gpu` (plan --max-seq): as written, and at best."""
    shape, recipe, kw = planning_inputs(cfg, gpu)
    base = replace(setup_of(cfg, replica_ranks(cfg)), batch_size=1, grad_accum=1, pipeline_schedule="gpipe")
    if cfg.distributed.pipeline_layers == "auto":
        base = replace(base, pipeline_layers=balanced_layers(shape, recipe, base, gpu, **kw))
    as_written = longest_fitting_seq(shape, recipe, base, gpu, upper=LONGEST_SEQ_PROBED, **kw)
    best, best_setup = as_written, None
    # The search may also turn on the long-context levers the recipe switched off.
    tried = replace(
        base, loss="auto" if base.loss == "full" else base.loss, tiled_mlp="auto" if base.tiled_mlp == "off" else base.tiled_mlp
    )
    layouts = layout_choices(cfg, shape, max_gpus, plan_precision(cfg, gpu))
    for s in candidates(tried, max_gpus, recipe, layouts, context_choices(cfg, shape, max_gpus), layers=shape.layers):
        if best_setup is not None and s.gpus > best_setup.gpus and best >= LONGEST_SEQ_PROBED:
            continue
        seq = longest_fitting_seq(shape, recipe, s, gpu, upper=LONGEST_SEQ_PROBED, **kw)
        fits_host = (
            host_ram is None or node_ram(plan_setup(shape, recipe, replace(s, seq_len=max(seq, 64)), gpu, **kw), gpu) <= host_ram
        )
        if seq > best and fits_host:
            best, best_setup = seq, replace(s, seq_len=seq)
    return LongestSeq(as_written, best, best_setup)
