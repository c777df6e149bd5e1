"""finetune: parameter-efficient fine-tuning (QLoRA) of 7B-70B models on the GPUs people own.

    from finetune import load_recipe, Trainer
    cfg = load_recipe("recipes/demo-cpu.yaml", ["train.max_steps=50"])
    result = Trainer(cfg).train()

Submodules are imported lazily so `import finetune` stays fast (torch,
transformers and peft load on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_recipe": "finetune.config",
    "RecipeConfig": "finetune.config",
    "build_recipe": "finetune.config",
    "FinetuneError": "finetune.errors",
    "ConfigError": "finetune.errors",
    "DataError": "finetune.errors",
    "ModelError": "finetune.errors",
    "load_model": "finetune.model",
    "load_tokenizer": "finetune.model",
    "build_datasets": "finetune.data",
    "DataBundle": "finetune.data",
    "Collator": "finetune.data",
    "preflight": "finetune.preflight",
    "Trainer": "finetune.trainer",
    "TrainResult": "finetune.trainer",
    "open_run": "finetune.runs",
    "load_trained": "finetune.runs",
    "export_run": "finetune.export",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'finetune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
