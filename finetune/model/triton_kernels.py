"""Triton kernels for model.kernels=finetune (issue 48): the 4-bit matmul with NF4 dequantization inside the GEMM's tile
(no dequantized weight is ever written out), and the gated MLP's SwiGLU tail, forward and backward, in one pass each.

    nf4_matmul(a, packed, state, transposed)   a @ W^T (a linear's forward) or a @ W (its input's gradient)
    swiglu(e, g)                               silu(e) * g
    swiglu_backward(dh, e, g)                  (de, dg)

Each is what the eager path computes (bitsandbytes' dequantize_4bit then a matmul; torch's silu and its backward) up
to the order of a sum, checked against it on the CPU under Triton's interpreter (TRITON_INTERPRET=1, the test extra
installs triton). Imported only where `usable` says a kernel can run: a CUDA tensor with triton installed, or the
interpreter; everywhere else the eager path runs, and model/kernels.py says which at setup.
FINETUNE_TRITON=0 keeps the eager path on a GPU too: a lease measures the fused nodes with and without these kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Tile sizes (tl.dot needs 16 or more a side); untuned: a GPU lease measures them against bitsandbytes + cuBLAS.
BLOCK_M, BLOCK_P, BLOCK_Q, BLOCK = 64, 64, 32, 1024
# Triton's interpreter multiplies 16-bit tiles wrongly (a bf16 tl.dot was off by 1e10 here) and truncates fp32 to
# bf16 where a GPU rounds to nearest even: under it the kernels upcast before a dot and round by hand (`_rounded`).
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """x (fp32) in DTYPE, rounded to nearest even (the interpreter's bf16 cast truncates: rounded here first)."""
    if INTERP and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _nf4_matmul_kernel(a_ptr, packed_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, c_ptr, M, P, Q,
                       stride_am, stride_cm, w_stride_q, w_stride_p, blocksize, blocksize2,
                       NESTED: tl.constexpr, W_DTYPE: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                       BM: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr):  # fmt: skip
    """C[M, P] = A[M, Q] @ B[Q, P], B[q, p] the weight's element at flat index q * w_stride_q + p * w_stride_p."""
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # (rows x width passes 2^31 at long context)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    acc = tl.zeros((BM, BP), dtype=tl.float32)
    for q0 in range(0, Q, BQ):
        rq = q0 + tl.arange(0, BQ)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rq[None, :], mask=(rm[:, None] < M) & (rq[None, :] < Q), other=0.0)
        inside = (rq[:, None] < Q) & (rp[None, :] < P)
        idx = rq[:, None].to(tl.int64) * w_stride_q + rp[None, :].to(tl.int64) * w_stride_p
        byte = tl.load(packed_ptr + idx // 2, mask=inside, other=0).to(tl.int32)
        nibble = tl.where(idx % 2 == 0, byte >> 4, byte & 15)  # bitsandbytes packs the even element high
        value = tl.load(code_ptr + nibble, mask=inside, other=0.0)
        block = idx // blocksize
        if NESTED:  # double quant: each block's absmax an 8-bit code of its group's absmax, plus the offset
            code = tl.load(absmax_ptr + block, mask=inside, other=0).to(tl.int32)
            offset = tl.load(offset_ptr)  # (read on the device: a host copy per call would wait for the GPU)
            scale = tl.load(code2_ptr + code, mask=inside, other=0.0) * tl.load(absmax2_ptr + block // blocksize2, mask=inside, other=0.0) + offset  # fmt: skip
        else:
            scale = tl.load(absmax_ptr + block, mask=inside, other=0.0)
        w = _rounded(value * scale, W_DTYPE, INTERP)  # dequantize_4bit's dtype, then the matmul's (as the eager path)
        w = _rounded(w.to(tl.float32), a.dtype, INTERP)
        if IEEE:  # fp32 operands (16-bit ones upcast exactly: their products fit fp32, as in a 16-bit MMA)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out = c_ptr + rm[:, None] * stride_cm + rp[None, :]
    tl.store(out, _rounded(acc, c_ptr.dtype.element_ty, INTERP), mask=(rm[:, None] < M) & (rp[None, :] < P))


def nf4_matmul(a: torch.Tensor, packed: torch.Tensor, state, transposed: bool = True) -> torch.Tensor:
    """a @ W^T (transposed: a linear's forward) or a @ W, W [out, in] the NF4 weight `packed` with bitsandbytes'
    quantization `state` (double quant or not), in a's dtype."""
    n_out, n_in = state.shape
    q_size, p_size = (n_in, n_out) if transposed else (n_out, n_in)
    if a.shape[-1] != q_size:
        raise ValueError(
            f"nf4_matmul: a's last dimension is {a.shape[-1]}, the weight's {'in' if transposed else 'out'} is {q_size}"
        )
    flat = a.reshape(-1, q_size).contiguous()
    c = torch.empty(flat.shape[0], p_size, dtype=a.dtype, device=a.device)
    packed = packed.reshape(-1).view(torch.uint8)  # (FSDP loads it stored as the compute dtype: bytes all the same)
    nested = bool(state.nested)
    absmax2 = state.state2.absmax if nested else state.absmax
    code2 = state.state2.code if nested else state.code
    offset = state.offset.reshape(1) if nested else state.absmax  # (a pointer the kernel reads only when nested)
    grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(p_size, BLOCK_P))
    _nf4_matmul_kernel[grid](
        flat, packed, state.code, state.absmax, code2, absmax2, offset, c, flat.shape[0], p_size, q_size,
        flat.stride(0), c.stride(0), 1 if transposed else n_in, n_in if transposed else 1,
        state.blocksize, state.state2.blocksize if nested else 1,
        NESTED=nested, W_DTYPE=_TL[state.dtype], IEEE=a.dtype == torch.float32 or INTERPRETING, INTERP=INTERPRETING, BM=BLOCK_M, BP=BLOCK_P, BQ=BLOCK_Q,
    )  # fmt: skip
    return c.view(*a.shape[:-1], p_size)


@triton.jit
def _swiglu_kernel(e_ptr, g_ptr, h_ptr, n, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    e = tl.load(e_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    act = _rounded(e * tl.sigmoid(e), h_ptr.dtype.element_ty, INTERP).to(tl.float32)  # as torch's silu rounds it
    tl.store(h_ptr + offs, _rounded(act * g, h_ptr.dtype.element_ty, INTERP), mask=inside)


@triton.jit
def _swiglu_backward_kernel(dh_ptr, e_ptr, g_ptr, de_ptr, dg_ptr, n, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    dh = tl.load(dh_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    e = tl.load(e_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s = tl.sigmoid(e)
    act = _rounded(e * s, e_ptr.dtype.element_ty, INTERP).to(tl.float32)
    g_act = _rounded(dh * g, dh_ptr.dtype.element_ty, INTERP).to(tl.float32)  # the product's gradient, as autograd's
    tl.store(dg_ptr + offs, _rounded(dh * act, dg_ptr.dtype.element_ty, INTERP), mask=inside)
    tl.store(de_ptr + offs, _rounded(g_act * s * (1 + e * (1 - s)), de_ptr.dtype.element_ty, INTERP), mask=inside)


def swiglu(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """silu(e) * g in e's dtype, one pass."""
    e, g = e.contiguous(), g.contiguous()
    h = torch.empty_like(e)
    _swiglu_kernel[(triton.cdiv(e.numel(), BLOCK),)](e, g, h, e.numel(), BLOCK=BLOCK, INTERP=INTERPRETING)
    return h


def swiglu_backward(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(de, dg) of h = silu(e) * g for h's gradient dh, one pass."""
    dh, e, g = dh.contiguous(), e.contiguous(), g.contiguous()
    de, dg = torch.empty_like(e), torch.empty_like(g)
    _swiglu_backward_kernel[(triton.cdiv(e.numel(), BLOCK),)](dh, e, g, de, dg, e.numel(), BLOCK=BLOCK, INTERP=INTERPRETING)
    return de, dg
