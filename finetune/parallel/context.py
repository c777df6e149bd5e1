"""Context parallelism (distributed.context_parallel): each sequence split over the N ranks of a group along
its length, so that a rank's activations are those of seq/N tokens. (TRL's and axolotl's ring attention,
DeepSpeed-Ulysses; torch's own context_parallel dispatches only CUDA kernels, so the ring here is ours, on
torch.distributed point-to-point, and runs on CPUs with gloo too.)

    cp = ContextParallel(accelerator, cfg, layout)   # the room: a process group per context-parallel group
    cp.shard(model, dtype)                  # our attention: the ring or Ulysses for split rows, varlen otherwise
    part = cp.local_part(batch)             # this rank's tokens of every row, and how the rows are split

The ranks of a group train the same rows (the data order counts the group as one replica) and each holds
the whole model (under distributed.strategy=fsdp, ShardedContext: FSDP's shards); each rank's loss is summed over
its own targets and the gradients are summed over every process after the window's backward (sync_gradients; under
FSDP its reduce-scatter, set to a sum), so the step's loss stays the token mean of the whole window. A preference
loss scores whole rows: each rank's per-row sums are added over the group (whole_row_sums) and every rank computes
the pairs' loss from them; GRPO's group samples on its first rank (objectives/grpo.py) and each rank trains its part.
No DDP wrapper: each rank may stream its own copy of the layers from host RAM (memory.base_weights=cpu), as one
process does, which is what lets a rank's part reach one card's length.

A part carries one token more than its share: labels are shifted before the split (a token's target may
lie on another rank), and the loss shifts them once more by position; the extra last token takes the last
target's place in that shift. It attends only to itself and predicts nothing.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from finetune.data import IGNORE_INDEX, count_tokens
from finetune.declarations.layout import Layout
from finetune.declarations.splits import CONTEXT, TENSOR
from finetune.declarations.strategies import of_recipe
from finetune.errors import ConfigError
from finetune.hardware import release_free_heap
from finetune.model import varlen
from finetune.parallel.fsdp import full_optimizer_state, full_trainable_state, place_sharded, shard_model
from finetune.parallel.grads import sum_over
from finetune.parallel.mesh import dim_group
from finetune.parallel.ring import SplitRows, expand_heads, ring_attention, ulysses_attention
from finetune.parallel.room import SplitRoom
from finetune.parallel.sequence import pad_rows
from finetune.parallel.tensor import TensorParallel

NAME = "context_parallel"
KEY = "context_part"  # the keyword a part travels under, from the model's forward to every attention call
# A batch's values of whole rows, kept as they are: a preference pair's precomputed reference; GRPO's advantages
# and the sampling's metric sums.
WHOLE_ROW_KEYS = ("reference_logps", "advantages", "sample_sums")
TARGET_KEYS = ("old_logps", "ref_logps")  # GRPO's per-target values (rows, length - 1), aligned with labels[:, 1:]: split


@dataclass(frozen=True)
class ContextPart:
    """What every attention call of one split forward needs: how the rows are split, the mode, and the rows'
    position_ids in sequence order (Ulysses attends over whole rows: its packed examples are cut from them)."""

    split: SplitRows
    mode: str
    positions: torch.Tensor
    length: int  # the rows' tokens before the split padded them
    extra: int = 1  # tokens after the part: the one that takes the last target's place, and sequence parallelism's padding

    def __repr__(self) -> str:  # printed in error messages of the model's forward; the tensors are not
        return f"ContextPart(rank {self.split.index} of {self.split.size}, {self.mode})"


def register() -> str:
    """Make our attention a transformers attention implementation, with the mask function varlen uses
    (the 2D padding mask or none: the split rows never take a 4-D mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: a forward of split rows (the part under KEY) attends over the whole
    sequence; any other (held-out loss, generation) is varlen's attention of the rows as given."""
    part: ContextPart | None = kwargs.pop(KEY, None)
    if part is None:
        return varlen.varlen_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    window = kwargs.get("sliding_window")  # Mistral passes its window even where it spans every row
    if (
        kwargs.get("softcap")
        or (window and window < part.length)
        or kwargs.get("s_aux") is not None
        or (dropout and module.training)
    ):
        raise ValueError(
            "distributed.context_parallel splits plain causal attention; this model's attention also needs "
            "logit softcapping, a sliding window, sinks or dropout. Set distributed.context_parallel=1."
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    n = part.extra
    q, k, v = query[:, :, :-n], key[:, :, :-n], value[:, :, :-n]
    if part.mode == "ulysses":
        out = ulysses_attention(q, k, v, part.split, scale, _whole_rows(module, part, scale))
    else:
        out = ring_attention(q, k, v, part.split, scale)
    extra = expand_heads(value[:, :, -n:], query.shape[1])  # each extra token sees only itself
    return torch.cat([out, extra.to(out.dtype)], dim=2).transpose(1, 2).contiguous(), None


def _whole_rows(module, part: ContextPart, scale: float):
    """Attention over whole rows in sequence order: causal for plain rows (padding lies after every real
    token), each packed example on its own (varlen's cuts from the rows' position_ids)."""

    def attend(q, k, v, segments):
        if segments is None:
            gqa = k.shape[1] != q.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out, _ = varlen.varlen_attention(module, q, k, v, None, 0.0, scale, position_ids=part.positions)
        return out.transpose(1, 2)

    return attend


class ContextParallel(SplitRoom):
    """This rank's context-parallel group and how it splits a batch; with tensor parallelism (cp x tp), each rank of
    the group holds its tensor-parallel share of every layer, and the share's room answers for the weights."""

    name = "context"
    trains_alone = True  # each rank holds and streams its own copy of the layers (no DDP wrapper holds them)

    def __init__(self, accelerator, cfg: Any, layout: Layout, mesh: Any = None, tensor: TensorParallel | None = None) -> None:
        super().__init__(accelerator, cfg, layout, mesh)
        self.mode = cfg.distributed.context_parallel_mode
        self.ranks = tuple(layout.context_ranks())
        self.group = dim_group(mesh, "cp")  # this rank's context-parallel group
        self.tensor = tensor  # tensor parallelism: each rank's share of the layers (parallel/tensor.py)

    @classmethod
    def build(cls, accelerator, cfg: Any, layout: Layout, model_config: Any, mesh: Any) -> ContextParallel:
        tensor = TensorParallel(accelerator, cfg, layout, model_config, mesh) if TENSOR.asked(cfg) else None
        return cls(accelerator, cfg, layout, mesh, tensor)

    @classmethod
    def variant(cls, cfg: Any) -> type[ContextParallel]:
        return ShardedContext if of_recipe(cfg).wraps_layers else cls

    @classmethod
    def problems(cls, cfg: Any, accelerator) -> list[str]:
        return runtime_problems(cfg, accelerator.device)

    @property
    def size(self) -> int:
        return self.layout.cp

    def describe(self) -> str:
        replicas = self.layout.replicas
        many = f"{replicas} replica{'s' if replicas > 1 else ''}"
        vocab = ", the vocabulary too" if self.cfg.distributed.vocab_parallel else ""
        shares = f" x {self.layout.tp} tensor-parallel ranks (each layer split{vocab})" if self.tensor is not None else ""
        return f"parallel: context parallel ({self.mode}), each sequence split over {self.size} processes{shares} x {many}"

    def shard(self, model, compute_dtype: torch.dtype):
        """Our attention in every layer of the model (whatever it was loaded with), over this rank's share."""
        if self.tensor is not None:
            model = self.tensor.shard(model, compute_dtype)
        return split_attention(model)

    def local_part(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of every row of a collated batch (see the module's docstring); under sequence parallelism
        (cp x tp with sp) padded to a multiple of the tensor-parallel ranks, whose hooks split its positions."""
        sp = self.tensor is not None and self.cfg.distributed.sequence_parallel
        part = split_batch(batch, self.ranks, self.layout.cp_rank, self.group, self.mode)
        return pad_part(part, self.layout.tp) if sp else part

    def row_group(self) -> tuple[Any, int] | None:
        return (self.group, self.ranks[0]) if self.size > 1 else None

    @property
    def counts_window(self) -> bool:
        return self.tensor is None or self.tensor.counts_window  # a share's group computes one loss: its first counts

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        if self.tensor is not None:  # the share's partial gradients over its group, then over the parts and replicas
            self.tensor.sum_gradients(params)
        else:
            sum_over(params, None)  # every rank's gradient is of its own part of the rows (and replicas')

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        if self.tensor is not None:
            return self.tensor.clip_grad_norm(params, max_norm)
        return super().clip_grad_norm(params, max_norm)

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        return self.tensor.full_states(model, optimizer) if self.tensor is not None else (None, None)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return self.tensor.full_weights(model) if self.tensor is not None else None


class ShardedContext(ContextParallel):
    """cp x FSDP (distributed.strategy=fsdp): each rank holds FSDP's shard of every layer (gathered for its forward,
    as any FSDP process's) and its part of every row. The gradients' reduce-scatter sums over every process (the
    parts and the replicas) instead of averaging, as the context room's own all-reduce does, so the step's loss
    stays the token mean of the window."""

    sharded = True
    wraps_layers = True
    trains_alone = False  # one shard per process: the memory rules see FSDP's processes, not one

    @classmethod
    def problems(cls, cfg: Any, accelerator) -> list[str]:
        from torch.distributed.fsdp import FSDPModule

        old = not hasattr(FSDPModule, "set_force_sum_reduction_for_comms")  # torch >= 2.8
        need = f"{CONTEXT.said(cfg)} with distributed.strategy=fsdp sums FSDP's reduce-scatter (torch >= 2.8); this is torch "
        return super().problems(cfg, accelerator) + ([f"{need}{torch.__version__}. Upgrade torch."] if old else [])

    def describe(self) -> str:
        return f"{super().describe()}, the weights sharded over all {self.accelerator.num_processes} (FSDP)"

    def load_device(self, device: torch.device, streaming: bool) -> torch.device:
        return torch.device("cpu")  # as FSDP: the whole model read in CPU RAM, only this rank's shard moves

    def shard(self, model, compute_dtype: torch.dtype):
        from torch.distributed.fsdp import FSDPModule

        model = super().shard(model, compute_dtype)  # our attention first: FSDP's units wrap the layers as they are
        shard_model(model, self.cfg, compute_dtype)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a sum: each part's gradient is of its own targets
                module.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM (which gloo lacks)
        place_sharded(model, self.accelerator.device, keep_params_on_cpu=self.cfg.distributed.cpu_offload)
        release_free_heap()
        return model

    def gradient_sync(self, model, last: bool):
        model.set_requires_gradient_sync(last)  # the window's last micro-batch reduce-scatters
        return nullcontext()

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """FSDP summed them in the last backward."""

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        return full_trainable_state(model), full_optimizer_state(optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return full_trainable_state(model)


def split_attention(model):
    """`model` with our attention in every layer (whatever it was loaded with): a forward given a part attends over
    the whole sequence (ContextParallel's, a pipeline's stages under cp x pp)."""
    from finetune.model.load import head_owner

    owner: Any = head_owner(model) or model
    owner.set_attn_implementation(register())
    if owner.config._attn_implementation != NAME:  # transformers only warns for a class that cannot switch
        raise ConfigError(
            [
                f"distributed.context_parallel: {type(owner).__name__} cannot take a registered attention "
                "function (transformers' attention interface), so its layers would attend within each part "
                "only. Set distributed.context_parallel=1."
            ]
        )
    return model


def split_batch(batch: dict[str, Any], ranks: tuple[int, ...], index: int, group: Any, mode: str) -> dict[str, Any]:
    """The part of `batch` that ranks[index] holds: rows right-padded to 2N chunks, labels shifted first."""
    ids, labels = batch["input_ids"], batch["labels"]
    rows, length = ids.shape
    chunk = math.ceil(length / (2 * len(ranks)))
    pad = 2 * len(ranks) * chunk - length
    packed = "position_ids" in batch
    positions = batch["position_ids"] if packed else torch.arange(length, device=ids.device).expand(rows, length)
    positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(pad, device=ids.device)], dim=1)
    ids = torch.nn.functional.pad(ids, (0, pad), value=0)  # padding: after every real token, never a target
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, : length - 1] = labels[:, 1:]
    segments = varlen.restarts(positions).long().cumsum(dim=1) if packed else None  # the example of each token
    split = SplitRows(ranks, index, chunk, segments, group)
    mine = split.positions_of(split.index, ids.device)
    one = torch.zeros(rows, 1, dtype=torch.long, device=ids.device)
    return {
        "input_ids": torch.cat([ids[:, mine], one], dim=1),
        "position_ids": torch.cat([positions[:, mine], one], dim=1),
        "labels": torch.cat([torch.full_like(one, IGNORE_INDEX), targets[:, mine]], dim=1),
        "num_tokens": torch.tensor(count_tokens(batch) if split.index == 0 else 0),  # the group's tokens, counted once
        KEY: ContextPart(split, mode, positions, length),
        **{k: batch[k] for k in WHOLE_ROW_KEYS if k in batch},
        **{k: _padded(batch[k], ids.shape[1])[:, mine] for k in TARGET_KEYS if k in batch},  # as targets[:, mine]
    }


def pad_part(part: dict[str, Any], multiple: int) -> dict[str, Any]:
    """A part with tokens added after its extra one (never a target, attending only to themselves: ContextPart.extra)
    to a multiple of `multiple` positions, and sequence parallelism's SPLIT_KEY: its tensor-parallel group splits them."""
    out = pad_rows(part, multiple)  # the ids, labels and positions padded as tensor parallelism pads whole rows
    pad = out["input_ids"].shape[1] - part["input_ids"].shape[1]
    targets = {k: torch.nn.functional.pad(part[k], (0, pad)) for k in TARGET_KEYS if k in part}
    return {**out, **targets, KEY: replace(part[KEY], extra=1 + pad)}


def _padded(values: torch.Tensor, width: int) -> torch.Tensor:
    """Per-target values (rows, length - 1) laid out as split_batch's targets: zeros after them, `width` wide."""
    out = values.new_zeros(values.shape[0], width)
    out[:, : values.shape[1]] = values
    return out


def whole_row_sums(part: ContextPart, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sums of a part (a row's log-probability, its target count) as the whole rows' sums: the group's
    parts added. Every rank then computes the same pairs' loss and counts its pairs; the sum's backward adds
    the group's gradients of it, so each part's gradient is the whole loss's (the units counted once per rank
    divide it back), and sync_gradients sums the parts."""
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(sums, group=part.split.group), whole_row_counts(part, counts)


def whole_row_counts(part: ContextPart, counts: torch.Tensor) -> torch.Tensor:
    """Per-row counts of a part (its targets) as the whole rows': the group's parts added (no gradient)."""
    counts = counts.clone()
    dist.all_reduce(counts, group=part.split.group)
    return counts


def problems(config: Any, cfg: Any) -> list[str]:
    """What this model's attention cannot split as distributed.context_parallel asks (config: its text config)."""
    n, mode = cfg.distributed.context_parallel, cfg.distributed.context_parallel_mode
    if n <= 1:
        return []
    asked = f"distributed.context_parallel={n}"
    fix = "Set distributed.context_parallel=1."
    out = [f"{asked}: {why}. {fix}" for why in _unsplittable(config, cfg.data.max_seq_len)]
    tp = TENSOR.size(cfg)
    heads = config.num_attention_heads // tp  # a rank's share of them under tensor parallelism
    if mode == "ulysses" and heads % n:
        fits = [d for d in range(2, heads + 1) if heads % d == 0][:6]
        whose = f"the model's {heads} attention heads" if tp == 1 else f"the {heads} attention heads of a tensor-parallel share"
        out.append(
            f"{asked} with context_parallel_mode=ulysses: {whose} do not divide over "
            f"{n} ranks (values that do: {', '.join(map(str, fits)) or 'none'}). Set context_parallel_mode=ring (any head "
            "count), or one of those values."
        )
    return out


def _unsplittable(config: Any, seq_len: int) -> list[str]:
    """What in a model's attention or positions a split sequence would compute wrongly."""
    out = []
    why = varlen.unsupported(config)
    if why:
        out.append(f"{why} (the split attention neither)")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        window and getattr(config, "use_sliding_window", True) and window < seq_len
    ):
        out.append(f"{config.model_type} attends within a sliding window of {window} tokens, which the split attention does not")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("dynamic", "longrope"):  # each rank would pick the frequencies of its own largest position
        out.append(f"{config.model_type}'s rotary scaling ({kind}) depends on the longest position a forward sees")
    if getattr(config, "attention_dropout", 0.0):
        out.append(f"attention dropout ({config.attention_dropout}) is not split; set the model's attention_dropout to 0")
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        out.append("a mixture-of-experts router's load-balancing loss would be each part's, not the sequence's")
    return out


def runtime_problems(cfg: Any, device: torch.device) -> list[str]:
    """What this GPU cannot run of the split (asked at launch, before loading)."""
    if cfg.distributed.context_parallel <= 1 or device.type != "cuda" or cfg.distributed.context_parallel_mode != "ring":
        return []
    asked = f"distributed.context_parallel={cfg.distributed.context_parallel} with context_parallel_mode=ring"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return [
            f"{asked} runs torch's flash attention kernel, which needs an Ampere or newer GPU. Set context_parallel_mode=ulysses."
        ]
    if cfg.data.packing:
        return [
            f"{asked} and data.packing: the ring keeps packed examples apart with masked blocks of chunk x chunk "
            "scores, too large on a GPU at long context. Set context_parallel_mode=ulysses (packed examples cut by "
            "varlen's flash kernel) or data.packing=false."
        ]
    return []
