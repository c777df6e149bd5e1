"""model.kernels=finetune: a gated MLP, down(act(gate(x)) * up(x)), whose three projections are LoRA'd 4-bit linears,
as one autograd node (issue 48's fused MLP block: what Unsloth's fast LoRA MLP does, on our own terms).

Each projection's arithmetic is fast_lora's (linear_forward / linear_backward: bitsandbytes' 4-bit matmul and its
dequantization, the adapter's products in autograd's order). What the block changes is what waits for backward:
the gate's and up's outputs e and g, the adapters' rank-wide products, and the down adapter's dropout mask as bytes.
act(e) and the down adapter's dropped input (in the adapter's dtype: fp32 beside bf16 compute), which peft keeps,
are recomputed from e and g in backward, with the product h. The activation's gradient is torch's own kernel (aten.silu_backward;
any other activation through autograd on the recomputed one), so the numbers are peft's within fp32 rounding.

Dropout: the gate's and up's adapters draw theirs before the node, as peft's modules; the down's inside it, with
torch.native_dropout (what nn.Dropout runs on CUDA; the same draws on a CPU), its mask kept. The block runs where the MLP's class computes exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))`
(read from its source: Llama, Mistral, Qwen2/3, Gemma 1-3 and a hundred more families in transformers), the three
projections are plain (fast_lora._plain) with one adapter, and none has a bias; elsewhere each projection runs
fast_lora's node. Phi-3's fused gate_up projection is another form (its linears get fast_lora's node); a mixture of
experts' experts in finetune's own 4-bit store (model/moe.py) keep their path, a shared expert of the form gets it.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, NamedTuple

import torch

from finetune.model.fast_lora import (
    _plain,
    adapter_input,
    autocast_of,
    linear_backward,
    linear_forward,
    prepared,
    repaired,
    summed,
    triton_for,
)

# The forward bodies (whitespace dropped) of the MLP classes the block computes.
GATED_FORMS = (
    "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj",
    "returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))",
)


class Projection(NamedTuple):
    """One projection's pieces for a call (no tensors autograd differentiates: those are the node's inputs)."""

    state: Any  # bitsandbytes' quantization state
    scale: float
    compute_dtype: torch.dtype | None
    convert: bool  # peft casts the adapter's input to its dtype and the output back (outside CUDA's autocast)


class Block(NamedTuple):
    gate: Projection
    up: Projection
    down: Projection
    act: torch.nn.Module
    dropout: torch.nn.Module  # the down adapter's (nn.Dropout or nn.Identity)


class GatedMlpOver4bit(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) over LoRA'd 4-bit projections in one node (see the module)."""

    @staticmethod
    def forward(ctx, x, d_gate, d_up, a_gate, b_gate, a_up, b_up, a_down, b_down, p_gate, p_up, p_down, block: Block):
        e, u_gate, casts_gate = _projected(x, d_gate, p_gate, a_gate, b_gate, block.gate)
        g, u_up, casts_up = _projected(x, d_up, p_up, a_up, b_up, block.up)
        kernels = triton_for(e) if _is_silu(block.act) else None
        h = block.act(e) * g if kernels is None else kernels.swiglu(e, g)
        d_h, mask = _dropped(h, a_down.dtype, block)
        y, u_down, casts_down = _projected(h, d_h, p_down, a_down, b_down, block.down)
        ctx.save_for_backward(x, d_gate, d_up, e, g, u_gate, u_up, u_down, mask, a_gate, b_gate, a_up, b_up, a_down, b_down, p_gate, p_up, p_down)  # fmt: skip
        ctx.block, ctx.casts, ctx.autocast = block, (casts_gate, casts_up, casts_down), autocast_of(x)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, d_gate, d_up, e, g, u_gate, u_up, u_down, mask, a_gate, b_gate, a_up, b_up, a_down, b_down, p_gate, p_up, p_down = ctx.saved_tensors  # fmt: skip
        block, (casts_gate, casts_up, casts_down), autocast = ctx.block, ctx.casts, ctx.autocast
        need = ctx.needs_input_grad
        kernels = triton_for(e) if _is_silu(block.act) else None
        if kernels is None:
            with torch.enable_grad():  # the activation recomputed: its gradient is then autograd's own
                e_ = e.detach().requires_grad_(not _is_silu(block.act))
                act = block.act(e_)
            h = act.detach() * g
        else:
            h = kernels.swiglu(e, g)
        d_h, _ = _dropped(h, a_down.dtype, block, mask)
        grads_down = _projection_backward(gy, h, d_h, u_down, a_down, b_down, p_down, block.down, casts_down, autocast)
        dh = grads_down[0]
        if grads_down[1] is not None:  # back through the down adapter's dropout and cast
            dh = dh + _dropped(grads_down[1].to(d_h.dtype), a_down.dtype, block, mask, scale_only=True)[0].to(h.dtype)
        if kernels is not None:
            de, dg = kernels.swiglu_backward(dh, e, g)
        else:
            g_act, dg = dh * g, dh * act.detach()
            de = torch.ops.aten.silu_backward(g_act, e) if _is_silu(block.act) else torch.autograd.grad(act, e_, g_act)[0]
        dx_gate, dd_gate, da_gate, db_gate = _projection_backward(de, x, d_gate, u_gate, a_gate, b_gate, p_gate, block.gate, casts_gate, autocast, need[0])  # fmt: skip
        dx_up, dd_up, da_up, db_up = _projection_backward(dg, x, d_up, u_up, a_up, b_up, p_up, block.up, casts_up, autocast, need[0])  # fmt: skip
        dx = dx_gate + dx_up if need[0] else None
        dd_gate = dd_gate.to(d_gate.dtype) if need[1] else None
        dd_up = dd_up.to(d_up.dtype) if need[2] else None
        return dx, dd_gate, dd_up, da_gate, db_gate, da_up, db_up, grads_down[2], grads_down[3], None, None, None, None


