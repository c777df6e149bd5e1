"""The split strategies' grid (declarations/splits.py: its dimensions pp, tp, cp): how a launch's processes form a grid of
pipeline stages x data-parallel replicas x context-parallel ranks x tensor-parallel ranks, and what a launch's process
count and model cannot split (`launch_problems`; what a recipe cannot run with: declarations/splits.py).

    layout = Layout.of(cfg, rank, world)     # layout.stage, layout.replica, layout.replicas
    layout.stages_of_rank                    # the stage indices this rank runs (interleaved: virtual_stages of them)

Ranks are numbered pipeline-outermost and tensor-parallel innermost, as Megatron-LM and torchtitan number
them: rank = ((stage x replicas + replica) x cp + cp_rank) x tp + tp_rank. On 2 nodes x 2 GPUs with 2 stages, a node then holds one stage of both
replicas: the gradient all-reduce stays inside the node, and only the activations of one micro-batch at
a time cross between nodes. How the stages run: finetune/parallel/pipeline.py.
This module imports nothing of ours but the split declarations: config asks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.declarations.splits import CONTEXT, PIPELINE, TENSOR, context_asked, pipeline_asked, tensor_asked

# The decoder families whose forward a stage runs as it is (embeddings, then layers, then norm, with
# nothing between them that a stage would repeat or skip): Gemma scales its embeddings inside the
# forward (a later stage would scale its input again); MoE models add a router loss over all layers.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# tensor parallelism splits these decoder linears (parallel/tensor.py; the planner reads them too):
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
    cp: int = 1  # context-parallel ranks: each holds the whole model (or FSDP's shards) and a part of every sequence

    @classmethod
    def of(cls, cfg: Any, rank: int, world: int) -> Layout:
        """The recipe's grid (distributed.pipeline_layers=auto: an even split until runtime.Parallel balances it)."""
        d = cfg.distributed
        pp, tp, cp = PIPELINE.size(cfg), TENSOR.size(cfg), CONTEXT.size(cfg)
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
            parts = f" x {self.cp} context-parallel ranks" if self.cp > 1 else ""
            return f"{many} of {self.pp} stages{parts}" + (f" x {self.tp} tensor-parallel ranks" if self.tp > 1 else "")
        if self.tp > 1:
            return f"{many} of {self.tp} tensor-parallel ranks"
        if self.cp > 1:
            return f"{many} of {self.cp} context-parallel ranks"
        return f"{self.replicas} proc"

    @property
    def world(self) -> int:
        return self.pp * self.replicas * self.cp * self.tp

    def tensor_ranks(self, block: int) -> list[int]:
        """The global ranks of one tensor-parallel group (block = (stage x replicas + replica) x cp + cp_rank:
        consecutive ranks)."""
        return list(range(block * self.tp, (block + 1) * self.tp))

    def pipeline_ranks(self, replica: int, tp_rank: int | None = None, cp_rank: int | None = None) -> list[int]:
        """The global ranks of one replica's pipeline (its stages, in stage order) of a tensor-parallel rank and a
        context-parallel rank (None: this rank's): each share and each part of the rows runs a pipeline of its own."""
        t = self.tp_rank if tp_rank is None else tp_rank
        c = self.cp_rank if cp_rank is None else cp_rank
        return [((s * self.replicas + replica) * self.cp + c) * self.tp + t for s in range(self.pp)]

    def stage_ranks(self, stage: int, tp_rank: int | None = None) -> list[int]:
        """The global ranks that run one stage's share (one per replica and context-parallel rank) of a tensor-parallel
        rank (None: this rank's): they sum its gradients."""
        t = self.tp_rank if tp_rank is None else tp_rank
        blocks = [(stage * self.replicas + r) * self.cp + c for r in range(self.replicas) for c in range(self.cp)]
        return [b * self.tp + t for b in blocks]

    def layer_range(self, stage: int, layers: int) -> tuple[int, int]:
        """Decoder layers [lo, hi) of a stage: the splits given, or an even split (launch_problems refuses a
        split that does not add up to the model's layers)."""
        if self.splits:
            lo = sum(self.splits[:stage])
            return lo, lo + self.splits[stage]
        per = layers // self.stage_count
        return stage * per, (stage + 1) * per


def launch_problems(cfg: Any, world: int, layers: int | None, model_type: str | None) -> list[str]:
    """What this launch's process count and model cannot split as the recipe asks (before any weight loads);
    layers and model_type None: not known yet (checked again on the loaded model)."""
    pp, tp, cp = PIPELINE.size(cfg), TENSOR.size(cfg), CONTEXT.size(cfg)
    # The split dimensions asked, outermost first, as the launch's processes are numbered (Layout).
    grid = [
        (n, said, what)
        for n, said, what in (
            (pp, pipeline_asked, "stages"),
            (cp, context_asked, "context-parallel ranks"),
            (tp, tensor_asked, "tensor-parallel ranks"),
        )
        if n > 1
    ]
    n = pp * cp * tp
    out = []
    if world % n:
        asked = " x ".join(said(cfg) for _, said, _ in grid)
        what = " x ".join(w for _, _, w in grid)
        out.append(
            f"{asked} on {world} processes: the processes must be {what} x replicas. "
            f"Launch with --nproc {n} or a multiple of it ({n}, {2 * n}, ...)."
        )
    out += _stage_problems(cfg, layers) if pp > 1 else []
    if model_type is not None and model_type not in FAMILIES and (pp > 1 or tp > 1):
        asked, runs = (pipeline_asked(cfg), "stages run") if pp > 1 else (tensor_asked(cfg), "the split is written for")
        out.append(
            f"{asked}: the model is a {model_type!r} model; {runs} the decoder families {', '.join(FAMILIES)}. "
            f"Use {PIPELINE.key}=1 and {TENSOR.field}=1 (DDP or FSDP) for this model."
        )
    return out


def _stage_problems(cfg: Any, layers: int | None) -> list[str]:
    """What the model's decoder layers cannot split into as distributed.pipeline_layers asks."""
    if layers is None:
        return []
    pp, v, given = PIPELINE.size(cfg), cfg.distributed.virtual_stages, cfg.distributed.pipeline_layers
    stages = pp * v
    if isinstance(given, list) and sum(given) != layers:
        return [
            f"distributed.pipeline_layers={given} adds up to {sum(given)} decoder layers, but the model has {layers}. "
            "Give counts that add up to it, or pipeline_layers=auto."
        ]
    if given == "even" and layers % stages:
        fits = [n for n in range(2, layers + 1) if layers % (n * v) == 0][:6]
        return [
            f"{pipeline_asked(cfg)} x distributed.virtual_stages={v} = {stages} stages, but the model has {layers} decoder "
            f"layers, which do not split evenly into {stages}. {PIPELINE.field} values that do: "
            f"{', '.join(map(str, fits)) or 'none'}; or distributed.pipeline_layers=auto (or a count per stage)."
        ]
    return []
