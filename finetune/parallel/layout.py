"""distributed.pipeline_parallel, tensor_parallel and context_parallel: how a launch's processes form a grid of
pipeline stages x data-parallel replicas x context-parallel ranks x tensor-parallel ranks, and what a layout cannot run with (config asks `problems(cfg)`,
the launch `launch_problems`).

    layout = Layout.of(cfg, rank, world)     # layout.stage, layout.replica, layout.replicas
    layout.stages_of_rank                    # the stage indices this rank runs (interleaved: virtual_stages of them)

Ranks are numbered pipeline-outermost and tensor-parallel innermost, as Megatron-LM and torchtitan number
them: rank = ((stage x replicas + replica) x cp + cp_rank) x tp + tp_rank. On 2 nodes x 2 GPUs with pipeline_parallel=2, a node then holds one stage of both
replicas: the gradient all-reduce stays inside the node, and only the activations of one micro-batch at
a time cross between nodes. How the stages run: finetune/parallel/pipeline.py.
This module imports nothing of ours but the rule type: config asks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.errors import Rule, broken

# The decoder families whose forward a stage runs as it is (embeddings, then layers, then norm, with
# nothing between them that a stage would repeat or skip): Gemma scales its embeddings inside the
# forward (a later stage would scale its input again); MoE models add a router loss over all layers.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# distributed.tensor_parallel splits these decoder linears (parallel/tensor.py; the planner reads them too):
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split: rows of W, and its bias
ROW = ("o_proj", "down_proj")  # input features split: columns of W


@dataclass(frozen=True)
class Layout:
    """Where one rank stands: pp stages x replicas x cp context-parallel ranks x tp tensor-parallel ranks,
    virtual_stages stages per rank when interleaved. rank = ((stage x replicas + replica) x cp + cp_rank) x tp +
    tp_rank: tensor parallelism innermost (its all-reduces every layer stay in a node), the pipeline outermost."""

    pp: int
    replicas: int
    rank: int
    virtual_stages: int = 1
    tp: int = 1
    splits: tuple[int, ...] = ()  # decoder layers of each stage (distributed.pipeline_layers); (): an even split
    cp: int = 1  # context-parallel ranks: each holds the whole model and a part of every sequence

    @classmethod
    def of(cls, cfg: Any, rank: int, world: int) -> Layout:
        """The recipe's grid (distributed.pipeline_layers=auto: an even split until runtime.Parallel balances it)."""
        d = cfg.distributed
        pp, tp, cp = max(1, d.pipeline_parallel), max(1, d.tensor_parallel), max(1, d.context_parallel)
        splits = tuple(d.pipeline_layers) if isinstance(d.pipeline_layers, list) else ()
        return cls(pp, max(1, world // (pp * tp * cp)), rank, d.virtual_stages if pp > 1 else 1, tp, splits, cp)

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def stage(self) -> int:
        """This rank's place along the pipe (its first stage when interleaved)."""
        return self.rank // (self.replicas * self.cp * self.tp)

    @property
    def replica(self) -> int:
        """Which copy of the model this rank belongs to: the copies see different examples (a context-parallel
        group's ranks are one copy: each holds a part of the same rows)."""
        return (self.rank // (self.tp * self.cp)) % self.replicas

    @property
    def cp_rank(self) -> int:
        """This rank's part of every sequence within its context-parallel group."""
        return (self.rank // self.tp) % self.cp

    def context_ranks(self) -> list[int]:
        """The global ranks of this rank's context-parallel group, in the order of their parts of a sequence."""
        first = self.rank - self.cp_rank * self.tp
        return [first + c * self.tp for c in range(self.cp)]

    @property
    def tp_rank(self) -> int:
        """This rank's share of each layer within its tensor-parallel group."""
        return self.rank % self.tp

    @property
    def stage_count(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def stages_of_rank(self) -> list[int]:
        """Stage indices this rank runs: its own, and with V virtual stages every pp-th after it (the
        interleaved schedule's loop order: rank r holds stages r, r + pp, r + 2pp, ...)."""
        return [self.stage + v * self.pp for v in range(self.virtual_stages)]

    @property
    def copies(self) -> str:
        """What a step's window is multiplied by, in words: processes, or a pipeline's or a group's replicas."""
        many = f"{self.replicas} replica{'s' if self.replicas > 1 else ''}"
        if self.pipelined:
            return f"{many} of {self.pp} stages" + (f" x {self.tp} tensor-parallel ranks" if self.tp > 1 else "")
        if self.tp > 1:
            return f"{many} of {self.tp} tensor-parallel ranks"
        if self.cp > 1:
            return f"{many} of {self.cp} context-parallel ranks"
        return f"{self.replicas} proc"

    @property
    def world(self) -> int:
        return self.pp * self.replicas * self.cp * self.tp

    def tensor_ranks(self, block: int) -> list[int]:
        """The global ranks of one tensor-parallel group (block = stage x replicas + replica: consecutive ranks)."""
        return list(range(block * self.tp, (block + 1) * self.tp))

    def pipeline_ranks(self, replica: int, tp_rank: int | None = None) -> list[int]:
        """The global ranks of one replica's pipeline (its stages, in stage order) of a tensor-parallel rank
        (None: this rank's): each of a group's ranks runs a pipeline of its own shares."""
        t = self.tp_rank if tp_rank is None else tp_rank
        return [(s * self.replicas + replica) * self.tp + t for s in range(self.pp)]

    def stage_ranks(self, stage: int, tp_rank: int | None = None) -> list[int]:
        """The global ranks that run one stage's share (one per replica) of a tensor-parallel rank (None: this rank's)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        return [(stage * self.replicas + r) * self.tp + t for r in range(self.replicas)]

    def layer_range(self, stage: int, layers: int) -> tuple[int, int]:
        """Decoder layers [lo, hi) of a stage: the splits given, or an even split (launch_problems refuses a
        split that does not add up to the model's layers)."""
        if self.splits:
            lo = sum(self.splits[:stage])
            return lo, lo + self.splits[stage]
        per = layers // self.stage_count
        return stage * per, (stage + 1) * per


def _pipelined(cfg: Any) -> bool:
    return cfg.distributed.pipeline_parallel > 1


def _by(cfg: Any) -> str:
    return f"distributed.pipeline_parallel={cfg.distributed.pipeline_parallel}"


RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda c: _pipelined(c) and c.distributed.strategy in ("fsdp", "deepspeed"),
        lambda c: (
            f"{_by(c)} with distributed.strategy={c.distributed.strategy}: a pipeline keeps whole stages and "
            "all-reduces their gradients over its replicas itself; it does not shard them. Set "
            "distributed.strategy=auto, or distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.lora is None,
        lambda c: (
            f"{_by(c)} trains adapters (QLoRA, LoRA); full fine-tuning is not pipelined. Set lora, or "
            "distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.train.objective != "sft" and c.train.precompute_reference,
        lambda c: (
            f"{_by(c)} with train.precompute_reference: the reference pass runs through the stages with each "
            "step (no process holds the whole model to precompute it). Set train.precompute_reference=false, or "
            "distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.memory.base_weights != "device",
        lambda c: (
            f"{_by(c)} with memory.base_weights={c.memory.base_weights}: a stage keeps its own layers on "
            "its GPU (that is what the pipeline divides). Set memory.base_weights=device, or "
            "distributed.pipeline_parallel=1 to stream the layers through one GPU."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.precision == "fp16",
        lambda c: (
            f"{_by(c)} with precision=fp16: each stage's GradScaler would decide alone whether a step is skipped "
            "(from its own part of the gradients). Set precision=bf16 or fp32, or distributed.pipeline_parallel=1."
        ),
    ),
    Rule(
        lambda c: _pipelined(c) and c.distributed.grad_compression != "none",
        lambda c: (
            f"{_by(c)} with distributed.grad_compression={c.distributed.grad_compression}: compression is "
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


def _microbatch_problem(cfg: Any) -> str | None:
    """What torch's schedule refuses for this many micro-batches (train.grad_accum), or None."""
    d, m = cfg.distributed, cfg.train.grad_accum
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
    return cfg.distributed.tensor_parallel > 1


def _tp(cfg: Any) -> str:
    return f"distributed.tensor_parallel={cfg.distributed.tensor_parallel}"


TENSOR_RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda c: _split(c) and c.distributed.strategy in ("fsdp", "deepspeed"),
        lambda c: (
            f"{_tp(c)} with distributed.strategy={c.distributed.strategy}: a tensor-parallel group all-reduces "
            "its replicas' gradients itself; it does not shard them. Set distributed.strategy=auto."
        ),
    ),
    Rule(
        lambda c: _split(c) and (c.lora is None or c.lora.method not in ("lora", "rslora")),
        lambda c: (
            f"{_tp(c)} splits LoRA adapters (lora.method lora or rslora) with the layers"
            + ("; full fine-tuning is not split" if c.lora is None else f"; lora.method={c.lora.method} is not split yet")
            + ". Set lora.method=lora, or distributed.tensor_parallel=1."
        ),
    ),
    Rule(
        lambda c: _split(c) and (c.memory.base_weights != "device" or c.memory.embeddings != "device"),
        lambda c: (
            f"{_tp(c)} keeps each rank's share of the layers and the vocabulary tables on its GPU. Set "
            "memory.base_weights=device and memory.embeddings=device, or distributed.tensor_parallel=1."
        ),
    ),
    Rule(
        lambda c: _split(c) and (c.memory.optimizer_offload or c.precision == "fp16"),
        lambda c: (
            f"{_tp(c)} with "
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
        lambda c: f"{_tp(c)} does not use DDP's all-reduce, which grad_compression hooks. Set distributed.grad_compression=none.",
    ),
)


def _context(cfg: Any) -> bool:
    return cfg.distributed.context_parallel > 1


def _cp(cfg: Any) -> str:
    return f"distributed.context_parallel={cfg.distributed.context_parallel}"


CONTEXT_RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda c: _context(c) and (_pipelined(c) or _split(c)),
        lambda c: (
            f"{_cp(c)} with "
            + (_by(c) if _pipelined(c) else _tp(c))
            + ": context parallelism does not compose with pipeline or tensor parallelism yet. Set one of them to 1."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.distributed.strategy in ("fsdp", "deepspeed"),
        lambda c: (
            f"{_cp(c)} with distributed.strategy={c.distributed.strategy}: context-parallel ranks each hold the "
            "whole model and all-reduce their gradients as DDP does; sharding them is not supported yet. Set "
            "distributed.strategy=auto (or ddp)."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.train.objective != "sft",
        lambda c: (
            f"{_cp(c)} with train.objective={c.train.objective}: a preference loss needs each sequence's whole "
            "log-probability, which no rank of a split sequence holds; not supported yet. Set train.objective=sft, "
            "or distributed.context_parallel=1."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.model.attn_implementation != "auto",
        lambda c: (
            f"{_cp(c)} with model.attn_implementation={c.model.attn_implementation}: context parallelism runs its "
            f"own attention over the split sequence ({c.distributed.context_parallel_mode}). Set "
            "model.attn_implementation=auto."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.memory.base_weights == "disk",
        lambda c: (
            f"{_cp(c)} with memory.base_weights=disk: each rank streams its own copy of the layers, and they "
            "would share one file. Set memory.base_weights=cpu (each rank's copy in host RAM) or device."
        ),
    ),
    Rule(
        lambda c: _context(c) and c.distributed.grad_compression != "none",
        lambda c: (
            f"{_cp(c)} sums gradients without DDP's all-reduce, which grad_compression hooks. Set distributed.grad_compression=none."
        ),
    ),
)


def problems(cfg: Any) -> list[str]:
    """What distributed.pipeline_parallel, tensor_parallel and context_parallel cannot run with in this recipe."""
    return broken(RULES + TENSOR_RULES + CONTEXT_RULES, cfg)


def launch_problems(cfg: Any, world: int, layers: int | None, model_type: str | None) -> list[str]:
    """What this launch's process count and model cannot split as the recipe asks (before any weight loads);
    layers and model_type None: not known yet (checked again on the loaded model)."""
    pp, tp = cfg.distributed.pipeline_parallel, cfg.distributed.tensor_parallel
    out = []
    if pp > 1 and tp > 1 and world % (pp * tp):
        out.append(
            f"{_by(cfg)} x {_tp(cfg)} on {world} processes: the processes must be stages x tensor-parallel ranks x "
            f"replicas. Launch with --nproc {pp * tp} or a multiple of it ({pp * tp}, {2 * pp * tp}, ...)."
        )
    elif tp > 1 and world % tp:
        out.append(
            f"{_tp(cfg)} on {world} processes: the processes must be tensor-parallel ranks x replicas. "
            f"Launch with --nproc {tp} or a multiple of it ({tp}, {2 * tp}, ...)."
        )
    elif pp > 1 and world % pp:
        out.append(
            f"{_by(cfg)} on {world} processes: the processes must be stages x replicas. "
            f"Launch with --nproc {pp} or a multiple of it ({pp}, {2 * pp}, ...)."
        )
    cp = cfg.distributed.context_parallel
    if cp > 1 and world % cp:
        out.append(
            f"{_cp(cfg)} on {world} processes: the processes must be context-parallel ranks x replicas. "
            f"Launch with --nproc {cp} or a multiple of it ({cp}, {2 * cp}, ...)."
        )
    out += _stage_problems(cfg, layers) if pp > 1 else []
    if model_type is not None and model_type not in FAMILIES and (pp > 1 or tp > 1):
        asked, runs = (_by(cfg), "stages run") if pp > 1 else (_tp(cfg), "the split is written for")
        out.append(
            f"{asked}: the model is a {model_type!r} model; {runs} the decoder families {', '.join(FAMILIES)}. "
            "Use distributed.pipeline_parallel=1 and tensor_parallel=1 (DDP or FSDP) for this model."
        )
    return out


def _stage_problems(cfg: Any, layers: int | None) -> list[str]:
    """What the model's decoder layers cannot split into as distributed.pipeline_layers asks."""
    if layers is None:
        return []
    pp, v, given = cfg.distributed.pipeline_parallel, cfg.distributed.virtual_stages, cfg.distributed.pipeline_layers
    stages = pp * v
    if isinstance(given, list) and sum(given) != layers:
        return [
            f"distributed.pipeline_layers={given} adds up to {sum(given)} decoder layers, but the model has {layers}. "
            "Give counts that add up to it, or pipeline_layers=auto."
        ]
    if given == "even" and layers % stages:
        fits = [n for n in range(2, layers + 1) if layers % (n * v) == 0][:6]
        return [
            f"{_by(cfg)} x distributed.virtual_stages={v} = {stages} stages, but the model has {layers} decoder "
            f"layers, which do not split evenly into {stages}. pipeline_parallel values that do: "
            f"{', '.join(map(str, fits)) or 'none'}; or distributed.pipeline_layers=auto (or a count per stage)."
        ]
    return []