def _projected(x, d, packed, a, b, p: Projection) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.dtype, ...]]:
    """peft's output of one projection (base in the compute dtype, cast back, plus the adapter's), the adapter's
    d A^T, and the dtypes its backward casts the gradient to (the input's, the base's, the adapter output's)."""
    xc = x.to(p.compute_dtype) if p.compute_dtype is not None else x
    base, u, out = linear_forward(xc, d, packed, p.state, None, a, b, p.scale)
    return summed(base, out, x.dtype, p.convert), u, (x.dtype, base.dtype, out.dtype)


def _projection_backward(gy, x, d, u, a, b, packed, p: Projection, casts, autocast, need_x=True) -> tuple[Any, ...]:
    """(x's, d's, A's, B's gradients) of one projection, each through the casts autograd would run under peft (x's
    None where it needs none: no dequantization and matmul for it)."""
    x_dtype, base_dtype, out_dtype = casts
    g_base, g_out = gy.to(x_dtype).to(base_dtype), gy.to(out_dtype)
    dx, dd, da, db = linear_backward(g_base, g_out, d, u, a, b, packed, p.state, p.scale, autocast, (need_x, True, True, True))
    return dx.to(x.dtype) if need_x else None, dd, da, db


def _dropped(h, lora_dtype, block: Block, mask=None, scale_only: bool = False) -> tuple[torch.Tensor, Any]:
    """(the down adapter's input, the dropout's mask): peft's cast and dropout of h; with a mask, the same again
    (scale_only: the mask and scale applied to h as it is, the dropout's backward). The dropout is torch's
    native_dropout, the op nn.Dropout runs on CUDA (on a CPU: the same draws, and in fp32 the same numbers), and its
    backward op, which scales in fp32 and rounds once as its forward does."""
    hd = h if scale_only or not block.down.convert else h.to(lora_dtype)
    p = block.dropout.p if isinstance(block.dropout, torch.nn.Dropout) and block.dropout.training else 0.0
    if p == 0.0:
        return hd, None
    if mask is None:
        return torch.native_dropout(hd, p, True)
    return torch.ops.aten.native_dropout_backward(hd, mask, 1.0 / (1.0 - p)), mask


def _is_silu(act: torch.nn.Module) -> bool:
    return type(act).__name__ in ("SiLU", "SiLUActivation")


@functools.cache
def _gated(cls: Any) -> bool:
    """Whether the class's forward is exactly the gated MLP the block computes (read from its source)."""
    try:
        lines = inspect.getsource(cls.forward).splitlines()
    except (OSError, TypeError):
        return False
    body = [ln.strip() for ln in lines[1:] if ln.strip() and not ln.strip().startswith("#")]
    return "".join("".join(body).split()) in GATED_FORMS and lines[0].strip().replace(" ", "") == "defforward(self,x):"


def worth_it(device_type: str) -> bool:
    """Whether model.kernels=finetune gives the MLPs the block on this device: on CUDA, where its recomputation is one
    fused pass (Triton's SwiGLU) beside GEMMs that dwarf it. On a CPU the recomputed elementwise passes cost more than
    they save (benchmarks/mlp_block.py, the demo's MLP in fp32: 14.75 ms against 12.24 ms as per-projection nodes at
    dropout 0.05, 8.48 against 7.60 ms at 0), and memory is not what a CPU run is short of."""
    return device_type == "cuda"


def install(model: torch.nn.Module) -> int:
    """Give every gated MLP over peft LoRA'd 4-bit projections the block's forward; the number given it."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    n = 0
    for module in model.modules():
        parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, LoraLinear4bit) for p in parts) or not _gated(type(module)):  # type: ignore[arg-type]
            continue
        if getattr(module.forward, "__func__", None) is not _block_forward:
            module.forward = types.MethodType(_block_forward, module)
            n += 1
    return n


def _block_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The MLP through GatedMlpOver4bit where its projections allow; its own forward otherwise."""
    layers = (self.gate_proj, self.up_proj, self.down_proj)
    for layer in layers:
        repaired(layer)  # before _plain reads the quantization state
    names = {_plain(layer, {}) for layer in layers}
    name = names.pop() if len(names) == 1 else None  # the one adapter all three run
    if x.numel() == 0 or name is None or any(layer.base_layer.bias is not None for layer in layers):
        return type(self).forward(self, x)
    parts, packed = [], []
    for layer in layers:
        p, compute_dtype, _, convert = prepared(layer, x)
        packed.append(p)
        parts.append(Projection(layer.base_layer.weight.quant_state, layer.scaling[name], compute_dtype, convert))
    gate, up, down = layers
    adapters = [w for layer in layers for w in (layer.lora_A[name].weight, layer.lora_B[name].weight)]
    d_gate, d_up = (adapter_input(layer, name, x, part.convert) for layer, part in zip((gate, up), parts[:2], strict=True))
    block = Block(parts[0], parts[1], parts[2], act=self.act_fn, dropout=down.lora_dropout[name])
    return GatedMlpOver4bit.apply(x, d_gate, d_up, *adapters, *packed, block)
