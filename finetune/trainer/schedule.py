"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to 0."""

from __future__ import annotations

import math

import torch

from finetune.config.schema import TrainConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then decay to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its value depends on the step alone, so a resume can recompute it: checkpoint.follow_schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, train.warmup_steps, total_steps, train.scheduler))
