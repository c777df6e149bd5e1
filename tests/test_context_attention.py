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

ROWS, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 22, 8  # 22: padded to 24 = 2 ranks x 2 chunks of 6 (3 ranks: 6 x 4)


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


def _worker(rank: int, port: int, mode: str, packed: bool, ranks: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        q, k, v, dout, positions = _inputs()
        batch = {"input_ids": torch.zeros(ROWS, LENGTH, dtype=torch.long), "labels": torch.zeros(ROWS, LENGTH, dtype=torch.long)}
        if packed:
            batch.update(position_ids=positions, num_tokens=torch.tensor(ROWS * LENGTH))
        else:
            batch["attention_mask"] = torch.ones(ROWS, LENGTH, dtype=torch.long)
        part = split_batch(batch, tuple(range(ranks)), rank, dist.group.WORLD, mode)["context_part"]
        split, mine = part.split, part.split.positions_of(rank)
        pad = 2 * ranks * split.chunk - LENGTH
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


@pytest.mark.parametrize("mode, ranks", [("ring", 2), ("ulysses", 2), ("ring", 3)], ids=["ring", "ulysses", "ring-3"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_split_attention_equals_the_whole_rows(mode, ranks, packed):
    # 3 ranks: the next rank and the previous one differ (on 2 they are one), so a ring that turns the
    # wrong way, or accumulators that travel apart from their K/V, fail here.
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), mode, packed, ranks, results), nprocs=ranks, start_method="spawn")
    q, k, v, dout, positions = _inputs()
    want = _reference(q, k, v, dout, positions, packed)
    got = [torch.zeros(ROWS, h, 24, DIM) for h in (HEADS, HEADS, KV_HEADS, KV_HEADS)]  # 22 padded to 2 x ranks chunks
    for rank in range(ranks):
        mine, *parts = results[rank]
        for whole, part in zip(got, parts):  # each rank's queries, and its keys' gradients from every rank's queries
            whole[:, :, mine] = part
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g[:, :, :LENGTH], w, rtol=1e-5, atol=1e-5, msg=name)


def _logits_worker(rank: int, port: int, model_dir: str, mode: str, results) -> None:
    from transformers import AutoModelForCausalLM

    from finetune.parallel.context import register

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.set_attn_implementation(register())
        ids, positions = _rows()
        got = {}
        for packed in (False, True):
            batch = {"input_ids": ids, "labels": ids}
            batch.update(position_ids=positions, num_tokens=torch.tensor(ids.numel())) if packed else batch.update(
                attention_mask=torch.ones_like(ids)
            )
            part = split_batch(batch, (0, 1), rank, dist.group.WORLD, mode)
            with torch.no_grad():
                logits = model(
                    input_ids=part["input_ids"], position_ids=part["position_ids"], context_part=part["context_part"]
                ).logits
            got[packed] = (part["context_part"].split.positions_of(rank), logits[:, :-1])  # the extra token dropped
        results[rank] = got
    finally:
        dist.destroy_process_group()


def _rows():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (2, 30), generator=g)
    positions = torch.tensor([list(range(11)) + list(range(19)), list(range(7)) + list(range(23))])
    return ids, positions


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_logits_of_a_row_split_over_two_ranks_equal_the_whole_rows(tmp_path, mode):
    # The tiny Llama (4 heads, 2 key/value heads) with its own rotary positions: plain rows, and packed rows
    # whose examples must not see each other.
    from conftest import build_tiny_llama
    from transformers import AutoModelForCausalLM

    build_tiny_llama(tmp_path, vocab_size=64, layers=2)
    results = mp.Manager().dict()
    mp.start_processes(_logits_worker, args=(free_port(), str(tmp_path), mode, results), nprocs=2, start_method="spawn")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids, positions = _rows()
    with torch.no_grad():
        whole = {False: model(input_ids=ids).logits}
        whole[True] = torch.cat(  # each packed example alone
            [model(input_ids=ids[r : r + 1, a:b]).logits for r in range(2) for a, b in _examples(positions[r])], dim=1
        ).view(2, 30, -1)
    for packed in (False, True):
        for rank in (0, 1):
            mine, logits = results[rank][packed]
            keep = mine < 30  # the padding up to 2 ranks x 2 chunks
            torch.testing.assert_close(logits[:, keep], whole[packed][:, mine[keep]], rtol=1e-5, atol=1e-5)


def _examples(positions: torch.Tensor) -> list[tuple[int, int]]:
    starts = [i for i, p in enumerate(positions.tolist()) if p == 0] + [len(positions)]
    return list(zip(starts, starts[1:]))


def _recipe(*overrides: str):
    from test_plan import CONFIGS

    from finetune.config.schema import load_recipe

    return load_recipe("qlora-ddp-nx24gb", [f"model.path={CONFIGS / 'llama-3-8b'}", "data.path=d.jsonl", *overrides])


def test_what_a_split_sequence_cannot_run_with_is_refused_before_loading():
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError) as said:
        _recipe(
            "distributed.context_parallel=2",
            "train.objective=grpo",
            "distributed.strategy=deepspeed",
            "model.attn_implementation=eager",
        )
    text = str(said.value)
    assert "train.objective=grpo and distributed.strategy=deepspeed: a group's first rank samples for it" in text
    assert "distributed.strategy=deepspeed: context-parallel ranks hold whole replicas or FSDP's shards" in text
    assert "model.attn_implementation=eager: context parallelism runs its own attention" in text


