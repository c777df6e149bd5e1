"""What an adapter method is: a name, the peft LoraConfig arguments it sets, its rules, and the
facts the rest of the toolkit reads (the builder, the planner). One module per method in
this package defines one `AdapterMethod`; `finetune/adapters/__init__.py` registers it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from finetune.errors import Rule, broken

EXPERTS = "experts"  # the lora.target entry for MoE models' fused expert weights (finetune/model/moe.py)


def lists_experts(cfg: Any) -> bool:
    """lora.target lists `experts`: LoRA on the fused expert parameters, through peft's ParamWrapper."""
    target = cfg.lora.target if cfg.lora is not None else None
    return isinstance(target, list) and EXPERTS in target


@dataclass(frozen=True)
class AdapterMethod:
    name: str  # lora.method's value
    summary: str  # one line: what it is, what it costs
    peft_kwargs: Mapping[str, Any] = field(default_factory=dict)  # peft LoraConfig(**...) on top of r/alpha/dropout/target
    # Rules over the recipe; messages are formatted with `key` (the method as the recipe spells it:
    # lora.method=NAME, or lora.dora=true) and `cfg`.
    rules: tuple[Rule[Any], ...] = ()
    # Planner and builder facts.
    trains_magnitude: bool = False  # DoRA: one trained magnitude per output row of each wrapped linear
    wrap_touches_base: bool = False  # wrapping reads (DoRA) or rewrites (PiSSA) every base weight
    scale: Callable[[float, int], float] = lambda alpha, r: alpha / r  # the adapter's scaling: B @ A x scale(alpha, r)

    def problems(self, cfg: Any, key: str) -> list[str]:
        return broken(self.rules, cfg, key=key, cfg=cfg)
