"""PiSSA (Meng et al. 2024): the adapter starts as the top-r singular part of each weight,
B @ A x scale = U_r S_r V_r^T, and the base weight becomes the residual W - U_r S_r V_r^T.
The model computes exactly what it did before wrapping; training moves the principal part.

Base weights: peft computes the SVD and writes the residual when it wraps the model, on 16/32-bit
weights only (a 4-bit or 8-bit base would need the residual quantized again, peft's separate
QPiSSA recipe), so PiSSA needs quant.bits=null. Wrapping rewrites every base weight, so a
disk-streamed base is not captured while it loads (finetune/trainer/build.py).

After training: the adapter's adapter_config.json says init_lora_weights="pissa", so vanilla peft
loading it onto the original base recomputes the same residual (a deterministic SVD) and gives the
run's logits. Merging must add B @ A x scale to the residual, not to W: finetune/export/run.py does
(W - U_r S_r V_r^T + scale B @ A, checked like every merge). peft's other way is to convert the
adapter to plain LoRA, delta = B @ A - B0 @ A0 at rank 2r, with
save_pretrained(path_initial_model_for_weight_conversion=...), which needs the adapter as it was
initialised; runs do not keep that. The randomized "pissa_niter_N" initialisation is not offered:
its residual cannot be recomputed from the base, so neither loading nor merging could reproduce it.
"""

from finetune.adapters.base import AdapterMethod, Rule, lists_experts

METHOD = AdapterMethod(
    name="pissa",
    summary="PiSSA: the adapter starts as each weight's top-r singular part, the base as the residual; 16/32-bit base only",
    peft_kwargs={"init_lora_weights": "pissa"},
    rules=(
        Rule(
            lambda cfg: cfg.quant.bits is not None,
            "{key} replaces each base weight by its residual (W minus its top-r singular part) when it wraps the "
            "model, which peft does on 16/32-bit weights, not on quant.bits={cfg.quant.bits}. Set quant.bits=null, "
            "or lora.method=lora to train on a quantized base.",
        ),
        Rule(
            lists_experts,
            "{key} cannot adapt MoE experts: peft's LoRA on fused expert weights (lora.target `experts`) has no "
            "PiSSA initialisation. Remove `experts` from lora.target, or use lora.method=lora or rslora.",
        ),
    ),
    wrap_touches_base=True,
)
