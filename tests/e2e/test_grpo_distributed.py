"""GRPO on two processes (DDP, gloo): given the same completions, the losses and the pre-clip gradient norms
equal one process over the same global batch of prompts (groups never span ranks; the loss is normalised
over the whole step), with a negative control that normalises per rank."""

from __future__ import annotations

import json

import pytest
from conftest import write_jsonl
from test_distributed import losses, run_driver, write
from test_grpo import ROWS

pytestmark = pytest.mark.slow

# Completions as a function of the prompt alone (the same on any number of processes): generation k of a
# prompt is its answer when k is even, else "no", each with the end token. $BUG normalises each rank's
# loss by its own units instead of the whole step's (the bug the equality must catch).
DRIVER = """
import os, sys
import finetune.objectives.grpo as grpo
from finetune.config.schema import load_recipe
from finetune.objectives.sampling import Completions
from finetune.parallel.runtime import Parallel
from finetune.trainer import Trainer

def fixed(model, prompts, n, tokenizer, ends, train, greedy, **sampling):
    tokens, texts = [], []
    for record in prompts["records"]:
        for k in range(n):
            text = record["answer"] if k % 2 == 0 else "no"
            tokens.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [ends[0]])
            texts.append(text)
    return Completions(tokens, texts)

grpo.complete = fixed
if os.environ.get("BUG"):
    Parallel.global_sum = lambda self, value: value
if os.environ.get("EVERY_PART_COUNTS"):  # a context-parallel group's rows (and rewards) counted by each of its parts
    grpo._first_part = lambda batch: True
with Trainer(load_recipe(sys.argv[1]), progress=False) as trainer:
    trainer.train()
"""


