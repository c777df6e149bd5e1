"""Sequence parallelism for a tensor-parallel group (distributed.sequence_parallel; Megatron-LM's, Korthikanti et
al. 2022): between the split attention and MLP, each rank holds 1/tp of every row's positions, so the norms, the
residual stream and the checkpointed layer inputs are each rank's share of the tokens, not whole on every rank.

    rows = pad_rows(batch, tp)                 # each row a multiple of tp positions (padding: never a target)
    hooks = split_sequence(model, group, tp)   # the positions split before the first layer, gathered after the norm

Where tensor parallelism (tensor.py) all-reduces the partial outputs of o and down and hands its input whole to q,
k, v, gate and up, here an all-gather along the sequence feeds the split linears (its backward: a reduce-scatter of
the partial input gradients) and a reduce-scatter replaces the all-reduce after them (its backward: an all-gather):
the same bytes on the link, in two halves. The attention itself sees the whole sequence (rotary angles and masks are
the whole rows'). A row's positions are split before the first decoder layer and gathered after the final norm, so
the head and the loss run as without it. The split applies to a forward that carries SPLIT_KEY (a batch pad_rows
made, in training and in the held-out loss); generation and any other forward run unsplit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune.data import IGNORE_INDEX, count_tokens
from finetune.parallel import waits

SPLIT_KEY = "sequence_split"  # the keyword a padded batch's forward carries to every decoder layer


def pad_rows(batch: dict[str, Any], tp: int) -> dict[str, Any]:
    """The batch with every row right-padded to a multiple of tp positions (labels never a target, the mask 0,
    positions continuing), its tokens counted as before, and SPLIT_KEY set."""
    ids = batch["input_ids"]
    pad = -ids.shape[1] % tp
    out = {**batch, "num_tokens": torch.tensor(count_tokens(batch)), SPLIT_KEY: True}
    if pad:
        out["input_ids"] = nn.functional.pad(ids, (0, pad), value=0)
        out["labels"] = nn.functional.pad(batch["labels"], (0, pad), value=IGNORE_INDEX)
        if "attention_mask" in batch:
            out["attention_mask"] = nn.functional.pad(batch["attention_mask"], (0, pad), value=0)
        if "position_ids" in batch:
            last = batch["position_ids"][:, -1:]
            out["position_ids"] = torch.cat([batch["position_ids"], last + 1 + torch.arange(pad, device=ids.device)], dim=1)
    return out


def _gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    with waits.collective(x.device):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _scattered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's sum of x, this rank's share of the positions (a reduce-scatter along dim 1)."""
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=1)]
    out = torch.empty_like(parts[0])
    with waits.collective(x.device):
        dist.reduce_scatter(out, parts, group=group)
    return out


def _own(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


def _region(forward: Callable, backward: Callable, doc: str) -> Any:
    """An autograd function of one collective along the positions and its adjoint in backward."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            return backward(grad, ctx.group), None

    Region.__doc__ = doc
    return Region


# (forward, backward): Megatron's regions, named by where they lead
_Split = _region(_own, _gathered, "Into the split region: this rank's positions of a whole (replicated) tensor.")
_Join = _region(_gathered, _own, "Into replicated work (head, loss): every rank's identical loss hands each its share.")
_ToShares = _region(_gathered, _scattered, "Megatron's g: gathered for the split linears; their partial gradients summed.")
_FromShares = _region(_scattered, _gathered, "Megatron's g-bar: the split linears' partial outputs summed, by position.")


class SequenceSplit:
    """The hooks of one model. A split forward carries SPLIT_KEY to every decoder layer, which hands its keywords to
    its attention: the attention's hook takes it and marks the layer split, for the attention and the MLP after it
    (also in a checkpointed layer's recomputation, which runs the layer's forward without the layer's own hooks:
    transformers checkpoints `forward`, the attention's hooks inside it). The first layer's hook splits the rows'
    positions; the final norm's gathers them after a split forward."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.active = False  # the decoder layer running now is split

    def first_layer_in(self, module: nn.Module, args: tuple, kwargs: dict):
        if not kwargs.get(SPLIT_KEY):
            return None
        if args:
            return (_Split.apply(args[0], self.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _Split.apply(kwargs["hidden_states"], self.group)}

    def attention_in(self, module: nn.Module, args: tuple, kwargs: dict):
        self.active = bool(kwargs.pop(SPLIT_KEY, False))  # never reaches the attention function
        return self._into(args, kwargs)

    def mlp_in(self, module: nn.Module, args: tuple, kwargs: dict):
        return self._into(args, kwargs)

    def _into(self, args: tuple, kwargs: dict):
        if not self.active:
            return args, kwargs
        if args:
            return (_ToShares.apply(args[0], self.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _ToShares.apply(kwargs["hidden_states"], self.group)}

    def from_shares(self, module: nn.Module, args: tuple, output: Any):
        if not self.active:
            return None
        if isinstance(output, tuple):  # attention: (output, weights)
            return (_FromShares.apply(output[0], self.group), *output[1:])
        return _FromShares.apply(output, self.group)

    def after_norm(self, module: nn.Module, args: tuple, output: torch.Tensor):
        if not self.active:
            return None
        self.active = False
        return _Join.apply(output, self.group)
