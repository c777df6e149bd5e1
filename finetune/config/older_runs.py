"""Older runs' recipes as this version spells them (resume compares a run's recipe with today's).

same = current_spelling(saved_recipe) == current_spelling(new_recipe)
"""

from __future__ import annotations

from typing import Any

from finetune import adapters
from finetune.declarations import zero_config
from finetune.declarations.splits import SPLITS

# Keys added after runs were written, with the value that reproduces what those runs did.
_OLDER_RUNS: dict[str, dict[str, Any]] = {
    "memory": {"loss": "full", "loss_chunk": 256, "tiled_mlp": "off", "embeddings": "device"},
    "train": {"objective": "sft", "beta": None, "simpo_gamma": None, "precompute_reference": False, "compile": False},
    "distributed": {
        "grad_compression": "none",
        "powersgd_rank": 1,
        "powersgd_warmup_steps": None,
        **zero_config.DEFAULTS,
        **{split.field: 1 for split in SPLITS},  # nothing split
        "pipeline_schedule": "1f1b",
        "virtual_stages": 1,
        "pipeline_layers": "even",
        "context_parallel_mode": "ring",
    },
    "profile": {"steps": None, "memory_timeline": True},
}


def current_spelling(recipe: dict[str, Any]) -> dict[str, Any]:
    """A resolved recipe dict (an older run's recipe.yaml or checkpoint) as this version writes it:
    lora.dora (true/false) becomes lora.method (dora/lora), and keys the run predates get the value
    it ran with, so resuming such a run sees no change it did not make."""
    recipe = dict(recipe)
    for section, defaults in _OLDER_RUNS.items():
        if isinstance(recipe.get(section, {}), dict):  # a section the run predates: its defaults whole
            recipe[section] = {**defaults, **recipe.get(section, {})}
    lora = recipe.get("lora")
    if not isinstance(lora, dict) or "dora" not in lora:
        return recipe
    lora = dict(lora)
    dora = lora.pop("dora")
    lora.setdefault("method", "dora" if dora else adapters.DEFAULT)
    return {**recipe, "lora": lora}
