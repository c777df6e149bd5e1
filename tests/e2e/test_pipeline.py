"""Pipeline parallelism (distributed.pipeline_parallel) on CPU, gloo, a tiny 4-layer Llama in 4-bit, fp32:
the same global batch gives the losses, pre-clip gradient norms and adapter of one process, for every
schedule and with replicas; a run stopped under pp=2 resumes on one process. Through the real launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_same_steps, build_char_tokenizer, build_tiny_llama, free_port, step_rows
from test_distributed import adapter, assert_adapters_close, finetune, run_driver, stopped_under_sigterm, write

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict]:
    """(a folder, the recipe) shared by the module: the tiny Llama with 4 decoder layers (2 stages of 2, or
    4 virtual stages of 1) in 4-bit, 2 micro-batches per step. Clipping on, at a norm every step exceeds:
    each stage holds part of the gradient, and clipping by the norm of one part would change the updates;
    the norms compared are the pre-clip ones, so a wrong gradient scale still shows in them."""
    from conftest import ALPACA_ROWS, write_jsonl

    root = tmp_path_factory.mktemp("pipeline")
    model = root / "model"
    model.mkdir()
    build_tiny_llama(model, vocab_size=len(build_char_tokenizer(model)), layers=4)
    recipe = {
        "model": {"path": str(model)},
        "data": {"path": str(write_jsonl(root / "train.jsonl", ALPACA_ROWS)), "format": "alpaca", "max_seq_len": 256},
        "seed": 0,
        "report": {"plot": False},  # no loss.png: ~0.5 s of matplotlib a run
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"max_steps": STEPS, "batch_size": 4, "grad_accum": 2, "lr": 1e-3, "max_grad_norm": 0.5},
        "memory": {"activation_checkpointing": "none"},
        "checkpoint": {"every_steps": 2},
    }
    return root, recipe


@pytest.fixture(scope="module")
def one_process(base) -> Path:
    root, recipe = base
    path, out = write(root, recipe, "one")
    finetune(str(path), cwd=root)
    return out


@pytest.mark.parametrize(
    "schedule, nproc, batch",
    [("1f1b", 2, 4), ("gpipe", 2, 4), ("interleaved_1f1b", 2, 4), ("1f1b", 4, 2)],
    ids=["1f1b", "gpipe", "interleaved", "pp2xdp2"],
)
def test_pipeline_matches_one_process(base, one_process, schedule, nproc, batch):
    root, recipe = base
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    distributed = {"pipeline_parallel": 2, "pipeline_schedule": schedule, "virtual_stages": virtual}
    # GPipe also recomputes its layers in backward, moves their inputs to host RAM and back, and runs the
    # chunked loss on its last stage: the same numbers.
    chunked = {"activation_checkpointing": "all", "activation_offload": True, "loss": "chunked", "loss_chunk": 16}
    # Interleaved also keeps the vocabulary tables in host RAM (memory.embeddings=cpu): the first stage looks
    # rows up there, the last stage's head visits for the loss (on a CPU nothing moves; the same bookkeeping).
    memory = chunked if schedule == "gpipe" else {"embeddings": "cpu"} if virtual == 2 else {}
    changes = {"memory": {**recipe["memory"], **memory}}
    path, out = write(root, recipe, f"pp-{schedule}-{nproc}", train__batch_size=batch, distributed=distributed, **changes)
    proc = finetune(str(path), "--nproc", str(nproc), cwd=root)
    stages = 2 * virtual
    replicas = "1 replica" if nproc == 2 else "2 replicas"
    assert f"parallel: pipeline: {stages} stages of {4 // stages} layers over 2 processes x {replicas}" in proc.stdout
    assert all(norm > 0.5 for _, norm in step_rows(one_process))  # every update clipped
    assert ("of frozen vocabulary tables live in host RAM" in proc.stdout) == (virtual == 2)
    assert_same_steps(one_process, out, rel=1e-5)
    assert_adapters_close(adapter(one_process), adapter(out))
    # The periodic checkpoint holds the whole adapter, as one process writes it.
    assert (out / "checkpoints" / "step-2" / "manifest.json").is_file()
    # Each step's measured time per stage and the idle share of its window (ideal: 1/3, interleaved 1/5; this CPU
    # measured 0.20-0.29 after the first step, which also infers the shapes sent). All busy or all idle fails.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"stage_busy_s"' in line]
    assert len(rows) == STEPS and all(len(r["stage_busy_s"]) == 2 and min(r["stage_busy_s"]) > 0 for r in rows)
    measured = sum(r["bubble"] for r in rows[1:]) / (STEPS - 1)
    assert 0.05 < measured < 0.6, measured
    ideal = "20%" if virtual == 2 else "33%"
    assert f"% of each window, measured ({ideal} ideal)" in proc.stdout


DRIVER = """
import os, sys
from finetune.config.schema import load_recipe
from finetune.parallel.runtime import Parallel
from finetune.trainer import Trainer

