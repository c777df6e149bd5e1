"""distributed.context_parallel in the plan: each rank planned as the part of every sequence it runs.

A context-parallel group's N ranks (finetune/parallel/context.py) train the same rows, each sequence padded
to 2N chunks and split zig-zag (rank r: chunks r and 2N-1-r, the same causal work on every rank), plus one
extra token per rank: every rank runs seq/N + 1 tokens through the whole model (embeddings, every layer, the
chunked loss), so everything that grows with the sequence (activations, checkpointed inputs and their host-RAM
copies, the loss's buffers) is the single-GPU term at seq/N + 1 tokens. Each rank holds the whole model (or
streams its own copy of the 4-bit layers from host RAM), and sums its gradients with every other process
after the window: the weights, adapter, AdamW state and the summed buffer are those of `gpus` DDP processes
(under distributed.strategy=fsdp, those of `gpus` FSDP processes: each holds its shards).
What no single-GPU plan has (finetune/parallel/ring.py):

  ring      K/V blocks travel around the group: N - 1 hops in forward (and again in a checkpointed layer's
            recompute), overlapped with the attention of the block in hand, so a layer's pass takes the larger
            of its attention and its hops; backward sends K/V N - 1 times and the fp32 dK/dV accumulators N
            times. One ring per K/V head and its query heads, so the memory while a layer's attention runs
            backward is one head group's: its block in hand and the one arriving, fp32 dQ, the fp32 dK/dV
            accumulators in hand and arriving, and on a GPU one chunk pair's K/V repeated to the group's query
            heads for the flash kernel, with that pair's gradients.
  ulysses   all-to-alls trade the sequence split for a head split (heads/N heads over the whole sequence;
            K/V heads repeated to every head when they do not divide): (N - 1)/N of q, k, v and out cross the
            link per layer and pass, not overlapped; the copies sent and received are the buffers.

A layer's attention runs backward after its MLP, whose tensors (and the second norm's input) are gone by
then: memory.estimate plans that moment as a third phase (the buffers, the layer's attention tensors, their
gradients) beside the end of forward and the MLP's backward.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from finetune.declarations.layout import Layout
from finetune.declarations.splits import CONTEXT
from finetune.declarations.splits import problems as split_problems
from finetune.declarations.strategies import DDP
from finetune.errors import PlanError
from finetune.gpus import GpuSpec
from finetune.plan.inputs import RecipeFacts, Setup
from finetune.plan.memory import Estimate, estimate
from finetune.plan.shape import ModelShape
from finetune.plan.speed import LINK_EFFICIENCY, MATMUL_EFFICIENCY, token_flops
from finetune.plan.terms import layer_saved_bytes_per_token

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the linears whose LoRA inputs a layer's attention keeps


def rank_tokens(seq_len: int, cp: int) -> tuple[int, int]:
    """(tokens of a rank's part of one sequence: two of the 2N chunks it is padded to; what it runs: one more)."""
    part = 2 * math.ceil(seq_len / (2 * cp))
    return part, part + 1


def part_setup(setup: Setup) -> Setup:
    """`setup` as one context-parallel rank's part of each sequence sees it (its tokens a row), or itself without cp."""
    return replace(setup, seq_len=rank_tokens(setup.seq_len, setup.cp)[1]) if setup.cp > 1 else setup


def attention_shape(shape: ModelShape, setup: Setup) -> ModelShape:
    """The model as a rank's attention holds it: Ulysses repeats K/V heads that do not divide over the ranks."""
    repeats = setup.cp_mode == "ulysses" and shape.kv_heads % setup.cp
    return replace(shape, kv_heads=shape.heads) if repeats else shape


def buffer_bytes_per_token(shape: ModelShape, recipe: RecipeFacts, setup: Setup) -> int:
    """A split attention's buffers per token of a rank's part, at their largest (a layer's backward)."""
    b, qd, kvd = recipe.compute_bytes, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if setup.cp_mode == "ulysses":
        return 2 * b * (2 * qd + 2 * kvd)  # q, k, v, out: the copy sent and the one received
    # ring.py runs one ring per K/V head and its query heads: a ring's buffers are one head group's.
    qd, kvd = qd // shape.kv_heads, kvd // shape.kv_heads
    # The K/V in hand and the one arriving; on a GPU a chunk pair's K/V repeated to every query head of the
    # group (one chunk: half the part) for the flash kernel; the layer's fp32 log-sum-exp.
    pair = qd * b if shape.kv_heads < shape.heads else 0
    forward = 2 * 2 * kvd * b + pair + qd * b // 2 + 4 * qd + 4 * shape.heads  # + a pair's output, fp32 out, lse
    # backward: fp32 dQ; the K/V pair; the fp32 dK/dV accumulators in hand and arriving; a pair's K/V repeated,
    # its dQ and its (repeated) dK, dV from the kernel
    backward = 4 * qd + 2 * 2 * kvd * b + 2 * 2 * 4 * kvd + pair + qd * b // 2 + (qd * b if pair else 2 * kvd * b // 2)
    return max(forward, backward) + 4 * shape.heads


def attention_rebuilt_bytes_per_token(shape: ModelShape, recipe: RecipeFacts, setup: Setup) -> int:
    """What one layer holds while its attention runs backward: its first norm's input, the attention's saved
    tensors and their LoRA inputs (rebuilt, when the layer is checkpointed), and the gradients of the attention's
    output and of the residual stream."""
    grads = recipe.compute_bytes * (shape.hidden + shape.heads * shape.head_dim)
    if not setup.checkpointed_layers(shape.layers):
        return grads  # the layer's tensors are among the activations kept already
    only = replace(shape, intermediate=0, linears=tuple(g for g in shape.linears if g.name in ATTENTION))
    return layer_saved_bytes_per_token(only, recipe, setup.rows) - 4 * shape.hidden + grads  # less the MLP's norm


def plan_context_split(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, **kw: Any) -> Estimate:
    """The plan of setup.gpus processes as setup.cp ranks x replicas (see the module)."""
    cp, world, mode = setup.cp, setup.gpus, setup.cp_mode
    if world % cp:
        raise PlanError(
            f"distributed.context_parallel={cp} on {world} GPUs: the GPUs must be context-parallel ranks x replicas",
            hint=f"plan with --gpus {cp} (or a multiple)",
        )
    if mode == "ulysses" and shape.heads % cp:
        raise PlanError(
            f"distributed.context_parallel={cp} with context_parallel_mode=ulysses: the model's {shape.heads} attention "
            f"heads do not divide over {cp} ranks",
            hint="set distributed.context_parallel_mode=ring (any head count), or a context_parallel that divides the heads",
        )
    part, local = rank_tokens(setup.seq_len, cp)
    seen = attention_shape(shape, setup)
    sharded = setup.strategy.wraps_layers  # cp x FSDP: FSDP's shards over every process, else DDP's replicas
    one = replace(setup, seq_len=local) if sharded else replace(setup, seq_len=local, sharding=DDP.name, cpu_offload=False)
    tokens = setup.rows * local
    e = estimate(
        seen,
        replace(recipe, attention="context_parallel"),  # its own attention: no T x T mask, no K/V repeated for one
        one,
        gpu,
        attention_buffers=tokens * buffer_bytes_per_token(seen, recipe, setup),
        attention_rebuilt=tokens * attention_rebuilt_bytes_per_token(seen, recipe, setup),
        **kw,
    )
    parts, step = dict(e.step_time_parts), e.step_time_s
    if gpu is not None:
        parts, step = _with_split_attention(seen, recipe, setup, one, gpu, e.trainable_params, parts, step)
    replicas = world // cp
    note = (
        f"context parallel ({mode}): each sequence of {setup.seq_len:,} tokens over {cp} ranks x {replicas} "
        f"replica{'s' if replicas > 1 else ''}; each rank runs {local:,} tokens (2 of {2 * cp} chunks + 1) and holds "
        + (f"1/{world} of the weights (FSDP: a layer gathered at a time)" if sharded else "the weights it runs whole")
        + f"; gradients summed over {world} processes"
    )
    return replace(e, shape=shape, setup=setup, step_time_s=step, step_time_parts=parts, notes=[note, *e.notes])


def _with_split_attention(
    shape: ModelShape,
    recipe: RecipeFacts,
    setup: Setup,
    one: Setup,
    gpu: GpuSpec,
    trainable: int,
    parts: dict[str, float],
    step: float,
) -> tuple[dict[str, float], float]:
    """(parts, step) of a rank with its attention over the whole sequence: one's plan attends over its own tokens
    only; add the rest of the span, and the link time the ring cannot hide or Ulysses' all-to-alls."""
    cp, rate, m = setup.cp, gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY, setup.grad_accum
    part, local = rank_tokens(setup.seq_len, cp)
    tokens = setup.rows * local
    whole, own = (token_flops(shape, recipe, one, trainable, seq_len=span) for span in (cp * part, local))
    extra = tokens * (whole.model + whole.recompute - own.model - own.recompute) / rate * m
    replayed = tokens * (whole.recompute - own.recompute) / rate * m
    link = gpu.link_gbps(Layout(1, setup.gpus // cp, 0, cp=cp).context_ranks()) * 1e9 * LINK_EFFICIENCY
    b, kvd, qd = recipe.compute_bytes, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    ckpt = setup.checkpointed_layers(shape.layers) / shape.layers  # the share of layers whose forward reruns
    if setup.cp_mode == "ulysses":
        sent = (cp - 1) / cp * tokens * b * (2 * qd + 2 * kvd) / link  # one pass of one layer
        traffic = exposed = shape.layers * (2 + ckpt) * sent * m
    else:
        block = setup.rows * part * 2 * kvd  # a rank's K and V, elements
        hops_f, hops_b = (cp - 1) * block * b / link, ((cp - 1) * block * b + cp * block * 4) / link
        attention_f = tokens * 2 * cp * part * qd / rate  # one layer's attention forward; backward ~2x
        traffic = shape.layers * ((1 + ckpt) * hops_f + hops_b) * m
        hidden = (1 + ckpt) * max(0.0, hops_f - attention_f) + max(0.0, hops_b - 2 * attention_f)
        exposed = shape.layers * hidden * m
    parts = {
        **parts,
        "compute": parts["compute"] + extra,
        "recompute": parts["recompute"] + replayed,
        "context_traffic": traffic,
        "context_exposed": exposed,
    }
    return parts, step + extra + exposed


def context_choices(cfg: Any, shape: ModelShape, max_gpus: int) -> tuple[int, ...]:
    """Context-parallel ranks the search may try on up to max_gpus when the recipe asks distributed.context_parallel:
    every count the recipe runs with (declarations/layout.py's rules) and the model's heads divide under Ulysses."""
    if not CONTEXT.asked(cfg):
        return ()
    out = []
    for cp in range(2, max_gpus + 1):
        if cfg.distributed.context_parallel_mode == "ulysses" and shape.heads % cp:
            continue
        as_layout = CONTEXT.resized(cfg, cp)
        if not split_problems(as_layout):
            out.append(cp)
    return tuple(out)
