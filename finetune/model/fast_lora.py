"""model.kernels=finetune: each LoRA'd 4-bit linear as one autograd function (issue 48's fast QLoRA path, first piece).

peft's LoRA over a bitsandbytes 4-bit linear runs, per call, the 4-bit matmul (bitsandbytes' autograd function), a
defensive clone of its output, lora_A, lora_B, the scale and the sum as separate modules and autograd nodes, through
peft's Python for every adapter it might hold. `LoraOver4bit` is one node doing the same arithmetic:

    forward    y = gemm_4bit(x, W) + ((d A^T) B^T) * s          d: the input as the adapter sees it (dropout applied)
    backward   dx = g W (W dequantized once)   dd = ((g s) B) A   dA = ((g s) B)^T d   dB = (g s)^T (d A^T)

with bitsandbytes' own ops for the 4-bit matmul and dequantization (double quant included), so the numbers are
peft's and bitsandbytes' (tests/test_fast_lora.py: forward, the input's and A's and B's gradients, dropout on; a
whole run step by step). peft still owns the adapter: its modules, names, save, load and merge are untouched; only
the layer's forward is replaced, and only where it is plain (one active vanilla LoRA adapter, training, not merged,
no mixed-batch adapter names); anywhere else peft's own forward runs. The dropout runs as peft's module does, before
the function (the same random draws). Experts kept in finetune's own 4-bit store (model/moe.py) keep their path.
"""

from __future__ import annotations

import types
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

# Ranges a profile reads the node's parts by (benchmarks/step_profile.py): the 4-bit matmul, and the adapter's products.
BASE_RANGE, ADAPTER_RANGE = "finetune.fast_lora.base", "finetune.fast_lora.adapter"


