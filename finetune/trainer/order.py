"""Data order: which examples each process trains on at each optimizer step.

A pure function of (seed, epoch, step) and the run's window: a resumed run recomputes its
position instead of replaying the data, and every process agrees without talking. The window
(examples per step, over every replica) is the run's for good: a resume on another number of
processes, or after an out-of-memory backoff, cuts the same window into other micro-batches,
so no example is trained twice or skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.data import Collator, length_grouped
from finetune.declarations import splits, strategies
from finetune.errors import ConfigError, DataError


@dataclass(frozen=True)
class Window:
    """How one optimizer step's examples are cut: micro_batch x accum x replicas = size."""

    micro_batch: int  # examples per forward on one process
    accum: int  # micro-batches per step
    replicas: int  # processes (or groups of them) that train different examples
    length_group: int  # data.group_by_length's width in examples: fixed for a run, so its order never changes

    @property
    def size(self) -> int:
        return self.micro_batch * self.accum * self.replicas

    @classmethod
    def of_recipe(cls, cfg: RecipeConfig, replicas: int) -> Window:
        b = cfg.train.batch_size
        return cls(b, cfg.train.grad_accum, replicas, 64 * b)  # 64 micro-batches: similar lengths, still random

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps of the window (trainer_state.json)."""
        return {
            "window": self.size,
            "micro_batch": self.micro_batch,
            "length_group": self.length_group,
            "replicas": self.replicas,
        }

    @classmethod
    def cut(cls, size: int, micro: int, replicas: int, length_group: int) -> Window | None:
        """`size` examples a step as micro-batches of `micro` on `replicas` replicas; None where no whole grad_accum does it."""
        accum, rest = divmod(size, micro * replicas)
        return None if rest or not accum else cls(micro, accum, replicas, length_group)

    @classmethod
    def resumed(cls, saved: dict[str, Any], cfg: RecipeConfig, replicas: int) -> Window:
        """The window of the run a checkpoint's trainer_state continues, on `replicas` replicas now: the
        recipe's micro-batch (or the smaller one an out-of-memory backoff left), grad_accum recomputed."""
        recipe = cls.of_recipe(cfg, replicas)
        if "window" not in saved and "oom_micro_batch" not in saved:  # a fresh start, or a checkpoint from before
            return recipe  # windows were kept: the recipe's
        size = int(saved.get("window", recipe.size))
        micro = min(recipe.micro_batch, *(int(saved[k]) for k in ("micro_batch", "oom_micro_batch") if k in saved))
        if saved.get("recipe", {}).get("train", {}).get("batch_size", recipe.micro_batch) != recipe.micro_batch:
            micro = recipe.micro_batch  # the user changed train.batch_size for this launch: theirs
        window = cls.cut(size, micro, replicas, int(saved.get("length_group", recipe.length_group)))
        if window is None:
            fits = [n for n in range(1, size + 1) if size % (micro * n) == 0]
            batches = [b for b in range(1, size // replicas + 1) if (size // replicas) % b == 0] if size % replicas == 0 else []
            raise ConfigError(
                [
                    f"resume: the run trains {size} examples per step; {replicas} replicas x train.batch_size {micro} "
                    f"cannot cut it into whole micro-batches (no integer train.grad_accum). It can go on with "
                    f"{' or '.join(map(str, fits))} replicas at batch_size {micro}"
                    + (f", or here with train.batch_size one of {', '.join(map(str, batches))}" if batches else "")
                    + " (resume_ignore_changes=true for a changed batch_size)."
                ]
            )
        problem = window.resume_problem(cfg)
        if problem:
            raise ConfigError([problem])
        return window

    def resume_problem(self, cfg: RecipeConfig) -> str | None:
        """Why this cut of the window cannot run, or None: DeepSpeed fixes its micro-batches from the recipe; a
        pipeline's schedule needs enough micro-batches a step (declarations/splits.py: window_problem)."""
        if (self.micro_batch, self.accum) == (cfg.train.batch_size, cfg.train.grad_accum):
            return None
        if strategies.of_recipe(cfg).deepspeed:
            return (
                f"resume: this run's {self.size} examples per step on {self.replicas} replicas need train.batch_size="
                f"{self.micro_batch} train.grad_accum={self.accum}; DeepSpeed takes its micro-batches from the recipe: "
                "set those two keys (with resume_ignore_changes=true)"
            )
        refused = [
            p for s in splits.SPLITS if s.window_problem and s.asked(cfg) for p in [s.window_problem(cfg, self.accum)] if p
        ]
        if not refused:
            return None
        return (
            f"resume: this run's {self.size} examples per step on {self.replicas} replicas come to {self.accum} "
            f"micro-batch(es) of {self.micro_batch} a step; distributed.pipeline_schedule={cfg.distributed.pipeline_schedule} "
            f"needs {refused[0]}. Set a smaller train.batch_size (with resume_ignore_changes=true), or resume on fewer processes"
        )

    def resume_note(self, saved: dict[str, Any], cfg: RecipeConfig) -> str | None:
        """The one line a resume says when it cuts the run's window otherwise than the recipe does."""
        if not saved or (self.micro_batch, self.accum) == (cfg.train.batch_size, cfg.train.grad_accum):
            return None
        before = f" (it had {saved['replicas']})" if saved.get("replicas") not in (None, self.replicas) else ""
        return (
            f"resume: the run's {self.size} examples per step as {self.describe()}{before}: "
            f"grad_accum {self.accum}, micro-batch {self.micro_batch} (the recipe says {cfg.train.batch_size} x "
            f"{cfg.train.grad_accum}); the epoch continues where it stopped"
        )

    def halved(self) -> Window | None:
        """The same window in micro-batches of at most half as many examples; None at one example."""
        per_replica = self.micro_batch * self.accum
        smaller = next((b for b in range(self.micro_batch // 2, 0, -1) if per_replica % b == 0), None)
        if smaller is None:
            return None
        return Window(smaller, per_replica // smaller, self.replicas, self.length_group)

    def describe(self) -> str:
        return f"{self.micro_batch} x {self.accum} accum x {self.replicas} replica{'s' if self.replicas != 1 else ''}"


def elastic_problems(cfg: RecipeConfig, replica_counts: list[int]) -> list[str]:
    """What an elastic job cannot run: its step, sized for its most replicas (its first start's, however many nodes
    came: trainer/loop.py), cut into the recipe's micro-batches on each replica count it may restart on."""
    widest = Window.of_recipe(cfg, max(replica_counts))
    found = []
    for n in replica_counts:
        window = Window.cut(widest.size, widest.micro_batch, n, widest.length_group)
        if window is None:
            found.append(
                f"--nnodes: the step's {widest.size} examples (train.batch_size {widest.micro_batch} x grad_accum "
                f"{widest.accum} x {widest.replicas} replicas on the most nodes) cannot be cut into whole micro-batches on "
                f"{n} replicas: choose train.grad_accum so that every replica count ({', '.join(map(str, replica_counts))}) "
                "divides the step's micro-batches, or narrow --nnodes"
            )
        elif problem := window.resume_problem(cfg):
            found.append(f"--nnodes, on {n} replicas: {problem}")
    return found


class DataOrder:
    def __init__(
        self, train: Sequence[dict], cfg: RecipeConfig, collate: Collator, rank: int, window: Window, device: torch.device
    ):
        self.train, self.cfg, self.collate = train, cfg, collate
        self.rank, self.device = rank, device
        self.use(window)
        self.steps_per_epoch = len(train) // self.window
        self._cached: tuple[int, list[int]] | None = None

    def use(self, split: Window) -> None:
        """Cut each step's window this way from now on (a resume on other processes, an out-of-memory backoff)."""
        self.split, self.world, self.window = split, split.replicas, split.size

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
        """The run's length in optimizer steps: train.max_steps, or train.epochs of this launch's steps (grpo: each
        window of prompts trained num_iterations times, objectives/grpo.py's data_step)."""
        cfg = self.cfg
        if self.steps_per_epoch == 0:
            raise DataError(
                f"data.path: the train set has {len(self.train)} {self.unit}, fewer than one optimizer step needs "
                f"(train.batch_size {self.split.micro_batch} x train.grad_accum {self.split.accum} x "
                f"{self.world} processes = {self.window})",
                hint="lower train.batch_size or train.grad_accum, or add data",
            )
        return cfg.train.max_steps or cfg.train.epochs * self.epoch_steps

    @property
    def epoch_steps(self) -> int:
        """Optimizer steps an epoch takes: one a window of data (grpo: num_iterations, each trains it again)."""
        return self.steps_per_epoch * self.cfg.train.num_iterations

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
            train = self.train
            lengths = train.lengths() if hasattr(train, "lengths") else [len(ex["input_ids"]) for ex in train]
            order = length_grouped(order, lengths, self.split.length_group)
        self._cached = (epoch, order)
        return order

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The grad_accum micro-batches this process trains on at optimizer step `step`."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        bs = self.split.micro_batch
        start = index * self.window
        batches = []
        for micro in range(self.split.accum):
            base = start + micro * bs * self.world + self.rank * bs
            ids = order[base : base + bs]
            batch = self.collate([self.train[i] for i in ids])
            batches.append({k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        return batches
