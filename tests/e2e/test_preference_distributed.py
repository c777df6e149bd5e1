"""DPO on 2 processes (DDP, FSDP2 and a sequence split over a context-parallel pair; gloo) equals 1 process with
the same global batch: the loss is a mean over the pairs of the whole step, and the reference is each process's
model with its adapter switched off (inside FSDP's gathered forward; over every rank's part of a split row)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_same_steps, build_char_tokenizer, build_tiny_llama, tiny_recipe, write_jsonl
from test_distributed import adapter, assert_adapters_close, finetune, losses, run_driver, write

pytestmark = pytest.mark.slow

PAIRS = [
    {"prompt": f"Q{i}: pick {'ab'[i % 2]}?\nA: ", "chosen": "ab"[i % 2] * (1 + i % 3), "rejected": "ba"[i % 2] * (2 + i % 2)}
    for i in range(32)
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny Llama in 4-bit, DPO over 32 pairs, 3 steps of 4 pairs, no clipping (the pre-clip norms must agree)."""
    root = tmp_path_factory.mktemp("preference")
    model = root / "model"
    model.mkdir()
    build_tiny_llama(model, vocab_size=len(build_char_tokenizer(model)))
    recipe = tiny_recipe(model, write_jsonl(root / "pairs.jsonl", PAIRS))
    recipe["data"] = {**recipe["data"], "format": "preference", "max_seq_len": 64}
    recipe["quant"] = {"bits": 4}
    recipe["train"] = {**recipe["train"], "objective": "dpo", "max_steps": 3, "max_grad_norm": None, "lr": 1e-2}
    return root, recipe


@pytest.fixture(scope="module")
def one(base) -> Path:
    root, recipe = base
    path, out = write(root, recipe, "one")
    finetune(str(path), cwd=root)
    assert losses(out)[0] == pytest.approx(0.6931472, abs=1e-6)  # LoRA B starts at zero: policy = reference
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "context"])
def test_dpo_on_two_processes_matches_one(base, one, strategy):
    root, recipe = base
    # Data parallelism halves each process's batch; a context-parallel pair holds the same rows, half of each.
    split = {"context_parallel": 2} if strategy == "context" else {"strategy": strategy}
    batch = 4 if strategy == "context" else 2
    path, two = write(root, recipe, f"two-{strategy}", train__batch_size=batch, distributed=split)
    proc = finetune(str(path), "--nproc", "2", cwd=root)
    said = "context parallel (ring), each sequence split" if strategy == "context" else f"{strategy} over 2 processes"
    assert f"parallel: {said}" in proc.stdout
    assert len(losses(two)) == 3
    assert_same_steps(one, two, rel=1e-5)
    # A split row's log-probability is added in another order: where a LoRA-B coordinate's gradient is near zero,
    # AdamW's m / sqrt(v) turns that rounding into an lr-sized difference (seen: 1 of 8,192 elements, 3.5e-5).
    assert_adapters_close(adapter(one), adapter(two), atol=1e-4 if strategy == "context" else 1e-5)


DRIVER = """
import sys
from finetune.config.schema import load_recipe
from finetune.parallel import context
from finetune.trainer import Trainer

context.whole_row_sums = lambda part, sums, counts: (sums, counts)  # broken: each rank scores its part as a row
Trainer(load_recipe(sys.argv[1]), progress=False).train()
"""


def test_parts_scored_as_rows_fail_the_comparison(base, one, tmp_path):
    root, recipe = base
    path, out = write(tmp_path, recipe, "parts", distributed={"context_parallel": 2})
    run_driver(tmp_path, DRIVER, path)
    assert losses(out)[0] == pytest.approx(0.6931472, abs=1e-6)  # policy = reference on every part, still
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one, out, rel=1e-5)
