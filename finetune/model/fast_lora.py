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

import functools
import importlib.util
import os
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
        base, u, out = linear_forward(x, d, packed, state, bias, a, b, scale)
        # The packed weight saved as a tensor, not a ctx attribute: activation checkpointing then drops it after
        # forward, and a streamed layer's device copy is freed (memory/stream.py's _Saved4bitMatmul, for the same reason).
        ctx.save_for_backward(d, u, a, b, packed)
        ctx.state, ctx.scale, ctx.autocast = state, scale, autocast_of(d)
        return base, out

    @staticmethod
    def backward(ctx, g_base, g_out):
        d, u, a, b, packed = ctx.saved_tensors
        need_x, need_d, _, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        need = (need_x, need_d, need_a, need_b)
        dx, dd, da, db = linear_backward(g_base, g_out, d, u, a, b, packed, ctx.state, ctx.scale, ctx.autocast, need)
        dbias = g_base.reshape(-1, g_base.shape[-1]).sum(0) if need_bias else None
        return dx, dd, None, None, dbias, da, db, None


def linear_forward(x, d, packed, state, bias, a, b, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the base 4-bit matmul of x, the adapter's d A^T, its output ((d A^T) B^T) s): one LoRA'd linear, no graph."""
    kernels = triton_for(x)
    with _range(BASE_RANGE):
        if kernels is None:
            base = _gemm_4bit(x, packed, state, bias)
        else:
            base = kernels.nf4_matmul(x, packed, state, transposed=True)
            base = base if bias is None else base + bias
    with _range(ADAPTER_RANGE):
        u = F.linear(d, a)  # (under mixed precision, in autocast's dtype: as lora_A and lora_B run in peft)
        out = F.linear(u, b) * scale
    return base, u, out


def autocast_of(t: torch.Tensor) -> tuple[str, torch.dtype] | None:
    """The autocast a forward ran under on t's device (its backward's adapter products run under the same)."""
    kind = t.device.type
    return (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None


def linear_backward(g_base, g_out, d, u, a, b, packed, state, scale: float, autocast, need) -> tuple[Any, ...]:
    """The gradients (x, d, A, B) of linear_forward's outputs' gradients; need: which of the four to compute."""
    import bitsandbytes.functional as bnbf

    need_x, need_d, need_a, need_b = need
    dx = dd = da = db = None
    if need_x:  # W dequantized once for the input's gradient, as bitsandbytes' backward does (or in Triton's tiles)
        kernels = triton_for(g_base)
        with _range(BASE_RANGE):
            if kernels is None:
                dx = torch.matmul(g_base, bnbf.dequantize_4bit(packed, state).to(g_base.dtype))
            else:
                dx = kernels.nf4_matmul(g_base, packed, state, transposed=False)
    # The adapter's products under the forward's autocast, as autograd runs theirs in peft (the gradients come
    # back in autocast's dtype: autograd casts each to its input's dtype, as peft's casts' backward would).
    with torch.autocast(*autocast) if autocast else nullcontext(), _range(ADAPTER_RANGE):
        # Each product as autograd's own for a linear (a weight's gradient: input^T grad, transposed), so that
        # the reductions run in the same order: bitwise peft's in fp32, and in bf16 too.
        go = (g_out * scale).reshape(-1, g_out.shape[-1])  # the gradient of (d A^T) B^T, flat
        if need_b:
            db = u.reshape(-1, u.shape[-1]).t().mm(go).t()
        gu = go.mm(b)  # the gradient of d A^T
        if need_a:
            da = d.reshape(-1, d.shape[-1]).t().mm(gu).t()
        if need_d:
            dd = gu.mm(a).view(*d.shape[:-1], a.shape[-1])
    return dx, dd, da, db


def triton_for(t: torch.Tensor) -> Any:
    """model/triton_kernels.py where its kernels run on t: a CUDA tensor with triton installed, or a CPU one under
    Triton's interpreter when FINETUNE_TRITON=interpret asks (tests); else None: the eager ops. FINETUNE_TRITON=0: None."""
    mode = os.environ.get("FINETUNE_TRITON", "")
    if mode == "0" or not (t.is_cuda or (mode == "interpret" and t.device.type == "cpu")):
        return None
    kernels = _triton_kernels()
    if kernels is not None and t.device.type == "cpu" and not kernels.INTERPRETING:
        from finetune.errors import ModelError

        raise ModelError(
            "FINETUNE_TRITON=interpret: triton was imported without its interpreter",
            hint="set TRITON_INTERPRET=1 in the environment before the process starts (triton reads it when imported)",
        )
    return kernels


