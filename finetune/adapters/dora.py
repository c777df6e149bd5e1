"""DoRA (Liu et al. 2024): LoRA's direction, and a trained magnitude per output row.

peft computes the norm of every wrapped base weight when it wraps the model (so a disk-streamed
base cannot be captured while it loads: finetune/trainer/build.py) and again in every forward
(often better quality, ~1.3-2x slower steps). Older recipes say `lora.dora: true`; it means this.
"""

from finetune.adapters.base import AdapterMethod, Rule, lists_experts

METHOD = AdapterMethod(
    name="dora",
    summary="DoRA: LoRA plus a trained magnitude per output row; often better quality, ~1.3-2x slower steps",
    peft_kwargs={"use_dora": True},
    rules=(
        Rule(lambda cfg: cfg.quant.bits == 8, "{key} is not supported with quant.bits=8 by peft; use quant.bits=4 or null."),
        Rule(
            lists_experts,
            "{key} cannot adapt MoE experts: peft's LoRA on fused expert weights (lora.target `experts`) has no "
            "DoRA. Remove `experts` from lora.target, or use lora.method=lora or rslora.",
        ),
    ),
    trains_magnitude=True,
    wrap_touches_base=True,
)
