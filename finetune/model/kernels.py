"""model.kernels: fused GPU kernels in the decoder layers (liger-kernel's RMSNorm, RoPE, SwiGLU/GeGLU).

    auto    what the GPU leases measured fastest (AUTO_ON_CUDA): none for now; always none on a CPU and
            for a model the caller built and handed over (Trainer.from_parts)
    liger   on a CUDA device where liger-kernel is installed (the `[gpu]` extra) and knows the model's
            family, or a clear error saying which of the three is missing
    finetune  each LoRA'd 4-bit linear as one autograd function (model/fast_lora.py), on any device; on CUDA each
            gated MLP over them as one too (model/fast_mlp.py); opt-in until a GPU lease has measured it
    none    the model's own modules

liger patches the loaded model in place: each decoder layer's norms and MLP get liger's forward
(a mixture of experts keeps its own experts)
(the modules, their names, parameters and state_dict stay; peft's LoRA layers inside the MLP are
still called as modules). liger also swaps the family's module classes and rotary function in
transformers' modeling modules, for the whole process: the classes are put back at once (a model
loaded later gets its own modules; on an H100 a kernels=none run after an auto one got liger's);
the rotary function, a plain function the attention calls by name, stays liger's. Applied before
memory.tiled_mlp, so a tiled MLP tiles liger's forward. liger's fused linear cross-entropy is a separate setting, memory.loss=liger
(finetune/memory/linear_ce.py): finetune computes the loss itself, so liger's replacement of
the model's forward is never installed.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from finetune.errors import ConfigError, ModelError
from finetune.model.load import base_of
from finetune.model.moe import fused_expert_params

# What finetune changes of liger's per-family defaults (each function takes the ones it knows; the
# rest stay liger's, which knows e.g. that Glm4's rotary function has no kernel). The loss pieces
# go off: they replace the model's forward, and finetune computes the loss itself (memory.loss).
LIGER_OFF = ("cross_entropy", "fused_linear_cross_entropy")
INSTALL_HINT = "pip install 'finetune[gpu]' (liger-kernel)"
# What auto picks on CUDA: the kernels the leases measured faster above the run-to-run noise (~15% between single
# runs), else the model's own modules. Session 14's H100 (benchmarks/README.md): liger 3,135 trained tok/s against
# 3,959 without in one call, 3,425 against 3,082 across calls: undecided; model.kernels=finetune unmeasured. The next
# lease's benchmarks/gpu.py --repeats 3 (medians, spreads) decides ("liger" picks it where liger knows the family).
AUTO_ON_CUDA = "none"


def liger_families() -> dict[str, Callable[..., None]] | None:
    """liger's model_type -> patch function, or None when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return None
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN)


def choose(setting: str, device_type: str, model_type: str, families: dict[str, Any] | None) -> str:
    """'liger' or 'none' for model.kernels=`setting` on `device_type` (families: liger_families()); finetune's own
    kernels never come here (apply_kernels installs them first)."""
    if setting == "none":
        return "none"
    usable = device_type == "cuda" and families is not None and model_type in families
    if setting == "auto":
        return "liger" if AUTO_ON_CUDA == "liger" and usable else "none"
    if usable:
        return "liger"
    if device_type != "cuda":
        why = f"liger-kernel's kernels are Triton, CUDA only; this run is on {device_type}"
        fix = "use model.kernels=auto (none on a CPU)"
    elif families is None:
        why, fix = "liger-kernel is not installed", INSTALL_HINT + ", or model.kernels=auto"
    else:
        why = f"liger-kernel has no kernels for model_type '{model_type}' (it has: {', '.join(sorted(families))})"
        fix = "use model.kernels=auto (none for this family)"
    raise ConfigError([f"model.kernels=liger: {why}. Fix: {fix}."])


def apply_kernels(model, setting: str, device_type: str) -> str:
    """Patch `model` (a transformers causal LM, before peft or with it) per model.kernels; returns
    the kernels chosen ('liger', 'finetune' or 'none')."""
    if setting == "finetune":
        from finetune.model import fast_lora, fast_mlp

        fast_lora.install(model)
        if fast_mlp.worth_it(device_type):  # (after: a block's projections keep the fused node for calls it leaves)
            fast_mlp.install(model)
        return "finetune"
    families = liger_families() if setting != "none" else None
    base = base_of(model)
    model_type = getattr(base.config, "model_type", "")
    chosen = choose(setting, device_type, model_type, families)
    if chosen == "liger" and families is not None:
        patch = families[model_type]
        accepted = inspect.signature(patch).parameters
        # A mixture of experts keeps its own experts: liger's swiglu flag also swaps the experts' forward,
        # which breaks peft's wrapper (LoRA on `experts`) and finetune's 4-bit expert store (finetune/model/moe.py).
        off = [*LIGER_OFF, *(["swiglu"] if fused_expert_params(base) else [])]
        # Every loaded modeling module: a multimodal family's patch also swaps its text model's classes.
        before = {m: dict(vars(m)) for name, m in list(sys.modules.items()) if name.startswith("transformers.models.")}
        try:
            patch(model=base, **{k: False for k in off if k in accepted})
        except Exception as exc:  # noqa: BLE001 - liger's own checks (a piece a family lacks): said, not hidden
            raise ModelError(
                f"model.kernels={setting}: liger-kernel's patch for model_type '{model_type}' failed: {exc}",
                hint="set model.kernels=none (the model's own modules)",
            ) from exc
        finally:
            for modeling, names in before.items():
                _restore_classes(modeling, names)
    return chosen


def _restore_classes(modeling, before: dict[str, Any]) -> None:
    """Put back the module classes liger swapped in one modeling module: this model keeps liger's
    forwards (patched per instance), a model loaded later in the process gets its own modules."""
    for name, original in before.items():
        if isinstance(original, type) and vars(modeling).get(name) is not original:
            setattr(modeling, name, original)