@functools.cache
def _triton_kernels() -> Any:
    try:
        from finetune.model import triton_kernels
    except ImportError:  # (no triton: model/kernels.py says so at setup)
        return None
    return triton_kernels


def triton_note(device_type: str) -> str:
    """What the fused nodes run their 4-bit matmuls and SwiGLU with on this device, for the setup's kernels line."""
    if device_type != "cuda":
        return "bitsandbytes' 4-bit matmul and torch's ops (Triton's kernels run on CUDA)"
    if os.environ.get("FINETUNE_TRITON") == "0":
        return "bitsandbytes' 4-bit matmul and torch's ops (FINETUNE_TRITON=0)"
    if importlib.util.find_spec("triton") is None:
        return "bitsandbytes' 4-bit matmul and torch's ops: triton is not installed (pip install triton for its kernels)"
    return "Triton's NF4 matmul and SwiGLU (model/triton_kernels.py)"


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


def prepared(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None, torch.Tensor | None, bool]:
    """What peft's Linear4bit.forward does before its matmuls: (the packed weight, bitsandbytes' compute dtype, the
    bias in it, whether the adapter's input and output are cast: peft casts them only outside CUDA's autocast)."""
    base = layer.base_layer
    if not base.compute_type_is_set:
        base.set_compute_type(x)
        base.compute_type_is_set = True
    bias = base.bias
    if bias is not None:
        if bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype if base.compute_dtype is None else base.compute_dtype)
        bias = bias.to(base.compute_dtype)
    # (torch.is_autocast_enabled() asks CUDA's autocast: on any device the fused path takes peft's branch)
    return base.weight.view(-1, 1), base.compute_dtype, bias, not torch.is_autocast_enabled()


def repaired(layer: Any) -> None:
    """bitsandbytes' own repair of a 4-bit weight that lost its quantization state (FSDP's all-gather hands the layer
    a plain Parameter; the state waits on the module): before _plain reads it, or every FSDP call would run peft's."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    fix_4bit_weight_quant_state_from_module(layer.base_layer)


def _fused_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's Linear4bit.forward for one plain adapter, through LoraOver4bit (the same casts, in the same places)."""
    repaired(self)
    name = None if args or x.numel() == 0 else _plain(self, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    packed, compute_dtype, bias, convert = prepared(self, x)  # packed: the layout bitsandbytes' matmul takes
    xc = x.to(compute_dtype) if compute_dtype is not None else x
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    state = self.base_layer.weight.quant_state
    d = adapter_input(self, name, x, convert)
    base_out, lora_out = LoraOver4bit.apply(xc, d, packed, state, bias, lora_a.weight, lora_b.weight, self.scaling[name])
    return summed(base_out, lora_out, x.dtype, convert)


def adapter_input(layer: Any, name: str, x: torch.Tensor, convert: bool) -> torch.Tensor:
    """x as peft's adapter `name` sees it: cast to its dtype where peft casts (convert), then its dropout."""
    return layer.lora_dropout[name](layer._cast_input_dtype(x, layer.lora_A[name].weight.dtype) if convert else x)


def summed(base_out: torch.Tensor, lora_out: torch.Tensor, dtype: torch.dtype, convert: bool) -> torch.Tensor:
    """peft's output of a LoRA'd 4-bit linear: the base's cast back to the input's dtype, plus the adapter's (cast too
    where peft casts)."""
    result = base_out.to(dtype)
    return result + (lora_out.to(result.dtype) if convert else lora_out)