class LoraOver4bit(torch.autograd.Function):
    """The base 4-bit matmul and the adapter's low-rank product in one node (see the module)."""

    @staticmethod
    def forward(ctx, x, d, packed, state, bias, a, b, scale: float):
        with _range(BASE_RANGE):
            base = _gemm_4bit(x, packed, state, bias)
        with _range(ADAPTER_RANGE):
            u = F.linear(d, a)  # (under mixed precision, in autocast's dtype: as lora_A and lora_B run in peft)
            out = F.linear(u, b) * scale
        # The packed weight saved as a tensor, not a ctx attribute: activation checkpointing then drops it after
        # forward, and a streamed layer's device copy is freed (memory/stream.py's _Saved4bitMatmul, for the same reason).
        ctx.save_for_backward(d, u, a, b, packed)
        ctx.state, ctx.scale = state, scale
        kind = d.device.type
        ctx.autocast = (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None
        return base, out

    @staticmethod
    def backward(ctx, g_base, g_out):
        import bitsandbytes.functional as bnbf

        d, u, a, b, packed = ctx.saved_tensors
        need_x, need_d, _, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        dx = dd = da = db = dbias = None
        if need_x:  # W dequantized once for the input's gradient, as bitsandbytes' backward does
            with _range(BASE_RANGE):
                dx = torch.matmul(g_base, bnbf.dequantize_4bit(packed, ctx.state).to(g_base.dtype))
        if need_bias:
            dbias = g_base.reshape(-1, g_base.shape[-1]).sum(0)
        # The adapter's products under the forward's autocast, as autograd runs theirs in peft (the gradients come
        # back in autocast's dtype: autograd casts each to its input's dtype, as peft's casts' backward would).
        with torch.autocast(*ctx.autocast) if ctx.autocast else nullcontext(), _range(ADAPTER_RANGE):
            # Each product as autograd's own for a linear (a weight's gradient: input^T grad, transposed), so that
            # the reductions run in the same order: bitwise peft's in fp32, and in bf16 too.
            go = (g_out * ctx.scale).reshape(-1, g_out.shape[-1])  # the gradient of (d A^T) B^T, flat
            if need_b:
                db = u.reshape(-1, u.shape[-1]).t().mm(go).t()
            gu = go.mm(b)  # the gradient of d A^T
            if need_a:
                da = d.reshape(-1, d.shape[-1]).t().mm(gu).t()
            if need_d:
                dd = gu.mm(a).view(*d.shape[:-1], a.shape[-1])
        return dx, dd, None, None, dbias, da, db, None


def _range(name: str) -> Any:
    """A profiler range where a profiler records (a no-op otherwise: no op call per layer per pass)."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else nullcontext()


def _gemm_4bit(x: torch.Tensor, packed: torch.Tensor, state: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """bitsandbytes' 4-bit matmul of x and the packed weight (its forward's op: dequantization inside the GEMM)."""
    if not state.nested:
        return torch.ops.bitsandbytes.gemm_4bit.default(
            x, packed, state.shape, state.absmax, state.blocksize, state.quant_type, bias=bias
        )
    return torch.ops.bitsandbytes.gemm_4bit.default(
        x,
        packed,
        state.shape,
        state.state2.absmax,
        state.blocksize,
        state.quant_type,
        bias=bias,
        absmax_8bit=state.absmax,
        absmax_code=state.state2.code,
        absmax_offset=state.offset,
    )


def missing() -> str | None:
    """What the installed peft or bitsandbytes lacks that the fused forward calls, or None."""
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError:
        return "peft's bitsandbytes LoRA layers (peft.tuners.lora.bnb.Linear4bit)"
    if not hasattr(LoraLinear4bit, "_cast_input_dtype") or not hasattr(LoraLinear4bit, "_check_forward_args"):
        return "peft >= 0.15's LoRA layer methods (_cast_input_dtype)"
    op = getattr(getattr(torch.ops, "bitsandbytes", None), "gemm_4bit", None)
    if op is None or "absmax_8bit" not in str(op.default._schema):
        return "bitsandbytes' gemm_4bit op with double-quant arguments (absmax_8bit)"
    return None


def install(model: torch.nn.Module) -> int:
    """Give every peft LoRA layer over a bitsandbytes 4-bit linear the fused forward (its plain calls; peft's
    otherwise); the number of layers given it. Refused, with the versions, where peft or bitsandbytes lack a piece."""
    lacks = missing()
    if lacks is not None:
        import importlib.metadata as md

        from finetune.errors import ModelError

        have = ", ".join(f"{p} {md.version(p)}" for p in ("peft", "bitsandbytes"))
        raise ModelError(
            f"model.kernels=finetune calls {lacks}, which this environment lacks ({have})",
            hint="upgrade peft and bitsandbytes (pip install -U peft bitsandbytes), or set model.kernels=auto",
        )
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    n = 0
    for module in model.modules():
        if isinstance(module, LoraLinear4bit) and getattr(module.forward, "__func__", None) is not _fused_forward:
            module.forward = types.MethodType(_fused_forward, module)  # type: ignore[method-assign]
            n += 1
    return n


def _plain(layer: Any, kwargs: dict[str, Any]) -> str | None:
    """The one adapter the fused forward can run for this call, or None (peft's forward runs)."""
    if kwargs or layer.disable_adapters or layer.merged or not torch.is_grad_enabled() or not layer.training:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in layer.lora_variant:
        return None
    state = getattr(layer.base_layer.weight, "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False) or len(state.shape) != 2:
        return None
    return active[0]


def _fused_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's Linear4bit.forward for one plain adapter, through LoraOver4bit (the same casts, in the same places)."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    base = self.base_layer
    fix_4bit_weight_quant_state_from_module(base)  # FSDP's gathered weight lost it: bitsandbytes' own repair
    name = None if args or x.numel() == 0 else _plain(self, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    if not base.compute_type_is_set:
        base.set_compute_type(x)
        base.compute_type_is_set = True
    inp_dtype = x.dtype
    xc = x.to(base.compute_dtype) if base.compute_dtype is not None else x
    bias = base.bias
    if bias is not None:
        if bias.dtype != xc.dtype:
            bias.data = bias.data.to(xc.dtype)
        bias = bias.to(base.compute_dtype)
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    # peft casts the adapter's input (and its output back) only outside CUDA's autocast (torch.is_autocast_enabled()
    # asks CUDA's), and so does this: the same tensors saved, the same dropout draws, on any device.
    convert = not torch.is_autocast_enabled()
    d = self.lora_dropout[name](self._cast_input_dtype(x, lora_a.weight.dtype) if convert else x)
    packed = base.weight.view(-1, 1)  # the canonical layout bitsandbytes' matmul takes
    state = base.weight.quant_state
    base_out, lora_out = LoraOver4bit.apply(xc, d, packed, state, bias, lora_a.weight, lora_b.weight, self.scaling[name])
    result = base_out.to(inp_dtype)
    return result + (lora_out.to(result.dtype) if convert else lora_out)
