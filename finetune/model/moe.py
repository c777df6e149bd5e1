"""Mixture-of-experts models: their fused expert weights in 4-bit, and which of them LoRA adapts.

transformers 5 stores the experts of an MoE layer as fused 3-D parameters (experts.gate_up_proj:
experts x 2*intermediate x hidden, experts.down_proj: experts x hidden x intermediate), not as
nn.Linear modules. bitsandbytes' 4-bit conversion replaces nn.Linear modules only, so it leaves
them in 16-bit: 29 of Qwen3-30B-A3B's 30.5 B parameters, 58 GB. Here:

quantizing_experts()  while the model loads, each fused expert parameter is NF4-quantized as a
    whole (bitsandbytes' quantize_4bit, blocksize 64, quant.double_quant) the moment transformers
    registers it on its module, so one layer's 16-bit stack exists for an instant, never the
    model's. The module keeps a placeholder of the same shape and dtype that holds no memory.
attach()  the block that calls the experts (the MoE layer, e.g. `mlp`) dequantizes them into real
    parameters in a forward pre-hook and puts the placeholders back after its forward. Whatever
    reads experts.gate_up_proj inside (transformers' eager / grouped_mm experts, peft's
    ParamWrapper, which parametrizes the parameter inside the experts' own forward) sees a plain
    tensor, which autograd keeps until that layer's backward: one layer's stack at a time with
    activation checkpointing, every layer's without (finetune/plan counts both).
    Not bitsandbytes' replace_parameter_4bit: peft 0.21's ParamWrapper cannot stack its
    parametrization on another one (it removes neither, then sets requires_grad on the uint8 data).

LoRA: `all-linear` on an MoE model is every nn.Linear but the head and the routers (attention,
dense or shared-expert MLPs); the entry `experts` in a lora.target list adds the fused expert
parameters through peft's target_parameters (one ParamWrapper per parameter, folding
W + scale * B @ A for every expert into the stack at each forward). Dropout cannot be factored out
of that fold, so lora.dropout applies to the linear targets only (set_linear_dropout). The router
(mlp.gate) is never a target and stays frozen like every base weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from finetune.adapters.base import EXPERTS
from finetune.errors import ModelError

ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})  # linears that route tokens: never LoRA targets
BLOCKSIZE = 64  # what bitsandbytes' Linear4bit uses; finetune/plan/terms.py's NF4_BLOCK
_STORE = "_finetune_nf4"  # on an experts module: {parameter name: (packed uint8 data, bitsandbytes QuantState)}


def is_expert_param(module: torch.nn.Module, param: Any) -> bool:
    """A fused expert parameter: 3-D floating point, on an experts module (transformers' *Experts classes)."""
    return (
        isinstance(param, torch.Tensor)
        and param.dim() == 3
        and param.is_floating_point()
        and (hasattr(module, "num_experts") or "expert" in type(module).__name__.lower())
    )


def fused_expert_params(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """{full parameter name: (module, its attribute)} of the fused expert parameters, as the base model names them
    (peft's wrappers left out: `base_model.model.` and `.base_layer` removed)."""
    found: dict[str, tuple[torch.nn.Module, str]] = {}
    for name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if is_expert_param(module, param) or attr in getattr(module, _STORE, {}):
                found[f"{plain_name(name)}.{attr}"] = (module, attr)
    return found


def plain_name(name: str) -> str:
    """A module's name in the base model: peft's `base_model.model.` prefix and `.base_layer` wrappers removed."""
    name = name.removeprefix("base_model.model.")
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def _placeholder(like: torch.Tensor) -> torch.nn.Parameter:
    """A parameter with the shape, dtype and device of `like` and no memory: one zero, expanded."""
    p = torch.nn.Parameter(torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape), requires_grad=False)
    p._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers must not initialise it
    return p


@contextmanager
def quantizing_experts(quant_type: str, double_quant: bool) -> Iterator[None]:
    """While the block runs (a from_pretrained call), every fused expert parameter a module registers
    on a real device is stored 4-bit on that module and replaced by a placeholder."""
    import bitsandbytes.functional as bnbf

    def quantize(module: torch.nn.Module, name: str, param: Any):
        if not is_expert_param(module, param) or param.device.type == "meta":
            return None  # the meta-device skeleton transformers builds first
        packed, state = bnbf.quantize_4bit(
            param.data, blocksize=BLOCKSIZE, compress_statistics=double_quant, quant_type=quant_type
        )
        module.__dict__.setdefault(_STORE, {})[name] = (packed, state)
        return _placeholder(param)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(quantize)
    try:
        yield
    finally:
        handle.remove()


def attach(model) -> int:
    """Hook the block around each 4-bit experts module so the experts are 16-bit exactly while it runs.
    Returns how many experts modules are 4-bit."""
    blocks: dict[int, tuple[torch.nn.Module, list[torch.nn.Module]]] = {}
    for block in model.modules():
        for child in block.children():
            if getattr(child, _STORE, None):
                blocks.setdefault(id(block), (block, []))[1].append(child)
    for block, experts in blocks.values():
        block.__dict__["_finetune_experts"] = experts  # plain references: peft may wrap the children later
        block.register_forward_pre_hook(_dequantize)
        # always_call: a checkpoint's recomputation stops early by raising inside the layer; the
        # placeholders must come back then too, or the stack stays referenced until the next forward.
        block.register_forward_hook(_release, always_call=True)
    return sum(len(e) for _, e in blocks.values())


@torch.no_grad()
def _dequantize(block: torch.nn.Module, args: Any) -> None:
    import bitsandbytes.functional as bnbf

    for experts in block.__dict__["_finetune_experts"]:
        for name, (packed, state) in experts.__dict__[_STORE].items():
            experts._parameters[name] = torch.nn.Parameter(bnbf.dequantize_4bit(packed, state), requires_grad=False)


def _release(block: torch.nn.Module, args: Any, output: Any) -> None:
    for experts in block.__dict__["_finetune_experts"]:
        for name in experts.__dict__[_STORE]:
            experts._parameters[name] = _placeholder(experts._parameters[name])


def quant_states(model) -> dict[str, Any]:
    """{fused parameter name: bitsandbytes QuantState} of the 4-bit experts (finetune/export/merge.py round-trips them)."""
    return {
        name: module.__dict__[_STORE][attr][1]
        for name, (module, attr) in fused_expert_params(model).items()
        if attr in getattr(module, _STORE, {})
    }


def packed_bytes(model) -> int:
    """Bytes the 4-bit experts hold (packed weights and quantization constants)."""
    total = 0
    for module in model.modules():
        for packed, state in getattr(module, _STORE, {}).values():
            total += packed.numel() * packed.element_size()
            for t in (state.absmax, getattr(state.state2, "absmax", None), state.offset):
                total += 0 if t is None else t.numel() * t.element_size()
    return total


def split_targets(model, target: str | list[str]) -> tuple[str | list[str], list[str]]:
    """(peft target_modules, target_parameters) for lora.target on `model`.

    A dense model keeps peft's own meaning of every target. On an MoE model `all-linear` is every
    nn.Linear but the head and the routers; the entry `experts` in a list names every fused expert
    parameter by its full name (exactly those, whatever else is named like them)."""
    fused = sorted(fused_expert_params(model))
    if not isinstance(target, str) and EXPERTS in target and not fused:
        raise ModelError(
            f"lora.target lists `{EXPERTS}`, but {type(model).__name__} has no fused expert weights (it is not a "
            "mixture-of-experts model transformers stores that way)",
            hint=f"remove `{EXPERTS}` from lora.target",
        )
    if isinstance(target, str):
        if target != "all-linear" or not fused:
            return target, []
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
        return sorted(names - ROUTERS), []
    modules = [t for t in target if t != EXPERTS]
    return modules, fused if EXPERTS in target else []


def set_linear_dropout(model, p: float) -> int:
    """lora.dropout on every LoRA-wrapped linear (peft built them with none: target_parameters
    forbids dropout for the whole config). Returns how many took it."""
    n = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if dropouts is None or type(module).__name__ == "ParamWrapper":
            continue
        for adapter in list(dropouts.keys()):
            dropouts[adapter] = torch.nn.Dropout(p)
            n += 1
    return n
