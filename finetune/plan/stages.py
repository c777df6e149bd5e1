"""distributed.pipeline_parallel and tensor_parallel in the plan: each rank planned as the part of the model it holds.

A rank (finetune/parallel/pipeline.py) holds its stages' decoder layers, the embeddings when it runs the
first stage (and the last, for a tied head), the final norm, head and loss when it runs the last; its
replicas' gradient all-reduce is DDP's over `replicas` GPUs. What no single-GPU plan has:

  held micro-batches  the saved activations of every micro-batch that has run this rank's forward and not
                      yet its backward: GPipe all m; 1F1B at most P - r on rank r (torch's Schedule1F1B
                      warms up P - r); interleaved, 2 (P - 1 - r) + (V - 1) R + 1 chunks of 1/V of the
                      rank's layers each, R = m // (m // P) micro-batches a round (ScheduleInterleaved1F1B).
  bubble              the step is the slowest rank's micro-batches plus (P - 1) slots in which it waits
                      for the others to fill and drain the pipe: (m + P - 1) / m of its busy time; V
                      virtual stages make each slot 1/V as long.
  p2p                 each micro-batch's activations cross each stage boundary forward and their gradients
                      backward, over the GPU link, on the critical path (not overlapped: an upper bound).

The estimate returned is the rank with the highest peak, with the whole pipeline's step time, host RAM
(every process) and disk; its notes give every rank's peak and the bubble.

A tensor-parallel rank (finetune/parallel/tensor.py) holds every layer's share: q, k, v, gate and up with
1/N of their output features, o and down with 1/N of their input features (their LoRA to match), the
heads' and the MLP's activations 1/N, the layer inputs, norms, embeddings and head whole. Its step adds
the all-reduces after attention and the MLP, forward and backward (and in a checkpointed layer's
recompute): 2 (N - 1) / N of a micro-batch's hidden states each, on the GPU link, not overlapped.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from finetune.declarations.layout import COLUMN, FAMILIES, ROW, Layout
from finetune.declarations.splits import CONTEXT, PIPELINE, TENSOR
from finetune.declarations.splits import problems as split_problems
from finetune.declarations.strategies import DDP
from finetune.errors import PlanError
from finetune.gpus import GpuSpec
from finetune.plan.context import part_setup, plan_context_split
from finetune.plan.inputs import RecipeFacts, Setup
from finetune.plan.memory import Estimate, estimate, gib
from finetune.plan.shape import ModelShape
from finetune.plan.speed import LINK_EFFICIENCY
from finetune.plan.terms import trainable_params


def rank_shape(shape: ModelShape, layout: Layout) -> ModelShape:
    """The part of the model one pipeline rank holds, as a ModelShape the single-GPU terms read."""
    stages = layout.stages_of_rank
    first, last = 0 in stages, layout.stage_count - 1 in stages
    layers = sum(hi - lo for lo, hi in (layout.layer_range(s, shape.layers) for s in stages))
    share = layers / shape.layers
    tied = shape.tied_embeddings and last  # the last stage reads the shared table for its head
    embedding = shape.embedding_params if first or tied else 0
    head = shape.head_params if last else 0
    linears = tuple(replace(g, count=round(g.count * share)) for g in shape.linears)
    other = round(shape.other_params * share)  # norms and biases, per layer (the final norm: a rounding error)
    total = sum(g.in_features * g.out_features * g.count for g in linears) + embedding + head + other
    return replace(
        shape,
        layers=layers,
        linears=linears,
        embedding_params=embedding,
        head_params=head,
        tied_embeddings=tied,
        other_params=other,
        total_params=total,
    )


def held_micro_batches(schedule: str, layout: Layout, micro_batches: int) -> float:
    """Micro-batches of this rank's saved activations alive at once, in units of all its layers."""
    p, r, m, v = layout.pp, layout.stage, micro_batches, layout.virtual_stages
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    per_round = m // max(1, m // p)  # torch's micro-batches per round (p when m is a multiple of p)
    chunks = min(m * v, 2 * (p - 1 - r) + (v - 1) * per_round + 1)  # each chunk: 1/V of the rank's layers
    return chunks / v


