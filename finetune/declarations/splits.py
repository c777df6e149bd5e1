"""The split strategies, one declaration each: distributed.pipeline_parallel (stages), tensor_parallel (each layer's
weights) and context_parallel (each sequence). What its recipe keys are, which of them a resume may change, and
what a recipe cannot run with it (its rules); how the processes form its grid is declarations/layout.py, how it runs
parallel/pipeline.py, tensor.py and context.py.

    for split in SPLITS: split.asked(cfg), split.size(cfg), split.rules
    problems(cfg)                            # every split's rules broken by this recipe, in SPLITS' order

This module imports nothing of ours but the rule type and the strategies' declarations: config asks it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.declarations.strategies import of_recipe
from finetune.errors import Rule, broken


# The rules below ask their declaration (PIPELINE, TENSOR, CONTEXT, at the end) when they run.
def _pipelined(cfg: Any) -> bool:
    return PIPELINE.asked(cfg)


def pipeline_asked(cfg: Any) -> str:
    return PIPELINE.said(cfg)


def _shards(cfg: Any) -> bool:
    """The recipe asks a strategy that shards gradients (FSDP, ZeRO), which a split cannot hold."""
    return not of_recipe(cfg).replicates


RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda c: _pipelined(c) and _shards(c),
        lambda c: (
            f"{pipeline_asked(c)} with distributed.strategy={c.distributed.strategy}: a pipeline keeps whole stages and "
            "all-reduces their gradients over its replicas itself; it does not shard them. Set "
            "distributed.strategy=auto, or distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.lora is None,
        lambda c: (
            f"{pipeline_asked(c)} trains adapters (QLoRA, LoRA); full fine-tuning is not pipelined. Set lora, or "
            "distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.train.objective != "sft" and c.train.precompute_reference,
        lambda c: (
            f"{pipeline_asked(c)} with train.precompute_reference: the reference pass runs through the stages with each "
            "step (no process holds the whole model to precompute it). Set train.precompute_reference=false, or "
            "distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.memory.base_weights != "device",
        lambda c: (
            f"{pipeline_asked(c)} with memory.base_weights={c.memory.base_weights}: a stage keeps its own layers on "
            "its GPU (that is what the pipeline divides). Set memory.base_weights=device, or "
            "distributed.pipeline_parallel=1 to stream the layers through one GPU."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.precision == "fp16",
        lambda c: (
            f"{pipeline_asked(c)} with precision=fp16: each stage's GradScaler would decide alone whether a step is skipped "
            "(from its own part of the gradients). Set precision=bf16 or fp32, or distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.distributed.grad_compression != "none",
        lambda c: (
            f"{pipeline_asked(c)} with distributed.grad_compression={c.distributed.grad_compression}: compression is "
            "a hook of DDP's all-reduce, which a pipeline does not use. Set distributed.grad_compression=none, "
            "or distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: (c.distributed.pipeline_schedule == "interleaved_1f1b") != (c.distributed.virtual_stages > 1),
        lambda c: (
            (
                "distributed.pipeline_schedule=interleaved_1f1b needs distributed.virtual_stages >= 2 (the stages each rank runs)"
                if c.distributed.pipeline_schedule == "interleaved_1f1b"
                else f"distributed.virtual_stages={c.distributed.virtual_stages} needs "
                f"distributed.pipeline_schedule=interleaved_1f1b (it is {c.distributed.pipeline_schedule})"
            )
            + "; or set virtual_stages=1 with gpipe or 1f1b."
        ),
    ),
)


def _microbatch_problem(cfg: Any, accum: int | None = None) -> str | None:
    """What torch's schedule refuses for `accum` micro-batches a step (default train.grad_accum), or None."""
    d, m = cfg.distributed, cfg.train.grad_accum if accum is None else accum
    if d.pipeline_schedule == "1f1b" and m < d.pipeline_parallel:
        return f"at least as many micro-batches as stages (train.grad_accum={m} < {d.pipeline_parallel})"
    rounds = max(1, m // d.pipeline_parallel)
    if d.pipeline_schedule == "interleaved_1f1b" and m % rounds:
        return f"train.grad_accum to be a multiple of its {rounds} rounds of {d.pipeline_parallel} micro-batches (it is {m})"
    return None


def _microbatch_fix(cfg: Any) -> str:
    pp, m, b = cfg.distributed.pipeline_parallel, cfg.train.grad_accum, cfg.train.batch_size
    if b % pp == 0:
        fix = f"train.grad_accum={pp * m} train.batch_size={b // pp} (the same {b * m} examples per step per replica)"
    else:
        fix = f"train.grad_accum={pp * m} ({pp} times the examples per step)"
    return (
        f"distributed.pipeline_schedule={cfg.distributed.pipeline_schedule} needs {_microbatch_problem(cfg)}. Set "
        f"{fix}, or distributed.pipeline_schedule=gpipe."
    )


RULES += (
    Rule(lambda c: _pipelined(c) and _microbatch_problem(c) is not None, _microbatch_fix),
    Rule(
        lambda c: c.distributed.pipeline_layers != "even" and (not _pipelined(c) or c.distributed.virtual_stages > 1),
        lambda c: (
            f"distributed.pipeline_layers={c.distributed.pipeline_layers} splits the layers of a pipeline of "
            "distributed.pipeline_parallel >= 2 stages with virtual_stages=1; set pipeline_layers=even"
        ),
    ),
    Rule(
        lambda c: (
            isinstance(c.distributed.pipeline_layers, list)
            and _pipelined(c)
            and (len(c.distributed.pipeline_layers) != c.distributed.pipeline_parallel or min(c.distributed.pipeline_layers) < 1)
        ),
        lambda c: (
            f"distributed.pipeline_layers={c.distributed.pipeline_layers}: one count of at least 1 per stage "
            f"({c.distributed.pipeline_parallel} of them), e.g. pipeline_layers=auto to balance them"
        ),
    ),
)


def _split(cfg: Any) -> bool:
    return TENSOR.asked(cfg)


def tensor_asked(cfg: Any) -> str:
    return TENSOR.said(cfg)


VOCAB_TABLES = ("lm_head", "embed_tokens")  # what distributed.vocab_parallel splits


def _tensor_alone(key: str, what: str) -> tuple[Rule[Any], Rule[Any]]:
    """distributed.KEY (a refinement of tensor parallelism) refused without one, and where it does not run yet."""

    def on(c: Any) -> bool:
        return bool(getattr(c.distributed, key))

    def beside(c: Any) -> str:
        return pipeline_asked(c) if _pipelined(c) else "train.objective=grpo"

    def not_yet(c: Any) -> bool:
        return _pipelined(c) or c.train.objective == "grpo"

    return (
        Rule(
            lambda c: on(c) and not _split(c),
            lambda c: (
                f"distributed.{key}=true {what}; {tensor_asked(c)} has none. Set distributed.tensor_parallel to 2 or "
                f"more, or {key}=false."
            ),
        ),
        Rule(
            lambda c: on(c) and _split(c) and not_yet(c),
            lambda c: (
                f"distributed.{key}=true with {beside(c)}: not yet (tensor parallelism with or without context "
                f"parallelism, for sft, dpo, orpo and simpo). Set distributed.{key}=false."
            ),
        ),
    )


TENSOR_RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda c: _split(c) and _shards(c),
        lambda c: (
            f"{tensor_asked(c)} with distributed.strategy={c.distributed.strategy}: a tensor-parallel group all-reduces "
            "its replicas' gradients itself; it does not shard them. Set distributed.strategy=auto."
        ),
    ),
    Rule(
        lambda c: _split(c) and (c.lora is None or c.lora.method not in ("lora", "rslora")),
        lambda c: (
            f"{tensor_asked(c)} splits LoRA adapters (lora.method lora or rslora) with the layers"
            + ("; full fine-tuning is not split" if c.lora is None else f"; lora.method={c.lora.method} is not split yet")
            + ". Set lora.method=lora, or distributed.tensor_parallel=1."
        ),
    ),
    Rule(
        lambda c: _split(c) and (c.memory.base_weights == "disk" or c.memory.embeddings != "device"),
        lambda c: (
            f"{tensor_asked(c)} keeps each rank's share of the vocabulary tables on its GPU, and of the layers on its "
            "GPU or in its host RAM (the disk file is written while the whole model loads, not a rank's share). Set "
            "memory.base_weights=device or cpu and memory.embeddings=device, or distributed.tensor_parallel=1."
        ),
    ),
    Rule(
        lambda c: _split(c) and (c.memory.optimizer_offload or c.precision == "fp16"),
        lambda c: (
            f"{tensor_asked(c)} with "
            + ("memory.optimizer_offload=true (the moments in host RAM)" if c.memory.optimizer_offload else "precision=fp16")
            + ": not split yet"
            + ("" if c.memory.optimizer_offload else " (the GradScaler would decide each rank's skip alone)")
            + ". Set "
            + ("memory.optimizer_offload=false" if c.memory.optimizer_offload else "precision=bf16 or fp32")
            + ", or distributed.tensor_parallel=1."
        ),
    ),
    Rule(
        lambda c: _split(c) and c.distributed.grad_compression != "none",
        lambda c: (
            f"{tensor_asked(c)} does not use DDP's all-reduce, which grad_compression hooks. Set distributed.grad_compression=none."
        ),
    ),
    *_tensor_alone("sequence_parallel", "splits the sequence between a tensor-parallel group's split linears"),
    *_tensor_alone("vocab_parallel", "splits the embedding and the head over a tensor-parallel group"),
    Rule(
        lambda c: c.distributed.vocab_parallel and _split(c) and c.memory.loss in ("full", "liger"),
        lambda c: (
            f"distributed.vocab_parallel=true with memory.loss={c.memory.loss}: a rank holds only its columns of the "
            "logits, which the chunked loss takes as they are. Set memory.loss=chunked (or auto)."
        ),
    ),
    Rule(
        lambda c: c.distributed.vocab_parallel and _split(c) and c.lora is not None and bool(trained_tables(c.lora.target)),
        lambda c: (
            f"distributed.vocab_parallel=true with {', '.join(trained_tables(c.lora.target))} in lora.target: the split tables "
            "are frozen. Take them out of lora.target, or set distributed.vocab_parallel=false."
        ),
    ),
)


