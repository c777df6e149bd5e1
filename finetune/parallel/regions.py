"""Megatron-LM's f and g: where a tensor-parallel group's replicated work meets its split work.

    x = ToGroup.apply(x, group)      # into split work: the input as it is; its gradient summed over the group
    y = FromGroup.apply(y, group)    # out of split work: the ranks' partial results summed; the gradient as it is

tensor.py puts them around each attention and MLP, vocab.py around the embedding (g: each rank's rows) and the
head (f: each rank's columns of the logits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from finetune.parallel import waits


class ToGroup(torch.autograd.Function):
    """Megatron's f: the input, unchanged, to every rank's share; its gradient summed over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        with waits.collective(grad.device):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FromGroup(torch.autograd.Function):
    """Megatron's g: the ranks' partial outputs summed; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        with waits.collective(x.device):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
