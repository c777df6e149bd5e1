"""rsLoRA (Kalajdzievski 2023): LoRA scaled by alpha / sqrt(r) instead of alpha / r, so that
larger ranks keep learning (with alpha / r the update shrinks as r grows). Same memory and speed
as LoRA; an adapter from it loads in vanilla peft (adapter_config.json: use_rslora)."""

import math

from finetune.adapters.base import AdapterMethod

METHOD = AdapterMethod(
    name="rslora",
    summary="rank-stabilised LoRA: scale alpha/sqrt(r), for large ranks",
    peft_kwargs={"use_rslora": True},
    scale=lambda alpha, r: alpha / math.sqrt(r),
)