def grad_norms(out) -> list[float]:
    return [r["grad_norm"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_on_two_processes_equals_one_given_the_same_completions(recipe_dict, tmp_path, loss_type):
    data = {"path": str(write_jsonl(tmp_path / "prompts.jsonl", ROWS)), "format": "prompt", "max_seq_len": 64}
    train = {
        "objective": "grpo",
        "loss_type": loss_type,
        "max_steps": 3,
        "lr": 1e-2,
        "num_generations": 4,
        "max_new_tokens": 6,
        "max_grad_norm": None,
        "rewards": [{"name": "exact_match", "column": "answer"}],
    }
    one_recipe, one = write(tmp_path, recipe_dict, "one", data=data, train={**train, "batch_size": 4})
    two_recipe, two = write(tmp_path, recipe_dict, "two", data=data, train={**train, "batch_size": 2})
    run_driver(tmp_path, DRIVER, one_recipe, nproc=1)
    run_driver(tmp_path, DRIVER, two_recipe, nproc=2)
    assert len(losses(one)) == 3
    assert losses(two) == pytest.approx(losses(one), rel=1e-5, abs=1e-7)
    assert grad_norms(two) == pytest.approx(grad_norms(one), rel=1e-5)
    if loss_type == "grpo":  # the comparison's negative control, once (the same units sum serves both loss types)
        bug_recipe, bug = write(tmp_path, recipe_dict, "bug", data=data, train={**train, "batch_size": 2})
        run_driver(tmp_path, DRIVER, bug_recipe, nproc=2, BUG="1")
        # Each rank normalised by its own units trains another step.
        assert grad_norms(bug)[0] != pytest.approx(grad_norms(one)[0], rel=1e-3)


def test_grpo_with_each_row_split_over_two_ranks_equals_one(recipe_dict, tmp_path):
    # distributed.context_parallel=2: the group's first rank samples (whole rows, the whole model: the sampling
    # policy's and the reference's log-probabilities too) and hands the batch to the other; each trains its part of
    # every row, a row's token count the group's. Two updates per sampling and beta: the per-token values split too.
    data = {"path": str(write_jsonl(tmp_path / "prompts.jsonl", ROWS)), "format": "prompt", "max_seq_len": 64}
    train = {
        "objective": "grpo",
        "max_steps": 4,
        "batch_size": 4,
        "lr": 1e-2,
        "num_generations": 4,
        "max_new_tokens": 6,
        "max_grad_norm": None,
        "steps_per_generation": 2,
        "beta": 0.1,
        "rewards": [{"name": "exact_match", "column": "answer"}],
    }
    one_recipe, one = write(tmp_path, recipe_dict, "one", data=data, train=train)
    cp_recipe, cp = write(tmp_path, recipe_dict, "cp", data=data, train=train, distributed={"context_parallel": 2})
    run_driver(tmp_path, DRIVER, one_recipe, nproc=1)
    said = run_driver(tmp_path, DRIVER, cp_recipe, nproc=2).stdout
    assert "parallel: context parallel (ring), each sequence split over 2 processes x 1 replica" in said, said[-2000:]
    assert len(losses(one)) == 4
    assert losses(cp) == pytest.approx(losses(one), rel=1e-5, abs=1e-7)
    assert grad_norms(cp) == pytest.approx(grad_norms(one), rel=1e-5)

    def metrics(out):
        rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        return [x for r in rows if "loss" in r for x in (r["reward"], r["kl"])]

    assert metrics(cp) == pytest.approx(metrics(one), rel=1e-5, abs=1e-9)
    bug_recipe, bug = write(
        tmp_path, recipe_dict, "bug", data=data, train={**train, "max_steps": 1}, distributed={"context_parallel": 2}
    )
    run_driver(tmp_path, DRIVER, bug_recipe, nproc=2, EVERY_PART_COUNTS="1")
    assert losses(bug)[0] != pytest.approx(losses(one)[0], rel=1e-3)  # each row counted twice: half the loss


SAMPLING = """
import sys
from finetune.config.schema import load_recipe
from finetune.trainer import Trainer

with Trainer(load_recipe(sys.argv[1]), progress=False) as trainer:
    result = trainer.train()
# One write per line: torchrun runs Python unbuffered, and both ranks print (print() writes its pieces apart,
# so two ranks' lines interleaved once: "held-outheld-out -0.5 -0.375").
sys.stdout.write(f"held-out {result.reward_before} {result.reward_after}\\n")
"""


def test_grpo_under_fsdp_samples_and_trains_as_ddp(recipe_dict, tmp_path):
    # Each rank draws from a generator seeded by its rank: FSDP's gathered weights sample what DDP's replicas do,
    # generate stepping both ranks' decoders together (synced), and the sharded update follows DDP's.
    data = {"path": str(write_jsonl(tmp_path / "prompts.jsonl", ROWS)), "format": "prompt", "max_seq_len": 64}
    data["eval_fraction"] = 0.125
    train = {
        "objective": "grpo",
        "max_steps": 2,
        "batch_size": 2,
        "lr": 1e-2,
        "num_generations": 4,
        "max_new_tokens": 6,
        "rewards": [{"name": "contains", "column": "answer"}, {"name": "length", "target": 3, "weight": 0.5}],
    }
    runs = {}
    for strategy in ("ddp", "fsdp"):
        recipe, out = write(tmp_path, recipe_dict, strategy, data=data, train=train, distributed={"strategy": strategy})
        said = run_driver(tmp_path, SAMPLING, recipe, nproc=2).stdout
        rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        runs[strategy] = rows, [line for line in said.splitlines() if line.startswith("held-out")]
        assert f"parallel: {strategy} over 2 processes" in said, said[-2000:]
    (ddp, ddp_held), (fsdp, fsdp_held) = runs["ddp"], runs["fsdp"]
    assert len(fsdp) == 2
    for a, b in zip(ddp, fsdp):
        assert (a["reward"], a["completion_length"], a["tokens"]) == (b["reward"], b["completion_length"], b["tokens"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert ddp_held == fsdp_held and len(fsdp_held) == 2  # the same greedy completions before and after
