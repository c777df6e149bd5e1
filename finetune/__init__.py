"""finetune: parameter-efficient fine-tuning (QLoRA) of 7B-70B models on the GPUs people own.

    from finetune import load_recipe, Trainer
    cfg = load_recipe("recipes/demo-cpu.yaml", ["train.max_steps=50"])
    result = Trainer(cfg).train()

Submodules are imported lazily so `import finetune` stays fast (torch,
transformers and peft load on first use).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

# bitsandbytes, when imported on a CPU with AVX512-BF16, tries to fetch a 4-bit kernel
# from the HF hub through the optional `kernels` package and, failing, logs "Failed to
# load CPU gemm_4bit_forward from kernels-community ... pip install kernels" on every
# run. That kernel serves only bitsandbytes' bf16 eval path (packing_format_for_cpu),
# which model.load.keep_4bit_numerics turns off for every model we load: nothing is lost, so
# nothing is said. The filter sits on the logger bitsandbytes will create, before any
# module of ours can import bitsandbytes; other bitsandbytes messages pass. With `kernels` installed (transformers
# >= 5.25 requires it) and the Hub offline, that fetch also has `kernels` log "Skipping publisher trust check for
# 'kernels-community/quantization-bitsandbytes'": the same kernel, the same silence.
_BNB_HUB_KERNEL_NOTICES = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "kernels._internals.hf_hub": "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'",
}


def _not_the_hub_kernel_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BNB_HUB_KERNEL_NOTICES[record.name])


for _logger in _BNB_HUB_KERNEL_NOTICES:
    logging.getLogger(_logger).addFilter(_not_the_hub_kernel_notice)

_EXPORTS = {
    "load_recipe": "finetune.config.schema",
    "RecipeConfig": "finetune.config.schema",
    "build_recipe": "finetune.config.schema",
    "FinetuneError": "finetune.errors",
    "ConfigError": "finetune.errors",
    "DataError": "finetune.errors",
    "ModelError": "finetune.errors",
    "load_model": "finetune.model.load",
    "load_tokenizer": "finetune.model.load",
    "build_datasets": "finetune.data",
    "DataBundle": "finetune.data",
    "Collator": "finetune.data",
    "preflight": "finetune.runs.preflight",
    "Trainer": "finetune.trainer",
    "TrainResult": "finetune.trainer",
    "TrainState": "finetune.trainer",
    "Callback": "finetune.trainer",
    "Loss": "finetune.trainer",
    "open_run": "finetune.runs.open",
    "load_trained": "finetune.runs.open",
    "export_run": "finetune.export.run",
    "reward": "finetune.objectives.rewards",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'finetune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
