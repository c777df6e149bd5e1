"""Data order: which examples each process trains on at each optimizer step.

A pure function of (seed, epoch, step): a resumed run recomputes its position
instead of replaying the data, and every process agrees without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from finetune.config.schema import RecipeConfig
from finetune.data import Collator, length_grouped
from finetune.errors import DataError


class DataOrder:
    def __init__(self, train: Sequence[dict], cfg: RecipeConfig, collate: Collator, rank: int, world: int, device: torch.device):
        self.train, self.cfg, self.collate = train, cfg, collate
        self.rank, self.world, self.device = rank, world, device
        self.window = cfg.train.batch_size * cfg.train.grad_accum * world
        self.steps_per_epoch = len(train) // self.window
        self._cached: tuple[int, list[int]] | None = None

    @property
    def unit(self) -> str:
        """What one item of the train set is: an example, a packed row of several, or a preference pair."""
        if getattr(self.train, "unit", None):  # preference pairs (PreferencePairs, or with a precomputed reference)
            return self.train.unit  # type: ignore[attr-defined]
        return "packed rows" if getattr(self.train, "packed", False) else "examples"

    @property
    def untrained_per_epoch(self) -> str:
        """What an epoch leaves out (the tail of its order, fewer than a step), said on the training line."""
        left = len(self.train) - self.steps_per_epoch * self.window
        return f"; the last {left} {self.unit} of each epoch's order do not fill a step and are not trained" if left else ""

    def total_steps(self) -> int:
        """The run's length in optimizer steps: train.max_steps, or train.epochs of this launch's steps."""
        cfg = self.cfg
        if self.steps_per_epoch == 0:
            raise DataError(
                f"data.path: the train set has {len(self.train)} {self.unit}, fewer than one optimizer step needs "
                f"(train.batch_size {cfg.train.batch_size} x train.grad_accum {cfg.train.grad_accum} x "
                f"{self.world} processes = {self.window})",
                hint="lower train.batch_size or train.grad_accum, or add data",
            )
        return cfg.train.max_steps or cfg.train.epochs * self.steps_per_epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """Example order of an epoch. Kept for the current epoch: step_batches asks for it every
        step, and a permutation of a large dataset is not free."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n = len(self.train)
        if not self.cfg.data.shuffle:
            order = list(range(n))
        else:
            g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
            order = torch.randperm(n, generator=g).tolist()
        if self.cfg.data.group_by_length:
            # Groups of 64 micro-batches: wide enough to find similar lengths, narrow enough to stay random.
            train = self.train
            lengths = train.lengths() if hasattr(train, "lengths") else [len(ex["input_ids"]) for ex in train]
            order = length_grouped(order, lengths, 64 * self.cfg.train.batch_size)
        self._cached = (epoch, order)
        return order

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The grad_accum micro-batches this process trains on at optimizer step `step`."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        bs = self.cfg.train.batch_size
        start = index * self.window
        batches = []
        for micro in range(self.cfg.train.grad_accum):
            base = start + micro * bs * self.world + self.rank * bs
            ids = order[base : base + bs]
            batch = self.collate([self.train[i] for i in ids])
            batches.append({k: v.to(self.device) for k, v in batch.items()})
        return batches
