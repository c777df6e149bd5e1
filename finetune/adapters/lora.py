"""LoRA (Hu et al. 2021): W + (alpha / r) B @ A, A random, B zero at the start. The default."""

from finetune.adapters.base import AdapterMethod

METHOD = AdapterMethod(name="lora", summary="LoRA: W + (alpha/r) B@A; the default")
