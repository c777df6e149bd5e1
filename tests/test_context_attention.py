"""Context parallelism's attention (finetune/parallel/ring.py, context.py) on 2 gloo processes: each rank's
output and gradients for its part of the rows equal the unsplit attention's for those tokens, ring and
Ulysses, plain and packed rows, grouped-query heads; fp32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import free_port

from finetune.parallel.context import split_batch
from finetune.parallel.ring import SplitRows, ring_attention, ulysses_attention

ROWS, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 22, 8  # 22: padded to 24 = 2 ranks x 2 chunks of 6


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(ROWS, h, LENGTH, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    dout = torch.randn(ROWS, HEADS, LENGTH, DIM, generator=g)
    positions = torch.tensor([list(range(9)) + list(range(13)), list(range(LENGTH))])  # row 0: two examples
    return q, k, v, dout, positions


def _reference(q, k, v, dout, positions, packed: bool):
    """The unsplit attention (causal; packed: each example apart) and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    i = torch.arange(LENGTH)
    mask = (i[None, :] <= i[:, None]).expand(ROWS, LENGTH, LENGTH)
    if packed:
        seg = (positions == 0).long().cumsum(1)
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank: int, port: int, mode: str, packed: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        q, k, v, dout, positions = _inputs()
        batch = {"input_ids": torch.zeros(ROWS, LENGTH, dtype=torch.long), "labels": torch.zeros(ROWS, LENGTH, dtype=torch.long)}
        if packed:
            batch.update(position_ids=positions, num_tokens=torch.tensor(ROWS * LENGTH))
        else:
            batch["attention_mask"] = torch.ones(ROWS, LENGTH, dtype=torch.long)
        part = split_batch(batch, SplitRows((0, 1), rank, 0, None, dist.group.WORLD), mode)["context_part"]
        split, mine = part.split, part.split.positions_of(rank)
        pad = 2 * 2 * split.chunk - LENGTH
        local = [F.pad(t, (0, 0, 0, pad))[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        if mode == "ring":
            out = ring_attention(*local, split, DIM**-0.5)
        else:

            def attend(qs, ks, vs, segments):
                i = torch.arange(qs.shape[2])
                mask = i[None, :] <= i[:, None]
                if segments is not None:
                    mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
                return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=ks.shape[1] != qs.shape[1])

            out = ulysses_attention(*local, split, DIM**-0.5, attend)
        out.backward(F.pad(dout, (0, 0, 0, pad))[:, :, mine])
        results[rank] = (mine, out.detach(), *(t.grad for t in local))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_split_attention_equals_the_whole_rows(mode, packed):
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), mode, packed, results), nprocs=2, start_method="spawn")
    q, k, v, dout, positions = _inputs()
    want = _reference(q, k, v, dout, positions, packed)
    got = [torch.zeros(ROWS, h, LENGTH + 2, DIM) for h in (HEADS, HEADS, KV_HEADS, KV_HEADS)]
    for rank in (0, 1):
        mine, *parts = results[rank]
        for whole, part in zip(got[:2], parts[:2]):
            whole[:, :, mine] = part
        for whole, part in zip(got[2:], parts[2:]):  # a key's gradient comes from every rank's queries
            whole[:, :, mine] += part
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g[:, :, :LENGTH], w, rtol=1e-5, atol=1e-5, msg=name)
