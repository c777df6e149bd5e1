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


def _chosen(x: tuple[Any, str | None]) -> str:
    cfg, strategy = x
    return strategy or cfg.distributed.strategy


def _by(x: tuple[Any, str | None]) -> str:
    return f"distributed.strategy={_chosen(x)}" if x[1] is None else f"distributed.strategy=auto chose {x[1]} here"


def _changed(cfg: Any) -> list[str]:
    # Not "set in the recipe": a run's resolved recipe.yaml lists every key at its default.
    d = cfg.distributed
    return [k for k, default in (("powersgd_rank", 1), ("powersgd_warmup_steps", None)) if getattr(d, k) != default]


# Rules over (the recipe, the strategy distributed.strategy=auto chose at launch or None).
RULES: tuple[Rule[tuple[Any, str | None]], ...] = (
    Rule(
        lambda x: x[0].distributed.grad_compression != "none" and _chosen(x) not in ("auto", "ddp", "single"),
        lambda x: (
            f"distributed.grad_compression={x[0].distributed.grad_compression} compresses DDP's gradient all-reduce, "
            f"but {_by(x)}, which reduces gradients its own way (no DDP all-reduce to compress). Set distributed.strategy=ddp "
            "(a full replica per GPU) or distributed.grad_compression=none."
        ),
    ),
    Rule(
        lambda x: bool(_changed(x[0])) and x[0].distributed.grad_compression != "powersgd" and x[1] is None,
        lambda x: (
            f"distributed.{_changed(x[0])[0]} applies to distributed.grad_compression=powersgd (it is "
            f"{x[0].distributed.grad_compression}). Set grad_compression=powersgd, or remove "
            f"{' and '.join('distributed.' + k for k in _changed(x[0]))}."
        ),
    ),
)


def problems(cfg: Any, strategy: str | None = None) -> list[str]:
    """What distributed.grad_compression cannot run with. strategy: the one distributed.strategy=auto
    chose at launch (None: the recipe's own key)."""
    return broken(RULES, (cfg, strategy))