def trained_tables(target: str | list[str] | tuple[str, ...]) -> list[str]:
    """The vocabulary tables a lora.target adapts (a name in the list, or matched by peft's pattern; all-linear: none)."""
    if isinstance(target, str):
        return [] if target == "all-linear" else [t for t in VOCAB_TABLES if re.search(target, t)]
    return [t for t in VOCAB_TABLES if t in target]


def _context(cfg: Any) -> bool:
    return CONTEXT.asked(cfg)


def context_asked(cfg: Any) -> str:
    return CONTEXT.said(cfg)


CONTEXT_RULES: tuple[Rule[Any], ...] = (
    Rule(
        # (grpo: declarations/objectives.py refuses any pipeline)
        lambda c: _context(c) and _pipelined(c) and c.train.objective not in ("sft", "grpo"),
        lambda c: (
            f"{context_asked(c)} with {pipeline_asked(c)} and train.objective={c.train.objective}: not yet (a last "
            "stage scores its part of each row alone; cp x pp trains sft, and context parallelism without a pipeline "
            f"trains {c.train.objective}). Set one of them to 1."
        ),
    ),
    Rule(
        lambda c: _context(c) and _shards(c) and not of_recipe(c).wraps_layers,
        lambda c: (
            f"{context_asked(c)} with distributed.strategy={c.distributed.strategy}: context-parallel ranks hold whole "
            "replicas or FSDP's shards; DeepSpeed's engine would own the step. Set distributed.strategy=fsdp (the "
            "weights, gradients and AdamW state sharded over every process) or auto (whole replicas)."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.train.objective == "grpo" and _shards(c),
        lambda c: (
            f"{context_asked(c)} with train.objective=grpo and distributed.strategy={c.distributed.strategy}: a group's "
            "first rank samples for it with the whole model, which FSDP's shards would have every rank run. Set "
            "distributed.strategy=auto (each rank a whole replica), or distributed.context_parallel=1."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.train.objective == "grpo" and c.train.importance_sampling == "sequence",
        lambda c: (
            f"{context_asked(c)} with train.importance_sampling=sequence: a completion's one ratio is the mean of its "
            "tokens' over the whole row, which context parallelism splits over ranks (not yet gathered). Set "
            "train.importance_sampling=token, or distributed.context_parallel=1."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.model.attn_implementation != "auto",
        lambda c: (
            f"{context_asked(c)} with model.attn_implementation={c.model.attn_implementation}: context parallelism runs its "
            f"own attention over the split sequence ({c.distributed.context_parallel_mode}). Set "
            "model.attn_implementation=auto."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.memory.base_weights == "disk",
        lambda c: (
            f"{context_asked(c)} with memory.base_weights=disk: each rank streams its own copy of the layers, and they "
            "would share one file. Set memory.base_weights=cpu (each rank's copy in host RAM) or device."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.distributed.grad_compression != "none",
        lambda c: (
            f"{context_asked(c)} sums gradients without DDP's all-reduce, which grad_compression hooks. Set distributed.grad_compression=none."
        ),
    ),
)


@dataclass(frozen=True)
class Split:
    """A strategy that splits the model or its rows over processes: its size key and the keys that go with it."""

    name: str  # pipeline | tensor | context
    key: str  # distributed.<its size>: 1 leaves it off
    dim: str  # its dimension of the grid, as the planner's Setup and the Layout name it (pp, tp, cp)
    # Its recipe keys, each harmless to a resume: a checkpoint holds whole tensors (gathered from every
    # rank), so any layout reads it back and the numbers continue the same (runs/checkpoint.py).
    keys: tuple[str, ...]
    rules: tuple[Rule[Any], ...]
    # What its schedule refuses for a step of that many micro-batches (a resume's or an out-of-memory backoff's
    # cut of the window: trainer/order.py), or None; None for a split that takes any cut.
    window_problem: Callable[[Any, int], str | None] | None = None

    def size(self, cfg: Any) -> int:
        return max(1, getattr(cfg.distributed, self.field))

    def asked(self, cfg: Any) -> bool:
        return self.size(cfg) > 1

    @property
    def field(self) -> str:
        """Its size key's name in distributed.* (what a written recipe and plan --json call it)."""
        return self.key.split(".", 1)[1]

    def resized(self, cfg: Any, size: int) -> Any:
        """The recipe with this split's size set to `size` (the planner's search tries layouts so)."""
        return cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={self.field: size})})

    def said(self, cfg: Any) -> str:
        """The recipe's ask in its own words, as every message names it: distributed.<size key>=N."""
        return f"{self.key}={getattr(cfg.distributed, self.field)}"


PIPELINE = Split(
    "pipeline",
    "distributed.pipeline_parallel",  # every stage's adapter and optimizer state are whole in a checkpoint
    "pp",
    (
        "distributed.pipeline_parallel",
        "distributed.pipeline_schedule",
        "distributed.virtual_stages",
        "distributed.pipeline_layers",
    ),
    RULES,
    window_problem=lambda cfg, accum: _microbatch_problem(cfg, accum) if _pipelined(cfg) else None,
)
TENSOR = Split(
    "tensor",
    "distributed.tensor_parallel",  # the split tensors are gathered whole into a checkpoint, sliced again on load
    "tp",
    ("distributed.tensor_parallel", "distributed.sequence_parallel", "distributed.vocab_parallel"),
    TENSOR_RULES,
)
CONTEXT = Split(
    "context",
    "distributed.context_parallel",  # every rank of a context-parallel group holds the whole adapter, as DDP's do
    "cp",
    ("distributed.context_parallel", "distributed.context_parallel_mode"),
    CONTEXT_RULES,
)
SPLITS = (PIPELINE, TENSOR, CONTEXT)
RESUME_HARMLESS: tuple[str, ...] = tuple(key for s in SPLITS for key in s.keys)


def problems(cfg: Any) -> list[str]:
    """What distributed.pipeline_parallel, tensor_parallel and context_parallel cannot run with in this recipe."""
    return broken(tuple(rule for s in SPLITS for rule in s.rules), cfg)