if os.environ.get("WRONG_SCALE"):  # every gradient doubled, the loss values unchanged
    Parallel.gradient_scale = property(lambda self: 2)
Trainer(load_recipe(sys.argv[1]), progress=False).train()
"""


def test_a_wrong_gradient_scale_fails_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    recipe, out = write(tmp_path, recipe_dict, "doubled", distributed={"pipeline_parallel": 2})
    run_driver(tmp_path, DRIVER, recipe, WRONG_SCALE="1")
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one_process, out, rel=1e-5)
    (loss_one, norm_one), (loss_doubled, norm_doubled) = step_rows(one_process)[0], step_rows(out)[0]
    assert loss_doubled == pytest.approx(loss_one, rel=1e-5) and norm_doubled == pytest.approx(2 * norm_one, rel=1e-5)


def test_sigterm_under_pipeline_resumes_on_one_process_then_under_pipeline_again(base, tmp_path):
    # Whole tensors in every checkpoint: stages gathered into it, scattered back out of it. A constant
    # learning rate, since a resumed run follows the schedule of its new max_steps.
    _, recipe_dict = base
    total = 24
    pp_recipe = {**recipe_dict, "train": {**recipe_dict["train"], "scheduler": "constant"}}
    recipe, out = write(tmp_path, pp_recipe, "moved", distributed={"pipeline_parallel": 2})
    ref_recipe, ref = write(tmp_path, pp_recipe, "straight")
    finetune(str(ref_recipe), f"train.max_steps={total}", cwd=tmp_path)
    stopped = stopped_under_sigterm(recipe, out, tmp_path)
    assert stopped <= total - 4, stopped
    alone = ("distributed.pipeline_parallel=1", f"train.max_steps={stopped + 2}", "resume=auto")
    assert "resume: allowed change distributed.pipeline_parallel: 2 -> 1" in finetune(str(recipe), *alone, cwd=tmp_path).stdout
    again = ("--nproc", "2", f"train.max_steps={total}", "resume=auto")
    assert "resumed from" in finetune(str(recipe), *again, cwd=tmp_path).stdout
    assert_adapters_close(adapter(ref), adapter(out))


def test_dpo_through_the_stages_matches_one_process(base, tmp_path):
    # Each step runs the window through the stages twice: with the adapter off on every stage (the reference,
    # reaching the last stage's loss micro-batch by micro-batch), then the policy forward and backward.
    # Held-out pairs (a short last batch filled with pairs that count nothing) give one process's eval loss.
    from conftest import write_jsonl
    from test_preference_distributed import PAIRS

    _, recipe = base
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:27])
    dpo = {
        "data": {"path": str(pairs), "format": "preference", "max_seq_len": 64, "eval_fraction": 0.2},
        "train__objective": "dpo",
        "train__lr": 1e-2,
        "train__batch_size": 2,
        "eval": {"every_steps": 2, "batch_size": 2},
    }
    one, one_out = write(tmp_path, recipe, "one", **dpo)
    finetune(str(one), cwd=tmp_path)
    staged, out = write(tmp_path, recipe, "staged", distributed={"pipeline_parallel": 2}, **dpo)
    proc = finetune(str(staged), "--nproc", "2", cwd=tmp_path)
    assert "preference accuracy is not scored in a pipeline" in proc.stdout
    assert step_rows(one_out)[0][0] == pytest.approx(0.6931472, abs=1e-6)
    assert_same_steps(one_out, out, rel=1e-5)
    assert_adapters_close(adapter(one_out), adapter(out))

    def rows(run, key):
        return [json.loads(line)[key] for line in (run / "metrics.jsonl").read_text().splitlines() if f'"{key}"' in line]

    assert rows(out, "rewards/margin") == pytest.approx(rows(one_out, "rewards/margin"), rel=1e-4, abs=1e-6)
    assert len(rows(out, "eval_loss")) == 2 and rows(out, "eval_loss") == pytest.approx(rows(one_out, "eval_loss"), rel=1e-5)


def test_packed_rows_pass_between_stages_as_one_process_trains_them(base, tmp_path):
    root, recipe_dict = base
    packed = {**recipe_dict, "data": {**recipe_dict["data"], "packing": True, "max_seq_len": 512}}
    one_path, one = write(tmp_path, packed, "one-packed", train__batch_size=2)
    pp_path, pp = write(tmp_path, packed, "pp-packed", train__batch_size=2, distributed={"pipeline_parallel": 2})
    finetune(str(one_path), cwd=tmp_path)
    finetune(str(pp_path), "--nproc", "2", cwd=tmp_path)
    assert_same_steps(one, pp, rel=1e-5)
    assert_adapters_close(adapter(one), adapter(pp))


PARTS_DRIVER = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from finetune import Trainer

model_dir, rows, out, pp = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3], int(sys.argv[4])
settings = {"seed": 0, "precision": "fp32", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
            "train": {"max_steps": 3, "batch_size": 4, "grad_accum": 2, "lr": 1e-3, "max_grad_norm": None},
            "memory": {"activation_checkpointing": "none"}, "report": {"plot": False},
            "distributed": {"pipeline_parallel": pp}}
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with Trainer.from_parts(model, AutoTokenizer.from_pretrained(model_dir), rows, output_dir=out, progress=False, **settings) as t:
    t.train()
"""


