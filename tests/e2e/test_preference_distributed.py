"""DPO on 2 processes (DDP and FSDP2, gloo) equals 1 process with the same global batch: the loss is a
mean over the pairs of the whole step, and the reference is each process's model with its adapter
switched off (inside FSDP's gathered forward)."""

from __future__ import annotations

import pytest
from conftest import assert_same_steps, write_jsonl
from test_distributed import adapter, assert_adapters_close, finetune, losses, write

pytestmark = pytest.mark.slow

PAIRS = [
    {"prompt": f"Q{i}: pick {'ab'[i % 2]}?\nA: ", "chosen": "ab"[i % 2] * (1 + i % 3), "rejected": "ba"[i % 2] * (2 + i % 2)}
    for i in range(32)
]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dpo_on_two_processes_matches_one(recipe_dict, tmp_path, strategy):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    common = {
        "data": {"path": str(pairs), "format": "preference", "max_seq_len": 64},
        "quant": {"bits": 4},
        "train__objective": "dpo",
        "train__max_steps": 3,
        "train__max_grad_norm": None,  # the pre-clip gradient norms must agree too
        "train__lr": 1e-2,
    }
    one_recipe, one = write(tmp_path, recipe_dict, "one", train__batch_size=4, **common)
    two_recipe, two = write(tmp_path, recipe_dict, "two", train__batch_size=2, distributed={"strategy": strategy}, **common)
    finetune(str(one_recipe), cwd=tmp_path)
    proc = finetune(str(two_recipe), "--nproc", "2", cwd=tmp_path)
    assert f"parallel: {strategy} over 2 processes" in proc.stdout
    assert losses(one)[0] == pytest.approx(0.6931472, abs=1e-6) and len(losses(two)) == 3
    assert_same_steps(one, two, rel=1e-5)
    assert_adapters_close(adapter(one), adapter(two))
