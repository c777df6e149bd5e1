"""Adapter methods: which low-rank adapter lora.method trains, one module per method.

    from finetune.adapters import NAMES, get, method_of
    get("rslora").peft_kwargs                   # {'use_rslora': True}
    method_of(cfg.lora).problems(cfg, "lora.method=rslora")   # its rules' messages for this recipe

A method (base.AdapterMethod) is its name, the peft LoraConfig keyword arguments it sets, its
rules (what it cannot run with, as messages naming the keys and the fix), and the facts the
builder and the planner read. config.sections.LoraConfig.method accepts exactly the names registered
here; model.wrap_lora passes the method's peft arguments; config's cross-field rules run its
rules. Adding a method: a module here defining METHOD, and its line in `_MODULES` below.
"""

from __future__ import annotations

from typing import Any

from finetune.adapters import dora, lora, pissa, rslora
from finetune.adapters.base import AdapterMethod, Rule

_MODULES = (lora, dora, rslora, pissa)  # the first is the default
METHODS: dict[str, AdapterMethod] = {m.METHOD.name: m.METHOD for m in _MODULES}
NAMES: tuple[str, ...] = tuple(METHODS)
DEFAULT = NAMES[0]


def get(name: str) -> AdapterMethod:
    if name not in METHODS:
        raise KeyError(f"no adapter method {name!r}; known: {', '.join(NAMES)}")
    return METHODS[name]


def method_of(lora_cfg: Any) -> AdapterMethod:
    """The method a config.sections.LoraConfig trains (its `lora.dora: true` alias included)."""
    return get("dora" if getattr(lora_cfg, "dora", False) else lora_cfg.method)


__all__ = ["DEFAULT", "METHODS", "NAMES", "AdapterMethod", "Rule", "get", "method_of"]
