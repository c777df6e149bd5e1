"""Attention over a sequence split between the ranks of a context-parallel group (parallel/context.py).

Each rank holds two of the sequence's 2N chunks, a head chunk and a tail chunk (rank r: chunks r and
2N-1-r), so that under causal attention every rank has the same work.

  ring      the K/V of each rank travel around the group (N-1 hops in forward, overlapped with the attention
            of the block in hand); each block's partial attention is merged by its log-sum-exp, as flash
            attention merges tiles. Backward runs the ring again with the dK/dV accumulators travelling with
            their K/V, so each rank keeps only its own queries, keys, output and log-sum-exp.
  ulysses   an all-to-all trades the sequence split for a head split: each rank attends over the whole
            sequence with heads/N heads, then a second all-to-all gives every rank its tokens back.

Blocks of unpacked rows are whole chunk pairs, each fully visible, causal or invisible: they run in torch's
flash kernels with log-sum-exp (the CPU one here, the CUDA one on a GPU). Packed rows keep their examples
apart by a mask from each token's segment; those blocks run in plain matmuls, which handle rows that see
nothing in a block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from finetune.parallel import waits


@dataclass(frozen=True)
class SplitRows:
    """How a batch of rows is split over a context-parallel group, as every rank of it knows:
    chunk: tokens per chunk (each rank holds 2 chunks); segments: (rows, 2N x chunk) the example each token
    belongs to, in sequence order (packed rows), or None (one causal row each; padding lies at the end)."""

    ranks: tuple[int, ...]  # global ranks, in the order of their parts
    index: int  # this rank's place in ranks
    chunk: int
    segments: torch.Tensor | None
    group: Any = None  # the torch.distributed group of ranks

    @property
    def size(self) -> int:
        return len(self.ranks)

    def chunks_of(self, index: int) -> tuple[int, int]:
        """The two chunks (in sequence order) a rank holds: a head and a tail, for equal causal work."""
        return index, 2 * self.size - 1 - index

    def positions_of(self, index: int, device: torch.device | None = None) -> torch.Tensor:
        """The sequence positions of a rank's tokens, in the order it holds them."""
        c = self.chunk
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in self.chunks_of(index)])

    def sequence_order(self, device: torch.device | None = None) -> torch.Tensor:
        """Where each token of the parts concatenated in rank order stands in the sequence."""
        return torch.cat([self.positions_of(i, device) for i in range(self.size)])


# ---------------------------------------------------------------------- one block of queries x keys


def _flash_forward(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of one block from torch's flash kernel for the device."""
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    """dq, dk, dv of one block given the merged output and log-sum-exp (each block's softmax is then exact)."""
    if q.is_cuda:
        n, m = q.shape[2], k.shape[2]
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, n, m, 0.0, causal, zero, zero, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _masked_forward(q, k, v, scale: float, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of one block under a (rows, 1, n, m) boolean mask; a row that sees nothing gives 0 and -inf."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return (p @ v.float()).to(q.dtype), lse


def _masked_backward(dout, q, k, v, out, lse, scale: float, mask: torch.Tensor):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    p = torch.exp(s.masked_fill(~mask, float("-inf")) - lse[..., None])
    dp = dout.float() @ v.float().transpose(-1, -2)
    ds = p * (dp - (dout.float() * out.float()).sum(-1, keepdim=True))
    dq, dk, dv = (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, p.transpose(-1, -2) @ dout.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_runs(q, mask: torch.Tensor | None) -> bool:
    """Whether a block runs in torch's flash kernel: a whole or causal pair, and not fp32 on CUDA (16-bit only)."""
    return mask is None and not (q.is_cuda and q.dtype == torch.float32)


def _kernel_kv(q, k, v, mask: torch.Tensor | None):
    """K/V as the block's kernel takes them: the CPU flash kernel pairs grouped heads itself; CUDA's and the
    masked matmuls get them repeated here, one chunk at a time (the K/V that travel keep their own head count)."""
    if _flash_runs(q, mask) and not q.is_cuda:
        return k, v
    return expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])


def _block_forward(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None):
    """(out, logsumexp) of my queries' chunk against one chunk of keys (at their own K/V head count)."""
    kk, vv = _kernel_kv(q, k, v, mask)
    if _flash_runs(q, mask):
        return _flash_forward(q, kk, vv, scale, causal)
    return _masked_forward(q, kk, vv, scale, _whole(mask, causal, q, k))


def _block_backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask: torch.Tensor | None):
    """dq, and dk, dv at the keys' own head count."""
    kk, vv = _kernel_kv(q, k, v, mask)
    if _flash_runs(q, mask):
        dq, dk, dv = _flash_backward(dout, q, kk, vv, out, lse.contiguous(), scale, causal)
    else:
        dq, dk, dv = _masked_backward(dout, q, kk, vv, out, lse, scale, _whole(mask, causal, q, k))
    return dq, _fold(dk, k.shape[1]), _fold(dv, k.shape[1])


