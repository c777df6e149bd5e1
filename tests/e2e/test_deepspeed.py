"""distributed.strategy=deepspeed on CPU: DeepSpeed's CPU accelerator over gloo, 2 processes through
the real launcher (`finetune run --nproc 2`), a 4-bit base stored in fp32 (the QLoRA + ZeRO-3 path).

ZeRO-3, with the optimizer state (DeepSpeed's CPU Adam) and the weights offloaded, trains the same
steps as one process (losses and pre-clip gradient norms); a run stopped by SIGTERM
under ZeRO-2 checkpoints whole tensors, which resume under ZeRO-3 and then on one process (N -> M,
stage -> stage) and end where the uninterrupted single process ends.

DeepSpeed is an optional extra (pip install 'finetune[deepspeed]'; the test extra installs it). On a
machine without a GPU the offloaded optimizer is the trainer's own AdamW (already on the CPU); DeepSpeed's
CPU Adam, which GPU runs step with, is compiled on first use and not run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ALPACA_ROWS, assert_same_steps, write_jsonl
from test_distributed import adapter, assert_adapters_close, finetune, losses, preempt_after, write

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    recipe = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(write_jsonl(root / "train.jsonl", ALPACA_ROWS)), "format": "alpaca", "max_seq_len": 256},
        "output_dir": str(root / "run"),
        "seed": 0,
        "report": {"plot": False},  # no loss.png: ~0.5 s of matplotlib a run
        "precision": "fp32",
        "quant": {"bits": 4},  # on 2 processes stored in fp32 (bnb_4bit_quant_storage = the compute dtype)
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        # Clipping off: the pre-clip gradient norms must agree too (a wrong loss scale hides behind
        # clipping); constant lr: a resumed leg may stop earlier than the run.
        "train": {
            "max_steps": STEPS,
            "batch_size": 2,
            "grad_accum": 2,
            "lr": 1e-3,
            "scheduler": "constant",
            "max_grad_norm": None,
        },
        "memory": {"activation_checkpointing": "none"},
        "checkpoint": {"every_steps": 100},
    }
    return root, recipe


@pytest.fixture(scope="module")
def one_process(base) -> Path:
    """The reference: one process, batch 4 (the global batch of 2 x 2)."""
    root, recipe = base
    path, out = write(root, recipe, "one", train__batch_size=4)
    finetune(str(path), cwd=root)
    return out


def test_zero3_with_offload_on_two_processes_matches_one(base, one_process):
    root, recipe = base
    distributed = {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    path, out = write(root, recipe, "zero3", distributed=distributed)
    proc = finetune(str(path), "--nproc", "2", cwd=root)
    assert "parallel: deepspeed over 2 processes (ZeRO-3, optimizer state on cpu, weights on cpu)" in proc.stdout
    assert_same_steps(one_process, out, rel=1e-5)
    assert losses(out)[-1] < losses(out)[0]
    # The adapter is gathered whole from the partitions (under ZeRO-3 every weight is one) and equals one process's.
    assert_adapters_close(adapter(one_process), adapter(out), atol=1e-5)


def test_sigterm_under_zero2_resumes_under_zero3_then_on_one_process(base, one_process):
    root, recipe = base
    path, out = write(root, recipe, "moved", distributed={"strategy": "deepspeed", "zero_stage": 2})
    # 400 steps: the run cannot end before the signal lands (a resume may shorten max_steps).
    job = finetune(str(path), "--nproc", "2", "train.max_steps=400", cwd=root, log=root / "moved.log")
    output = preempt_after(job, out, 2)
    (saved,) = sorted((out / "checkpoints").glob("step-*/manifest.json"))  # the signal's, not a periodic one
    stopped = int(saved.parent.name.split("-")[1])
    # Steps left for both legs below (ZeRO-3, then one process) to train at least one each.
    assert 2 <= stopped <= STEPS - 2, output[-3000:]
    # Whole tensors in the checkpoint: ZeRO-3 on 2 processes continues it for two steps (weights and
    # optimizer state scattered into its partitions), then one process without DeepSpeed (batch 4:
    # the same global batch) to the end.
    zero3 = ("distributed.zero_stage=3", f"train.max_steps={min(stopped + 2, STEPS - 1)}", "resume=auto")
    assert "resumed from" in finetune(str(path), "--nproc", "2", *zero3, cwd=root).stdout
    alone = ("distributed.strategy=auto", "train.batch_size=4", "resume=auto", "resume_ignore_changes=true")
    proc = finetune(str(path), *alone, cwd=root)
    assert "resumed from" in proc.stdout
    got, want = losses(out), losses(one_process)
    assert len(got) == STEPS
    assert got == pytest.approx(want, rel=1e-5), (stopped, got, want)
    assert_adapters_close(adapter(one_process), adapter(out), atol=1e-5)
