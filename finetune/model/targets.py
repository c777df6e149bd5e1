"""lora.target against the model's modules, read from a meta-device copy (no weights): the names it may use.

linear_layer_names(model)   ['down_proj', 'gate_proj', ...]: what a lora.target list can name
check_lora_targets(cfg)     problems (and notes) `finetune validate` reports before anything loads
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from finetune.config.schema import RecipeConfig, resolve_path
from finetune.errors import exception_line
from finetune.model import vision


def linear_layer_names(model) -> list[str]:
    """Short names (q_proj, ...) of the model's linear layers, as lora.target takes them."""
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__}
    )


def check_lora_targets(cfg: RecipeConfig) -> tuple[list[str], list[str]]:
    """(problems, notes): lora.target names that match no module, found on a meta-device copy (no weights read);
    a note, not silence, when that copy cannot be built (loading then checks the names)."""
    if cfg.lora is None or cfg.lora.target == "all-linear" or not Path(resolve_path(cfg.model.path)).is_dir():
        return [], []
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_path(cfg.model.path), trust_remote_code=cfg.model.trust_remote_code)
        with init_empty_weights():
            model = vision.model_class(config).from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - loading reports the real problem with the model itself
        why = exception_line(exc)
        return [], [f"lora.target not checked before loading: '{cfg.model.path}' could not be built on the meta device ({why})"]
    names = [n for n, _ in model.named_modules()]
    if isinstance(cfg.lora.target, str):  # peft treats a string as a regex over full module names
        missing = [] if any(re.fullmatch(cfg.lora.target, n) for n in names) else [cfg.lora.target]
    else:
        named = [t for t in cfg.lora.target if t not in (vision.VISION_TOWER, vision.PROJECTOR)]  # vision.py's entries
        missing = [t for t in named if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return [], []
    return [
        f"lora.target: {', '.join(map(repr, missing))} match no module of '{cfg.model.path}'. "
        f"Use all-linear or names from: {', '.join(linear_layer_names(model))}"
    ], []