def _whole(mask: torch.Tensor | None, causal: bool, q, k) -> torch.Tensor:
    if mask is not None:
        return mask
    seen = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    return seen.tril() if causal else seen


def _pairs(split: SplitRows, mine: int, theirs: int):
    """(my chunk slot, their chunk slot, causal, mask) for every pair of chunks in which my queries see
    some of their keys; mask None: the whole pair (or its causal half) is visible."""
    c = split.chunk
    for a, qc in enumerate(split.chunks_of(mine)):
        for b, kc in enumerate(split.chunks_of(theirs)):
            if kc > qc:
                continue  # their chunk lies wholly after mine
            mask = None
            if split.segments is not None:
                seg_q, seg_k = split.segments[:, qc * c : (qc + 1) * c], split.segments[:, kc * c : (kc + 1) * c]
                mask = seg_q[:, None, :, None] == seg_k[:, None, None, :]
                if kc == qc:
                    mask = mask & torch.ones(c, c, dtype=torch.bool, device=mask.device).tril()
            yield a, b, kc == qc, mask


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated for the query heads they serve (grouped-query attention), as transformers pairs them."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient of repeated K/V heads summed back onto the heads that were repeated."""
    b, h, n, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, n, d).sum(2)


# ---------------------------------------------------------------------- the ring


def _rotate(split: SplitRows, tensors: list[torch.Tensor]):
    """Send each tensor to the next rank and receive the previous rank's: (requests, received)."""
    if split.size == 1:  # a group of one: its own blocks come back to it
        return [], tensors
    nxt, prev = split.ranks[(split.index + 1) % split.size], split.ranks[(split.index - 1) % split.size]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, split.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, split.group) for r in received]
    return dist.batch_isend_irecv(ops), received


class WaitClock:
    """Seconds this process spent waiting on the ring's transfers (what compute did not hide): read by
    benchmarks/context_parallel_cpu.py."""

    waited_s = 0.0


def _wait(requests, device: torch.device) -> None:
    start = time.perf_counter()
    with waits.collective(device):
        for r in requests:
            r.wait()
    WaitClock.waited_s += time.perf_counter() - start