def test_a_model_or_launch_the_split_cannot_serve_is_named_with_the_fix():
    from types import SimpleNamespace

    from finetune.parallel.split_checks import split_problems

    ulysses = _recipe("distributed.context_parallel=4", "distributed.context_parallel_mode=ulysses")
    six_heads = SimpleNamespace(model_type="llama", num_attention_heads=6, num_hidden_layers=2)
    (heads,) = split_problems(ulysses, 4, six_heads)
    assert "the model's 6 attention heads do not divide over 4 ranks (values that do: 2, 3, 6)" in heads
    assert "context_parallel_mode=ring" in heads
    (world,) = split_problems(_recipe("distributed.context_parallel=2"), 3)  # the config read from model.path
    assert "distributed.context_parallel=2 on 3 processes" in world and "--nproc 2" in world
    window = SimpleNamespace(model_type="mistral", num_attention_heads=8, sliding_window=128, num_hidden_layers=2)
    (slides,) = split_problems(_recipe("distributed.context_parallel=2"), 2, window)
    assert "mistral attends within a sliding window of 128 tokens" in slides
    capped = SimpleNamespace(model_type="gemma2", num_attention_heads=8, attn_logit_softcapping=50.0, num_hidden_layers=2)
    assert "caps its attention logits" in split_problems(_recipe("distributed.context_parallel=2"), 2, capped)[0]
    assert split_problems(_recipe("distributed.context_parallel=2"), 4) == []  # 2 replicas of 2 ranks


def test_rotary_scaling_that_reads_the_longest_position_and_routers_are_refused_a_window_that_spans_every_row_is_not():
    from types import SimpleNamespace

    from finetune.parallel.split_checks import split_problems

    cfg = _recipe("distributed.context_parallel=2", "data.max_seq_len=2048")
    base = {"num_attention_heads": 8, "num_hidden_layers": 2}
    dynamic = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0}, **base)
    assert "rotary scaling (dynamic) depends on the longest position" in split_problems(cfg, 2, dynamic)[0]
    longrope = SimpleNamespace(model_type="phi3", rope_scaling={"type": "longrope"}, **base)
    assert "rotary scaling (longrope)" in split_problems(cfg, 2, longrope)[0]
    routed = SimpleNamespace(model_type="mixtral", num_local_experts=8, **base)
    assert "router's load-balancing loss" in split_problems(cfg, 2, routed)[0]
    dropout = SimpleNamespace(model_type="llama", attention_dropout=0.1, **base)
    assert "attention dropout (0.1)" in split_problems(cfg, 2, dropout)[0]
    wide = SimpleNamespace(model_type="mistral", sliding_window=4096, **base)  # Mistral-7B-v0.1's, over 2048 tokens
    static = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "llama3", "factor": 8.0}, **base)
    assert split_problems(cfg, 2, wide) == [] and split_problems(cfg, 2, static) == []


def _one_rank_ring(device: str, dtype) -> None:
    """The ring on a group of one (its two chunks: causal, whole and causal pairs merged by log-sum-exp) against
    sdpa on the same rows: the kernels and the merge without any transfer."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 64, 32, generator=g).to(device, dtype) for h in (8, 2, 2))
    dout = torch.randn(2, 8, 64, 32, generator=g).to(device, dtype)
    split = SplitRows((0,), 0, 32, None, None)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, split, 32**-0.5)
    out.backward(dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    want.backward(dout)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, exp in zip([out, *(t.grad for t in mine)], [want, *(t.grad for t in ref)]):
        torch.testing.assert_close(got.float(), exp.float(), **tol)


def test_a_ring_of_one_rank_equals_causal_attention():
    _one_rank_ring("cpu", torch.float32)


@pytest.mark.gpu
def test_a_ring_of_one_rank_equals_causal_attention_in_cudas_flash_kernel():
    # What only a GPU runs: torch's CUDA flash-attention ops and their backward called directly (16-bit),
    # grouped K/V repeated one chunk pair at a time.
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs an Ampere or newer CUDA GPU")
    _one_rank_ring("cuda", torch.bfloat16)


def test_a_split_sequence_composes_with_tensor_parallel_shares_and_with_stages_for_sft():
    from types import SimpleNamespace

    from finetune.errors import ConfigError
    from finetune.parallel.split_checks import split_problems

    both = _recipe("distributed.context_parallel=2", "distributed.tensor_parallel=2")  # accepted
    staged = ("distributed.context_parallel=2", "distributed.pipeline_parallel=2", "distributed.pipeline_layers=even")
    assert split_problems(_recipe(*staged), 4) == []
    (world,) = split_problems(_recipe(*staged), 6)  # 6 processes hold no whole number of 2 x 2
    assert world == (
        "distributed.pipeline_parallel=2 x distributed.context_parallel=2 on 6 processes: the processes must be stages x "
        "context-parallel ranks x replicas. Launch with --nproc 4 or a multiple of it (4, 8, ...)."
    )
    with pytest.raises(ConfigError, match="and train.objective=dpo: not yet"):
        _recipe(*staged, "train.objective=dpo", "data.format=preference", "train.precompute_reference=false")
    # Ulysses trades the sequence for a share's heads: 8 heads over tp=2 leave 4, which 4 ranks split and 8 do not.
    eight = SimpleNamespace(model_type="llama", num_attention_heads=8, num_key_value_heads=8, intermediate_size=64)
    eight.num_hidden_layers, eight.get_text_config = 2, lambda: eight
    ulysses = ("distributed.context_parallel_mode=ulysses", "distributed.tensor_parallel=2")
    assert split_problems(_recipe("distributed.context_parallel=4", *ulysses), 8, eight) == []
    assert split_problems(both, 4, eight) == []
    (heads,) = split_problems(_recipe("distributed.context_parallel=8", *ulysses), 16, eight)
    assert "the 4 attention heads of a tensor-parallel share do not divide over 8 ranks (values that do: 2, 4)" in heads
