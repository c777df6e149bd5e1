"""What a launch of N processes cannot split as the split strategies ask (declarations/splits.py), read from the model's config.json before any weight loads (the CLI asks before torchrun starts the workers, so
the message comes once; Parallel.choose asks again where another launcher started them).

    problems = split_problems(cfg, world)    # [] when nothing is split or everything splits
"""

from __future__ import annotations

from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.declarations import layout
from finetune.declarations.splits import SPLITS, TENSOR
from finetune.model.load import model_source
from finetune.parallel.context import problems as context_problems
from finetune.parallel.tensor import problems as tensor_problems


def split_problems(cfg: RecipeConfig, world: int, config: Any = None) -> list[str]:
    """What a launch of `world` processes cannot split as the recipe's splits ask (the CLI asks before torchrun
    starts them, so the message comes once); config: the model's text config, read here when not given."""
    if not any(split.asked(cfg) for split in SPLITS):
        return []
    config = config if config is not None else text_config(cfg)
    known = (config.num_hidden_layers, config.model_type) if config is not None else (None, None)
    out = layout.launch_problems(cfg, world, *known)
    if TENSOR.asked(cfg) and config is not None:
        out += tensor_problems(config, TENSOR.size(cfg))
    if config is not None:
        out += context_problems(config, cfg)
    return out


def text_config(cfg: RecipeConfig):
    """The model's (text) config from its config.json, or None where it cannot be read here (a model
    given in memory, custom code): Parallel.shard checks the loaded model then."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            model_source(cfg), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except Exception:  # noqa: BLE001 - loading reports the real problem with the model
        return None
    return config.get_text_config()