def bubble_factor(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """A step's length over its slowest rank's busy time: (m + (P - 1) / V) / m."""
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    return (micro_batches + (pp - 1) / v) / micro_batches


def plan_pipeline(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, **kw: Any) -> Estimate:
    """The plan of setup.gpus processes as setup.pp stages x replicas (see the module)."""
    pp, schedule, v, tp, cp = setup.pp, setup.pipeline_schedule, setup.virtual_stages, setup.tp, setup.cp
    world, splits = setup.gpus, setup.pipeline_layers
    uneven = sum(splits) != shape.layers if splits else shape.layers % (pp * v)
    per = setup.ranks_per_replica
    if world % per or uneven:
        grid = "stages" + f" x {cp} context-parallel ranks" * (cp > 1) + f" x {tp} tensor-parallel ranks" * (tp > 1)
        raise PlanError(
            f"distributed.pipeline_parallel={pp} (x virtual_stages={v}) on {world} GPUs with {shape.layers} decoder layers"
            f"{f' as {list(splits)}' if splits else ''}: the GPUs must be {grid} x replicas and the stages must hold "
            "every layer (an even split, or distributed.pipeline_layers adding up to them)",
            hint=f"plan with --gpus {per} (or a multiple), and distributed.pipeline_layers=auto or counts adding up to {shape.layers}",
        )
    replicas, m = world // per, setup.grad_accum
    ranks = _ranks(shape, recipe, setup, gpu, **kw)
    worst = max(ranks, key=lambda x: x[1].peak_bytes)[1]
    slowest = max(ranks, key=lambda x: x[1].step_time_s)[1]
    parts = dict(slowest.step_time_parts)
    step = slowest.step_time_s
    if gpu is not None:
        busy = step - parts["communication"] - parts["optimizer"]  # the micro-batches, without the step's end
        parts["pipeline_bubble"] = busy * (bubble_factor(schedule, pp, v, m) - 1)
        tokens = part_setup(setup).seq_len  # cp x pp: a part's, in each pipeline
        boundary = setup.rows * tokens * shape.hidden * recipe.compute_bytes  # one micro-batch's activations
        link, sharing = _send_link(setup, gpu)
        parts["pipeline_p2p"] = 2 * (m + pp - 1) * boundary * sharing / (link * 1e9 * LINK_EFFICIENCY)
        step += parts["pipeline_bubble"] + parts["pipeline_p2p"]
    notes = [_describe_rank(layout, e, held, shape) for layout, e, held in ranks]
    bubble = bubble_factor(schedule, pp, v, m)
    split = f" x {cp} context-parallel ranks (each runs its part of every sequence)" if cp > 1 else ""
    split += f" x {tp} tensor-parallel ranks (each holds 1/{tp} of its stage's decoder linears)" if tp > 1 else ""
    notes.append(
        f"pipeline: {pp} stages{split} x {replicas} replica{'s' if replicas > 1 else ''}, {schedule}, {m} micro-batches "
        f"(train.grad_accum): the bubble is {1 - 1 / bubble:.0%} of the step; the plan above is the rank with the highest peak"
    )
    return replace(
        worst,
        shape=shape,
        setup=setup,
        gpu=gpu,
        step_time_s=step,
        step_time_parts=parts,
        host_ram_bytes=sum(e.host_ram_bytes for _, e, _ in ranks) * tp,  # each of a stage's tp ranks a process (e: cp's)
        disk_bytes=sum(e.disk_bytes for _, e, _ in ranks) * tp,
        trainable_params=trainable_params(shape, recipe) if tp > 1 else sum(e.trainable_params for _, e, _ in ranks),
        notes=[*notes, *worst.notes],
    )


def _ranks(
    shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, **kw: Any
) -> list[tuple[Layout, Estimate, float]]:
    """(layout, estimate, micro-batches held) of replica 0's first tensor-parallel rank at each place along the pipe
    (the others hold the same); split over tensor-parallel ranks, each its share, its all-reduces in its step; under
    cp x pp each context-parallel rank's part of every sequence through its stage (plan/context.py)."""
    pp, tp, cp = setup.pp, setup.tp, setup.cp
    replicas = setup.gpus // setup.ranks_per_replica
    # The processes that sum a stage's gradients: its replicas x context-parallel ranks.
    one = replace(setup, gpus=replicas * cp, sharding=DDP.name, pp=1, pipeline_layers=(), tp=1, fp32_absmax=row_shares(tp))
    plan = plan_context_split if cp > 1 else estimate
    reduced = part_setup(setup)  # a part's tokens
    out = []
    for stage in range(pp):
        layout = Layout(pp, replicas, stage * replicas * cp * tp, setup.virtual_stages, tp, setup.pipeline_layers, cp)
        held = held_micro_batches(setup.pipeline_schedule, layout, setup.grad_accum)
        part = rank_shape(shape, layout)
        seen = gpu and _as_seen_by(gpu, layout.stage_ranks(stage))  # the stage's replicas all-reduce over their link
        e = plan(tensor_rank_shape(part, tp) if tp > 1 else part, recipe, one, seen, held=held, **kw)
        if tp > 1 and gpu is not None:
            allreduce = tensor_allreduce_s(part, recipe, reduced, _as_seen_by(gpu, layout.tensor_ranks(layout.rank // tp)))
            e = replace(
                e, step_time_s=e.step_time_s + allreduce, step_time_parts={**e.step_time_parts, "tensor_allreduce": allreduce}
            )
        out.append((layout, e, held))
    return out


def balanced_layers(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, **kw: Any) -> tuple[int, ...]:
    """distributed.pipeline_layers=auto: layers per stage so that the fullest rank's planned peak is as low as
    moving one layer at a time from it to another rank makes it (the first rank holds the embeddings and the
    most micro-batches, the last the head and the loss), from as even a split as the layers allow."""
    pp, n = setup.pp, shape.layers
    splits = [n // pp + (1 if i < n % pp else 0) for i in range(pp)]

    def peaks(counts: list[int]) -> list[int]:
        return [
            e.peak_allocated_bytes for _, e, _ in _ranks(shape, recipe, replace(setup, pipeline_layers=tuple(counts)), gpu, **kw)
        ]

    current = peaks(splits)
    for _ in range(n):  # each accepted move lowers the highest peak: at most one per layer
        fullest = current.index(max(current))
        tries = []
        for to in range(pp):  # counts, not ranges: the stages between shift by one layer and keep their count
            if to != fullest and splits[fullest] > 1:
                moved = list(splits)
                moved[fullest] -= 1
                moved[to] += 1
                tries.append((max(peaks(moved)), moved))
        best = min(tries, default=None)
        if best is None or best[0] >= max(current):
            break
        splits = best[1]
        current = peaks(splits)
    return tuple(splits)


def _describe_rank(layout: Layout, e: Estimate, held: float, shape: ModelShape) -> str:
    spans = [layout.layer_range(s, shape.layers) for s in layout.stages_of_rank]
    layers = ", ".join(f"{lo}-{hi - 1}" for lo, hi in spans)
    first, last = 0 in layout.stages_of_rank, layout.stage_count - 1 in layout.stages_of_rank
    parts = ["embeddings"] * first + [f"layers {layers}"] + ["norm + head + loss"] * last
    held_s = f"{held:g}" if held == math.floor(held) else f"{held:.2f}"
    return (
        f"pipeline rank {layout.stage}: {' + '.join(parts)}; peak {gib(e.peak_bytes)}, "
        f"activations of {held_s} micro-batch{'es' if held != 1 else ''} held"
    )


def tensor_rank_shape(shape: ModelShape, tp: int, vocab: bool = False, local_logits: bool = False) -> ModelShape:
    """One tensor-parallel rank's share of every layer, as a ModelShape the single-GPU terms read. vocab: its rows of
    the embedding and head too (parallel/vocab.py); local_logits: the loss takes its columns of the logits alone
    (chunked), not the whole logits gathered."""
    linears = tuple(
        replace(g, out_features=g.out_features // tp)
        if g.name in COLUMN
        else replace(g, in_features=g.in_features // tp)
        if g.name in ROW
        else g
        for g in shape.linears
    )
    split = sum(g.in_features * g.out_features * g.count for g in shape.linears) - sum(
        g.in_features * g.out_features * g.count for g in linears
    )
    tables = shape.embedding_params + shape.head_params
    cut = tables - tables // tp if vocab else 0
    return replace(
        shape,
        heads=shape.heads // tp,
        kv_heads=shape.kv_heads // tp,
        intermediate=shape.intermediate // tp,
        linears=linears,
        total_params=shape.total_params - split - cut,
        embedding_params=shape.embedding_params // tp if vocab else shape.embedding_params,
        head_params=shape.head_params // tp if vocab else shape.head_params,
        vocab=-(-shape.vocab // tp) if vocab and local_logits else shape.vocab,
    )


def plan_tensor_split(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, **kw: Any) -> Estimate:
    """The plan of setup.gpus processes as setup.tp ranks x replicas (see the module)."""
    tp, world = setup.tp, setup.gpus
    if world % tp:
        raise PlanError(
            f"distributed.tensor_parallel={tp} on {world} GPUs: the GPUs must be ranks x replicas",
            hint=f"plan with --gpus {tp} (or a multiple)",
        )
    replicas = world // tp  # the processes holding one share: data-parallel replicas x context-parallel ranks
    one = replace(
        setup,
        gpus=replicas,
        sharding=DDP.name,
        tp=1,
        positions_split=tp if setup.sp else 1,
        fp32_absmax=row_shares(tp),
        tables_at_load=tp if setup.vp and shape.vocab % tp else 1,  # tensor.reads_vocab_rows: else cut after the load
    )
    layout = Layout(1, replicas // setup.cp, 0, tp=tp, cp=setup.cp)
    same_share = [i * tp for i in range(replicas)]  # tp rank 0 of every replica and context-parallel rank
    # cp x tp: a share's rank runs its part of every sequence (plan/context.py), over the share's heads
    plan = plan_context_split if setup.cp > 1 else estimate
    rank_shape = tensor_rank_shape(shape, tp, vocab=setup.vp, local_logits=setup.loss_rows > 0)
    e = plan(rank_shape, recipe, one, gpu and _as_seen_by(gpu, same_share), **kw)
    parts, step = dict(e.step_time_parts), e.step_time_s
    reduced = part_setup(setup)
    hidden_states = reduced.rows * reduced.seq_len * shape.hidden * recipe.compute_bytes  # one micro-batch's (part)
    if gpu is not None:
        parts["tensor_allreduce"] = tensor_allreduce_s(shape, recipe, reduced, _as_seen_by(gpu, layout.tensor_ranks(0)))
        step += parts["tensor_allreduce"]
    many = f"{replicas // setup.cp} replica{'s' if replicas > setup.cp else ''}"
    split = f"{setup.cp} context-parallel ranks x " if setup.cp > 1 else ""
    note = (
        f"tensor parallel: {tp} ranks x {split}{many}; each rank holds 1/{tp} of every "
        f"decoder linear and its LoRA, "
        + (f"1/{tp} of the embedding and head rows, the norms whole" if setup.vp else "the embeddings, head and norms whole")
        + f"; {_allreduces(shape, setup):.0f} all-reduces of "
        f"{hidden_states / 2**20:.1f} MiB per micro-batch on the GPU link"
    )
    return replace(
        e,
        shape=shape,
        setup=setup,
        step_time_s=step,
        step_time_parts=parts,
        host_ram_bytes=e.host_ram_bytes * tp,  # e counted one process per replica
        disk_bytes=e.disk_bytes + e.disk_parts.get("parked_activations", 0) * (tp - 1),  # each rank parks its own
        disk_parts={**e.disk_parts, "parked_activations": e.disk_parts.get("parked_activations", 0) * tp},
        gpu=gpu,
        trainable_params=trainable_params(shape, recipe),
        notes=[note, *e.notes],
    )


def row_shares(tp: int) -> tuple[str, ...]:
    """The linears whose shares keep their double-quant absmax in fp32 over tp ranks (model/partial.cut_from_whole):
    a row-parallel share's blocks are strided over the rows, never whole 256-block groups; a column-parallel share
    of a real model's weight is (every dimension a multiple of 256 x 64 x tp)."""
    return tuple(sorted(ROW)) if tp > 1 else ()


def _allreduces(shape: ModelShape, setup: Setup) -> float:
    """A micro-batch's tensor-parallel all-reduces over `shape`'s layers: after attention and after the MLP,
    in forward, backward and a checkpointed layer's recompute."""
    passes = 2 + setup.checkpointed_layers(shape.layers) / shape.layers
    # vp: the embeddings' sum in forward, the head's input gradient in backward (at most a micro-batch's positions)
    return 2 * shape.layers * passes + (2 if setup.vp else 0)


def tensor_allreduce_s(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec) -> float:
    """Seconds per step of the all-reduces of `shape`'s layers (a whole model, or a pipeline rank's part) over
    setup.tp ranks: each a ring of one micro-batch's hidden states on the GPU link, not overlapped."""
    tp = setup.tp
    hidden_states = setup.rows * setup.seq_len * shape.hidden * recipe.compute_bytes
    ring = 2 * (tp - 1) / tp * hidden_states / (gpu.interconnect_gbps * 1e9 * LINK_EFFICIENCY)
    return _allreduces(shape, setup) * ring * setup.grad_accum


def plan_setup(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, **kw: Any) -> Estimate:
    """The plan of any setup: a pipeline (of split stages or not), tensor or context parallelism, or one replica
    per GPU."""
    if setup.pp > 1:
        return plan_pipeline(shape, recipe, setup, gpu, **kw)
    if setup.tp > 1:
        return plan_tensor_split(shape, recipe, setup, gpu, **kw)
    if setup.cp > 1:
        return plan_context_split(shape, recipe, setup, gpu, **kw)
    return estimate(shape, recipe, setup, gpu, **kw)


def _as_seen_by(gpu: GpuSpec, ranks: list[int]) -> GpuSpec:
    """`gpu` with the link a group of these global ranks communicates over as its only link (the nodes' link
    where the group spans nodes): a rank's plan then costs its group's collectives on that link."""
    return replace(gpu, interconnect_gbps=gpu.link_gbps(ranks), gpus_per_node=0)


def _send_link(setup: Setup, gpu: GpuSpec) -> tuple[float, int]:
    """The slowest link a pipeline's sends cross (the nodes' link if any stage boundary spans two nodes), and how many
    sends share it at once: a stage's tensor-parallel ranks each send their whole hidden states to their peer of the
    next stage, all through the one nodes' link between the two (within a node each pair has its GPUs' own)."""
    pp, tp, cp = setup.pp, setup.tp, setup.cp
    layout = Layout(pp, setup.gpus // setup.ranks_per_replica, 0, tp=tp, cp=cp)
    boundaries = [
        (a, b)
        for t in range(tp)
        for c in range(cp)
        for r in range(layout.replicas)
        for a, b in zip(layout.pipeline_ranks(r, t, c), layout.pipeline_ranks(r, t, c)[1:])
    ]
    link = min((gpu.link_gbps(pair) for pair in boundaries), default=gpu.interconnect_gbps)
    return link, tp * cp if link < gpu.interconnect_gbps else 1


def near_even(layers: int, pp: int) -> tuple[int, ...]:
    """Decoder layers per stage as even as `pp` stages hold them, the first stages one fewer (the first holds the most
    micro-batches in flight, the embeddings too); () where they split evenly, or the count is unknown (0)."""
    if not layers or layers % pp == 0:
        return ()
    return tuple(layers // pp + (i >= pp - layers % pp) for i in range(pp))


def layout_choices(cfg: Any, shape: ModelShape, max_gpus: int, precision: str) -> tuple[tuple[int, int], ...]:
    """(pipeline stages, tensor-parallel ranks) the search may try for this recipe and model on up to max_gpus:
    the model's layers split into the stages (unevenly where they must: near_even), its heads and MLP into
    the ranks, and nothing in the recipe (objective, adapter, the precision it runs in: precision=auto's fp16 too) that a pipeline or a
    split refuses."""
    out = []
    for pp in range(1, max_gpus + 1):
        for tp in range(1, max_gpus // pp + 1):
            if pp * tp == 1 or pp > shape.layers or shape.model_type not in FAMILIES:
                continue
            if tp > 1 and (shape.heads % tp or shape.kv_heads % tp or shape.intermediate % tp):
                continue
            as_layout = cfg.model_copy(
                update={
                    "precision": precision,
                    "distributed": cfg.distributed.model_copy(
                        update={
                            PIPELINE.field: pp,
                            TENSOR.field: tp,
                            CONTEXT.field: 1,  # a recipe's split sequences give way to the layout tried
                            "strategy": "auto",
                            "grad_compression": "none",
                            "pipeline_schedule": "gpipe",
                            "virtual_stages": 1,
                            "pipeline_layers": "even",
                        }
                    ),
                    "memory": cfg.memory.model_copy(
                        update={"base_weights": "device", "embeddings": "device", "optimizer_offload": False}
                    ),
                }
            )
            if not split_problems(as_layout):
                out.append((pp, tp))
    return tuple(out)
