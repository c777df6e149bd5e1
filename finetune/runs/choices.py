"""What `auto` chose for a run, kept with it.

precision: auto is bf16 on a machine with native bf16 and fp32 (or fp16) elsewhere; a requeued
job can land on another node type. So a run records what each `auto` key resolved to (in every
checkpoint's trainer_state.json, and as a comment in output_dir/recipe.yaml), and a resume keeps
the run's choice where this machine can run it, or stops naming both, never switching silently.

    run_cfg = keep(cfg, saved_choices, world)       # the recipe with the run's choices for its auto keys
    found = resolved(cfg, precision, strategy, model, applied, loss)   # after setup: what auto chose
"""

from __future__ import annotations

from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.errors import HardwareError, ResumeMismatch
from finetune.hardware import Device, resolve_precision
from finetune.memory.tiled_mlp import AUTO_TILE_TOKENS

# The recipe keys `auto` resolves on the machine, in the order they are said.
AUTO_KEYS = ("precision", "distributed.strategy", "model.attn_implementation", "model.kernels", "memory.loss", "memory.tiled_mlp")
# Keys a resume can hand back to the loaders as explicit settings (the others follow from these).
KEPT = {
    "distributed.strategy": ("ddp", "fsdp"),  # single (one process) and the layouts are not auto's to keep
    "model.attn_implementation": ("eager", "sdpa", "varlen", "flash_attention_2", "flex_attention"),
    "model.kernels": ("none", "liger"),
}


def recipe_value(cfg: RecipeConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section), name) if section else getattr(cfg, name)


def resolved(cfg: RecipeConfig, precision: str, strategy: str, model: Any, applied: Any, chunked_loss: bool) -> dict[str, str]:
    """{key: what auto chose} for the recipe's keys set to auto (model: the loaded model, applied: memory/apply's)."""
    config = getattr(model, "config", None)
    found = {
        "precision": precision,
        "distributed.strategy": strategy,
        "model.attn_implementation": str(getattr(config, "_attn_implementation", "unknown")),
        "model.kernels": applied.kernels,
        "memory.loss": "chunked" if chunked_loss else "full",
        "memory.tiled_mlp": f"MLPs tiled beyond {AUTO_TILE_TOKENS} positions" if applied.tiled_mlps else "off",
    }
    return {k: found[k] for k in AUTO_KEYS if recipe_value(cfg, k) == "auto"}


def comment(choices: dict[str, str]) -> str:
    """recipe.yaml's closing comment: what auto chose on this launch."""
    if not choices:
        return ""
    return "# auto chose, on this run's latest launch:\n" + "".join(f"#   {k}: {v}\n" for k, v in choices.items())


def keep_precision(cfg: RecipeConfig, saved: dict[str, str], device: Device) -> tuple[str, str | None]:
    """The precision of a resumed run (the one auto chose when it started, where this machine runs it),
    and the line that says it was kept."""
    here = resolve_precision(cfg.precision, device)
    ran = saved.get("precision")
    if cfg.precision != "auto" or ran is None or ran == here:
        return here, None
    try:
        kept = resolve_precision(ran, device)
    except HardwareError as err:
        raise ResumeMismatch(
            f"resume: this run trains in {ran} (precision=auto chose it on its first machine); auto chooses {here} "
            f"on this one, and {ran} cannot run here: {err.message}",
            hint=f"resume on a machine that runs {ran}, or set precision={here} resume_ignore_changes=true "
            "to continue in another precision knowingly",
        ) from err
    return kept, f"resume: precision {kept} kept (precision=auto chose it for this run; on this machine it would choose {here})"


def keep(cfg: RecipeConfig, saved: dict[str, str], world: int) -> RecipeConfig:
    """The recipe with the run's earlier choices for its auto keys that a loader can be told (KEPT)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, allowed in KEPT.items():
        ran = saved.get(key)
        if recipe_value(cfg, key) != "auto" or ran not in allowed or (key == "distributed.strategy" and world == 1):
            continue
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = ran  # silent: usually what auto would choose again
    if not sections:
        return cfg
    return cfg.model_copy(update={s: getattr(cfg, s).model_copy(update=v) for s, v in sections.items()})


def changes(saved: dict[str, str], now: dict[str, str]) -> str | None:
    """The line a resume says when auto chose otherwise on this launch than on the run's last (what
    follows from the processes or the device: the loss path under FSDP, the attention of packed rows)."""
    changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
    return f"resume: auto chose otherwise on this launch: {'; '.join(changed)}" if changed else None