def _ring_forward(q, k, v, split: SplitRows, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of one head group: its K/V go around the ring, each chunk pair merged by log-sum-exp."""
    c = split.chunk
    out = torch.zeros(*q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    held = [k, v]
    for step in range(split.size):
        owner = (split.index - step) % split.size
        pending, incoming = _rotate(split, held) if step < split.size - 1 else ([], held)
        for a, b, causal, mask in _pairs(split, split.index, owner):
            qa, kb, vb = q[:, :, a * c : (a + 1) * c], held[0][:, :, b * c : (b + 1) * c], held[1][:, :, b * c : (b + 1) * c]
            o, s = _block_forward(qa, kb, vb, scale, causal, mask)
            rows = slice(a * c, (a + 1) * c)
            merged = torch.logaddexp(lse[:, :, rows], s.float())
            keep, add = torch.exp(lse[:, :, rows] - merged), torch.exp(s.float() - merged).nan_to_num()
            out[:, :, rows] = out[:, :, rows] * keep.nan_to_num()[..., None] + o.float() * add[..., None]
            lse[:, :, rows] = merged
        _wait(pending, q.device)
        held = incoming
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, split: SplitRows, scale: float):
    """dq, dk, dv of one head group: the K/V go around again, their fp32 dK/dV accumulators with them."""
    c = split.chunk
    dq = torch.zeros(*q.shape, dtype=torch.float32, device=q.device)
    held, grads = [k, v], [torch.zeros(*k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
    for step in range(split.size):
        owner = (split.index - step) % split.size
        pending, incoming = _rotate(split, held) if step < split.size - 1 else ([], held)
        for a, b, causal, mask in _pairs(split, split.index, owner):
            mine, theirs = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
            args = (dout[:, :, mine], q[:, :, mine], held[0][:, :, theirs], held[1][:, :, theirs], out[:, :, mine])
            g = _block_backward(*args, lse[:, :, mine], scale, causal, mask)
            dq[:, :, mine] += g[0]  # promoted to fp32 inside the add: no fp32 copy of the block's gradients
            grads[0][:, :, theirs] += g[1]
            grads[1][:, :, theirs] += g[2]
        moving, grads = _rotate(split, grads)  # the accumulators travel with the block they belong to
        _wait(pending, q.device)
        _wait(moving, q.device)
        held = incoming
    return dq, grads[0], grads[1]


class _Ring(torch.autograd.Function):
    """One ring per K/V head and the query heads it serves: the same bytes travel, in kv_heads rounds, and the
    buffers a ring holds (the fp32 dQ and dK/dV accumulators above all) are one head group's, not the layer's:
    at long context they would otherwise outweigh the layer's own attention tensors."""

    @staticmethod
    def forward(ctx, q, k, v, split: SplitRows, scale: float):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for heads, kv in _groups(q, k):
            out[:, heads], lse[:, heads] = _ring_forward(q[:, heads], k[:, kv], v[:, kv], split, scale)
        ctx.split, ctx.scale = split, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for heads, kv in _groups(q, k):
            grads = _ring_backward(
                dout[:, heads], q[:, heads], k[:, kv], v[:, kv], out[:, heads], lse[:, heads], ctx.split, ctx.scale
            )
            dq[:, heads], dk[:, kv], dv[:, kv] = grads
        return dq, dk, dv, None, None


def _groups(q, k):
    """(query heads, K/V head) slices of each head group."""
    group = q.shape[1] // k.shape[1]
    return [(slice(h * group, (h + 1) * group), slice(h, h + 1)) for h in range(k.shape[1])]


def ring_attention(q, k, v, split: SplitRows, scale: float) -> torch.Tensor:
    """query (rows, heads, 2 x chunk, dim), key/value (rows, kv_heads, 2 x chunk, dim) of this rank's part ->
    attention output (rows, heads, 2 x chunk, dim) over the whole sequence."""
    return _Ring.apply(q, k, v, split, scale)


# ---------------------------------------------------------------------- Ulysses


def _all_to_all(t: torch.Tensor, split: SplitRows) -> torch.Tensor:
    """Part j of dim 0 to rank j, differentiable (its backward is the all-to-all back): torch's functional collective."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    with waits.collective(t.device):
        return wait_tensor(all_to_all_single_autograd(t, None, None, split.group))


def _heads_to_sequence(t: torch.Tensor, split: SplitRows) -> torch.Tensor:
    """(rows, H, n, d) of my tokens -> (rows, H/N, N x n, d): my share of the heads over every rank's tokens."""
    b, h, n, d = t.shape
    size = split.size
    sent = t.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()  # part j goes to rank j
    got = _all_to_all(sent, split)  # part j came from rank j
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _sequence_to_heads(t: torch.Tensor, split: SplitRows) -> torch.Tensor:
    """The inverse: (rows, H/N, N x n, d) -> (rows, H, n, d)."""
    b, hs, total, d = t.shape
    size = split.size
    n = total // size
    sent = t.reshape(b, hs, size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(sent, split)
    return got.transpose(0, 1).reshape(b, size * hs, n, d)


def ulysses_attention(q, k, v, split: SplitRows, scale: float, attend) -> torch.Tensor:
    """As ring_attention, through two all-to-alls; attend(q, k, v, segments) attends over whole rows in
    sequence order ((rows, heads, T, dim) each). K/V heads that do not divide over the ranks are repeated."""
    heads = q.shape[1]
    if k.shape[1] % split.size:
        k, v = expand_heads(k, heads), expand_heads(v, heads)
    order = split.sequence_order(q.device)
    back = torch.argsort(order)  # the concatenated parts -> sequence order
    qs, ks, vs = (_heads_to_sequence(t, split)[:, :, back] for t in (q, k, v))
    out = attend(qs, ks, vs, split.segments)
    return _sequence_to_heads(out[:, :, order], split)
