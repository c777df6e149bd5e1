"""Gradients summed and clipped by hand, for the layouts whose ranks hold different parts of the model and so
cannot use DDP's all-reduce or torch's clip_grad_norm_ as they are (a pipeline, tensor parallelism)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def sum_over(params: list[nn.Parameter], group: Any) -> None:
    """Each parameter's gradient summed over `group`, in one all-reduce of them all flattened (None: zeros)."""
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def squares(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squares, in fp64 on `device`."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum()
    return total


def clip_to(params: list[nn.Parameter], norm: float, max_norm: float) -> float:
    """Clipping to max_norm with the whole gradient's norm, by torch's rule (each scaled by max_norm / (norm + 1e-6))."""
    coef = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and coef < 1:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)
    return norm
