"""model.attn_implementation=varlen: attention over packed rows with no (T x T) mask.

A packed row holds several examples, told apart by where its position_ids restart. transformers'
sdpa and eager paths turn that into a block-causal (rows, 1, T, T) mask: every row costs T^2
scores however many examples it holds, and at 131,072 tokens the bool mask alone is 16 GiB.
Here the batch is flattened to one token axis and cut into segments (cu_seqlens, as flash
attention's varlen kernels take them), and each segment is a causal attention of its own:

  - on CUDA in bf16/fp16: torch's own varlen flash kernel (torch.nn.attention.varlen), one
    call for the whole batch; no flash-attn wheel to build;
  - elsewhere (the CPU, fp32, attention dropout): one causal sdpa call per segment; the same
    attention, sum(s^2)/2 scores instead of T^2, and many small calls.

Cuts: the start of every row, every position_ids restart (a packed example), and every change
of the 2D padding mask (padding is a segment of its own that no real token sees, left or
right). The mask function registered with it is transformers' flash-attention one: the 2D
padding mask or None, never a 4-D mask. With a KV cache (generation: fewer queries than keys)
one sdpa call with the causal + padding mask runs instead.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

NAME = "varlen"


def register() -> str:
    """Make `varlen` an attention implementation transformers loads by name; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


ON_CPU_FROM = 1024  # data.max_seq_len from which auto attention on a CPU cuts packed rows per example


def auto_cuts_packed_rows(packed: bool, seq_len: int, device_type: str, compute_bytes: int, varlen_ok: bool) -> bool:
    """Whether model.attn_implementation=auto attends per example in packed rows (varlen), for the loader
    and the planner alike. Measured (benchmarks/README.md): on CUDA in 16-bit torch's varlen flash kernel
    trained 1.36x the tokens/s of sdpa's masked rows (H100, Llama-3.1-8B 4-bit, rows of 2048); on a CPU
    one sdpa call per example is 1.6x at 2048 tokens, 2.9x at 8192, no gain at 512."""
    if not (packed and varlen_ok):
        return False
    if device_type == "cuda":
        return compute_bytes == 2 and flash_kernel() is not None
    return device_type == "cpu" and seq_len >= ON_CPU_FROM


@cache  # asked by every attention call on CUDA: the signature is read once per process
def flash_kernel() -> Callable[..., Any] | None:
    """torch's varlen flash kernel, when this torch has one finetune can call (torch.nn.attention.varlen with
    `scale` and `window_size`: seen in torch 2.11 and 2.13); None: CUDA runs take the per-segment path."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if {"scale", "window_size"} <= set(inspect.signature(varlen_attn).parameters) else None


@cache
def _takes_gqa(kernel: Callable[..., Any]) -> bool:
    """torch 2.13's kernel pairs query and KV heads itself (enable_gqa); 2.11's does not."""
    return "enable_gqa" in inspect.signature(kernel).parameters


def runs(model_class: Any, config: Any) -> bool:
    """Whether varlen can be this model's attention: its class takes registered attention functions
    and its attention computes nothing varlen leaves out (unsupported). The loader and the planner ask."""
    return bool(getattr(model_class, "_supports_attention_backend", False)) and unsupported(config) is None


def unsupported(config: Any) -> str | None:
    """Why a model's attention cannot run here (None: it can): what varlen kernels do not compute
    (logit softcapping, attention sinks, chunked attention)."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and getattr(cfg, "attn_logit_softcapping", None):
            return f"{cfg.model_type} caps its attention logits (attn_logit_softcapping), which the varlen kernels do not"
        if cfg is not None and (
            getattr(cfg, "attention_chunk_size", None) or "chunked_attention" in (getattr(cfg, "layer_types", None) or ())
        ):
            # transformers' flash mask function drops the chunk size: attention would silently span chunks
            return f"{cfg.model_type} attends in chunks (attention_chunk_size), which the varlen kernels do not"
    if getattr(config, "model_type", None) == "gpt_oss":
        return "gpt_oss adds attention sinks, which the varlen kernels do not"
    return None


def restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """(rows, T) booleans: where a row's next packed example starts (its first token, and wherever the
    positions do not continue)."""
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return new


def segment_starts(
    position_ids: torch.Tensor | None, padding: torch.Tensor | None, rows: int, length: int, device: torch.device | None = None
) -> torch.Tensor:
    """cu_seqlens (int32, starts of every segment plus the total) of `rows` x `length` tokens flattened.

    position_ids [[0, 1, 2, 0, 1, 0]], no padding        -> [0, 3, 5, 6]
    position_ids None, padding [[1, 1, 0], [1, 1, 1]]    -> [0, 2, 3, 6]
    """
    new = torch.zeros(rows, length, dtype=torch.bool, device=device)
    new[:, 0] = True
    if position_ids is not None:
        new |= restarts(position_ids.to(new.device).expand(rows, length))
    if padding is not None:
        pad = padding[:, -length:].to(new.device).bool()
        new[:, 1:] |= pad[:, 1:] != pad[:, :-1]  # into or out of padding
    starts = new.flatten().nonzero().flatten()
    total = torch.tensor([rows * length], device=starts.device)
    return torch.cat([starts, total]).to(torch.int32)


