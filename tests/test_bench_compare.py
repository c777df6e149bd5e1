"""Non-timing logic of benchmarks/compare.py: the data generator, the FLOP formula, batch
accounting for every layout the tools produce, and the per-example attention prototype."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare.py")


def test_records_are_deterministic_skewed_and_answer_the_prompt(compare):
    rows = compare.make_records(400, seed=3)
    assert rows == compare.make_records(400, seed=3)
    assert rows != compare.make_records(400, seed=4)
    words = [len(r["completion"].split()) for r in rows]
    median = sorted(words)[len(words) // 2]
    assert 60 <= median <= 100  # lognormal around 80 words
    assert max(words) > 4 * median  # a long tail
    for r in rows[:50]:
        assert r["prompt"].endswith("\nAnswer:") and r["completion"].startswith(" ")
        listed = set(r["prompt"].split(": ", 1)[1].split("\n")[0].split())
        assert set(r["completion"].split()) <= listed  # the reply is made of the prompt's words


def test_parameter_counts_match_the_built_model(compare, tmp_path):
    small = {"vocab": 64, "hidden": 32, "layers": 2, "heads": 4, "intermediate": 48}
    counts = compare.parameter_counts(small, r=4)
    d, i = 32, 48
    assert counts["base_linear"] == 2 * (4 * d * d + 3 * d * i)
    assert counts["lora"] == 2 * (4 * 4 * (d + d) + 3 * 4 * (d + i))
    full = compare.parameter_counts()
    assert full["total"] == 29_499_904  # what build_model reports for DIMS (hidden 512, 8 layers, vocab 4096)


def test_example_flops_formula(compare):
    n = compare.parameter_counts()
    d, L, v = compare.DIMS["hidden"], compare.DIMS["layers"], compare.DIMS["vocab"]
    got = compare.example_flops(100, 60)
    want = (4 * n["base_linear"] + 6 * n["lora"]) * 100 + 4 * d * v * 60 + 12 * L * d * 100**2
    assert got == want
    # Attention grows with the square of the length, the rest linearly.
    assert compare.example_flops(200, 0) - 2 * compare.example_flops(100, 0) == 12 * L * d * (200**2 - 2 * 100**2)
    # Per token, the linears dominate at these lengths: 4 x 25.3M + 6 x 1.25M ~ 108.7 MFLOP.
    assert math.isclose(compare.example_flops(1, 0), 4 * 25_296_896 + 6 * 1_249_280 + 12 * L * d, rel_tol=0)


def test_batch_segments_padded_rows(compare):
    # Two examples padded to 5: lengths 5 and 3; labels on the last 2 and 1 tokens.
    batch = {
        "input_ids": torch.tensor([[1, 7, 8, 9, 2], [1, 7, 2, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "labels": torch.tensor([[-100, -100, -100, 9, 2], [-100, -100, 2, -100, -100]]),
    }
    assert compare.batch_segments(batch) == [(5, 2), (3, 1)]
    stats = compare.StepStats()
    stats.add(batch)
    assert stats.as_dict()["tokens"] == 8 and stats.trained == 3 and stats.examples == 2 and stats.padded == 10


def test_batch_segments_finetune_packed_row_with_padding_segment(compare):
    # finetune's Collator: examples [1,5,6] and [1,7], then 2 padding tokens with positions of their own.
    batch = {
        "input_ids": torch.tensor([[1, 5, 6, 1, 7, 0, 0]]),
        "labels": torch.tensor([[-100, 5, 6, -100, 7, -100, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]]),
    }
    assert compare.batch_segments(batch) == [(3, 2), (2, 1)]


def test_batch_segments_trl_padding_free(compare):
    # TRL's padding-free collator: one flattened row, labels -100 where position_ids == 0.
    batch = {
        "input_ids": torch.tensor([[1, 5, 6, 2, 1, 7, 2]]),
        "labels": torch.tensor([[-100, -100, 6, 2, -100, 7, 2]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
    }
    assert compare.batch_segments(batch) == [(4, 2), (3, 2)]


def test_segment_attention_equals_packed_sdpa(compare):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 50, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]])
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        packed_ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        padded_ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        whole = model(input_ids=ids, use_cache=False).logits
        model.set_attn_implementation(compare.register_segment_sdpa())
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(packed, packed_ref)
    torch.testing.assert_close(padded[0], padded_ref[0])
    torch.testing.assert_close(padded[1, :9], padded_ref[1, :9])  # real tokens; padding is never trained
    assert (packed - whole).abs().max() > 1e-2  # it does keep examples apart