def test_a_model_given_whole_to_every_rank_trains_its_stages_and_saves_each_stages_adapter(base, tmp_path):
    # Trainer.from_parts under torchrun: every rank holds the whole model, each trains and saves only its stage's part.
    from conftest import ALPACA_ROWS

    root, _ = base
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(ALPACA_ROWS))
    driver = tmp_path / "parts.py"
    driver.write_text(PARTS_DRIVER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for pp, cmd in (
        (1, [sys.executable]),
        (2, [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]),
    ):
        args = [*cmd, str(driver), str(root / "model"), str(rows), str(tmp_path / f"parts{pp}"), str(pp)]
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_steps(tmp_path / "parts1", tmp_path / "parts2", rel=1e-5)
    assert_adapters_close(adapter(tmp_path / "parts1"), adapter(tmp_path / "parts2"))


def test_stages_of_uneven_layer_counts_train_as_one_process(base, one_process):
    # distributed.pipeline_layers=[1, 3]: the first stage 1 layer (and the embeddings), the last 3 (and the head).
    root, recipe = base
    distributed = {"pipeline_parallel": 2, "pipeline_layers": [1, 3]}
    path, out = write(root, recipe, "pp-uneven", distributed=distributed)
    proc = finetune(str(path), "--nproc", "2", cwd=root)
    assert "parallel: pipeline: 2 stages of 1 + 3 layers over 2 processes" in proc.stdout
    assert_same_steps(one_process, out, rel=1e-5)
    assert_adapters_close(adapter(one_process), adapter(out))