class _LastCuts:
    """The cut points of the last batch, on the device and as a host list, and its longest segment. Every layer of a forward
    (and every checkpointed recomputation) is handed the same position_ids and mask tensors, and
    computing the cuts costs two host syncs on CUDA (nonzero, the list): once per batch, not per
    layer. Reused only while those very tensors are alive and unmodified (same object, same version)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.refs: tuple = ()
        self.value: tuple[torch.Tensor, list[int], int] | None = None

    def get(self, position_ids, mask, rows: int, length: int, device) -> tuple[torch.Tensor, list[int], int]:
        given = (position_ids, mask)
        key = (rows, length, str(device), *(None if t is None else t._version for t in given))
        held = tuple(None if r is None else r() for r in self.refs)
        if self.value is not None and key == self.key and len(held) == 2 and all(h is t for h, t in zip(held, given)):
            return self.value
        cu = segment_starts(position_ids, mask, rows, length, device=device)
        self.refs = tuple(None if t is None else weakref.ref(t) for t in given)
        bounds = cu.tolist()
        self.key, self.value = key, (cu, bounds, max(e - a for a, e in zip(bounds, bounds[1:])))
        return self.value


_LAST_CUTS = _LastCuts()


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, H, T, D), key/value (B, Hkv, S, D) -> (B, T, H, D)."""
    if softcap or kwargs.get("s_aux") is not None or is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(
            "model.attn_implementation=varlen computes causal attention without logit softcapping or sinks; "
            "this model's attention needs them: use model.attn_implementation=sdpa or eager"
        )
    rows, heads, length, _ = query.shape
    if key.shape[2] != length:  # a KV cache: generation
        return _cached(query, key, value, attention_mask, scaling, sliding_window), None
    cu, bounds, longest = _LAST_CUTS.get(kwargs.get("position_ids"), attention_mask, rows, length, query.device)
    q, k, v = (t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[3]) for t in (query, key, value))
    dropout = dropout if module.training else 0.0
    flash_dtype = query.dtype
    if query.is_cuda and query.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        flash_dtype = torch.get_autocast_dtype("cuda")  # fp32 weights under autocast (fp16 full fine-tuning)
    kernel = flash_kernel() if query.is_cuda and flash_dtype in (torch.float16, torch.bfloat16) and dropout == 0.0 else None
    if kernel is not None:
        out = _flash_varlen(kernel, q.to(flash_dtype), k.to(flash_dtype), v.to(flash_dtype), cu, longest, scaling, sliding_window)
    else:
        out = _per_segment(q, k, v, bounds, scaling, sliding_window, dropout)
    return out.reshape(rows, length, heads, -1), None


def _flash_varlen(kernel, q, k, v, cu: torch.Tensor, longest: int, scaling, sliding_window) -> torch.Tensor:
    window = (sliding_window - 1, 0) if sliding_window else (-1, 0)  # (-1, 0): causal, whole segment
    v_dim = v.shape[-1]
    if v_dim != q.shape[-1]:  # flash kernels take one head size: pad V (MLA) and crop the output
        v = F.pad(v, [0, q.shape[-1] - v_dim])
    extra = {}
    if k.shape[1] != q.shape[1] and _takes_gqa(kernel):
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # torch 2.11: query head h reads KV head h // g
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=window, **extra)
    out = out[0] if isinstance(out, tuple) else out  # a tuple only when asked for the logsumexp
    return out[..., :v_dim]


def _per_segment(q, k, v, bounds: list[int], scaling, sliding_window, dropout: float) -> torch.Tensor:
    """Each segment a causal sdpa call of its own; (tokens, heads, dim) in and out."""
    gqa = k.shape[1] != q.shape[1]
    parts = []
    for a, e in zip(bounds, bounds[1:]):
        s = e - a
        mask = None
        if sliding_window and s > sliding_window:
            i = torch.arange(s, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        out = F.scaled_dot_product_attention(
            q[a:e].transpose(0, 1),
            k[a:e].transpose(0, 1),
            v[a:e].transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        parts.append(out.transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cached(query, key, value, attention_mask, scaling, sliding_window) -> torch.Tensor:
    """Queries are the last T of S keys: causal + padding (+ window) mask, one sdpa call. A query
    with nothing to see (left padding) sees itself, so no NaN reaches the real tokens."""
    length, keys = query.shape[2], key.shape[2]
    qi = torch.arange(keys - length, keys, device=query.device)[:, None]
    ki = torch.arange(keys, device=query.device)[None, :]
    allowed = ki <= qi
    if sliding_window:
        allowed &= ki > qi - sliding_window
    mask = allowed[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -keys:].bool()
    mask = mask | (ki == qi)[None, None]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous()
