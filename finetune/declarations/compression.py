"""distributed.grad_compression: what it needs and its defaults (config asks `problems(cfg)`).

    none      DDP's fp32 all-reduce of the gradients
    bf16/fp16 the gradients cast to 16 bits for the all-reduce: half the bytes
    powersgd  each gradient matrix (n x m) sent as rank-r factors ((n + m) x r numbers), what they
              miss added to the next step's gradient (error feedback); plain all-reduce first

Only DDP all-reduces gradients (FSDP reduce-scatters them: no hook). The hooks themselves, and
PowerSGD's state that checkpoints carry per rank: finetune/parallel/ddp_hooks.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from finetune.declarations.strategies import of_recipe
from finetune.errors import Rule, broken

# Plain all-reduce steps before PowerSGD when distributed.powersgd_warmup_steps is null: torch's
# advice is no fewer than the lr warm-up steps (early training is the most sensitive to gradient
# error); 10 without lr warm-up costs little bandwidth in a run of hundreds of steps.
DEFAULT_WARMUP_STEPS = 10


def powersgd_warmup(cfg: Any) -> int:
    """Optimizer steps of plain all-reduce before PowerSGD compresses (torch's start_powerSGD_iter)."""
    chosen = cfg.distributed.powersgd_warmup_steps
    return chosen if chosen is not None else max(DEFAULT_WARMUP_STEPS, cfg.train.warmup_steps)


def describe(cfg: Any) -> str:
    """How this run's gradients travel, for the launch log."""
    d = cfg.distributed
    if d.grad_compression == "powersgd":
        return f"gradients all-reduced as rank-{d.powersgd_rank} PowerSGD factors from step {powersgd_warmup(cfg) + 1}"
    return f"gradients all-reduced as {d.grad_compression}"


class Launch(NamedTuple):
    """What the rules read: the recipe, and the strategy distributed.strategy=auto chose at launch (None:
    the recipe alone, its own key) with whether it keeps a whole replica per process (DDP's all-reduce)."""

    cfg: Any
    auto_chose: str | None
    chosen_replicates: bool = True

    @property
    def replicates(self) -> bool:
        return self.chosen_replicates if self.auto_chose is not None else of_recipe(self.cfg).replicates

    @property
    def by(self) -> str:
        if self.auto_chose is None:
            return f"distributed.strategy={self.cfg.distributed.strategy}"
        return f"distributed.strategy=auto chose {self.auto_chose} here"


def _changed(cfg: Any) -> list[str]:
    # Not "set in the recipe": a run's resolved recipe.yaml lists every key at its default.
    d = cfg.distributed
    return [k for k, default in (("powersgd_rank", 1), ("powersgd_warmup_steps", None)) if getattr(d, k) != default]


RULES: tuple[Rule[Launch], ...] = (
    Rule(
        lambda x: x.cfg.distributed.grad_compression != "none" and not x.replicates,
        lambda x: (
            f"distributed.grad_compression={x.cfg.distributed.grad_compression} compresses DDP's gradient all-reduce, "
            f"but {x.by}, which reduces gradients its own way (no DDP all-reduce to compress). Set distributed.strategy=ddp "
            "(a full replica per GPU) or distributed.grad_compression=none."
        ),
    ),
    Rule(
        lambda x: bool(_changed(x.cfg)) and x.cfg.distributed.grad_compression != "powersgd" and x.auto_chose is None,
        lambda x: (
            f"distributed.{_changed(x.cfg)[0]} applies to distributed.grad_compression=powersgd (it is "
            f"{x.cfg.distributed.grad_compression}). Set grad_compression=powersgd, or remove "
            f"{' and '.join('distributed.' + k for k in _changed(x.cfg))}."
        ),
    ),
)


def problems(cfg: Any, auto_chose: str | None = None, replicates: bool = True) -> list[str]:
    """What distributed.grad_compression cannot run with. auto_chose: the strategy distributed.strategy=auto
    chose at launch, and whether it replicates (None: the recipe's own key)."""
    return broken(RULES, Launch(cfg, auto_chose, replicates))
