"""distributed.grad_compression: what it needs and its defaults (config asks `problems(cfg)`).

    none      DDP's fp32 all-reduce of the gradients
    bf16/fp16 the gradients cast to 16 bits for the all-reduce: half the bytes
    powersgd  each gradient matrix (n x m) sent as rank-r factors ((n + m) x r numbers), what they
              miss added to the next step's gradient (error feedback); plain all-reduce first

Only DDP all-reduces gradients (FSDP reduce-scatters them: no hook). The hooks themselves, and
PowerSGD's state that checkpoints carry per rank: finetune/parallel/ddp_hooks.py.
"""

from __future__ import annotations

from typing import Any

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


def problems(cfg: Any, strategy: str | None = None) -> list[str]:
    """What distributed.grad_compression cannot run with. strategy: the one distributed.strategy=auto
    chose at launch (None: the recipe's own key)."""
    d, out = cfg.distributed, []
    chosen = strategy or d.strategy
    if d.grad_compression != "none" and chosen not in ("auto", "ddp", "single"):
        by = f"distributed.strategy={chosen}" if strategy is None else f"distributed.strategy=auto chose {chosen} here"
        out.append(
            f"distributed.grad_compression={d.grad_compression} compresses DDP's gradient all-reduce, but {by}, "
            "which reduces gradients its own way (no DDP all-reduce to compress). Set distributed.strategy=ddp "
            "(a full replica per GPU) or distributed.grad_compression=none."
        )
    # Not "set in the recipe": a run's resolved recipe.yaml lists every key at its default.
    changed = [k for k, default in (("powersgd_rank", 1), ("powersgd_warmup_steps", None)) if getattr(d, k) != default]
    if changed and d.grad_compression != "powersgd" and strategy is None:
        out.append(
            f"distributed.{changed[0]} applies to distributed.grad_compression=powersgd (it is {d.grad_compression}). "
            f"Set grad_compression=powersgd, or remove {' and '.join('distributed.' + k for k in changed)}."
        )
    return out
