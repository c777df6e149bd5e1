"""Context parallelism (distributed.context_parallel) on CPU, gloo, a tiny Llama in 4-bit, fp32: each sequence
split over 2 ranks (ring and Ulysses), alone and with 2 replicas, trains as one process does (losses and
pre-clip gradient norms, adapter), plain and packed rows; a negative control; SIGTERM under cp=2 resumes on
one process. Through the real launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_same_steps, build_char_tokenizer, build_tiny_llama, step_rows
from test_distributed import adapter, assert_adapters_close, finetune, run_driver, stopped_under_sigterm, write

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny Llama (4 heads, 2 key/value heads), 2 micro-batches of 4 rows per step, clipping at a norm
    every step exceeds (so a wrong gradient shows in the updates too)."""
    from conftest import ALPACA_ROWS, write_jsonl

    root = tmp_path_factory.mktemp("context")
    model = root / "model"
    model.mkdir()
    build_tiny_llama(model, vocab_size=len(build_char_tokenizer(model)), hidden=128, layers=2)
    recipe = {
        "model": {"path": str(model)},
        "data": {
            "path": str(write_jsonl(root / "train.jsonl", ALPACA_ROWS)),
            "format": "alpaca",
            "max_seq_len": 256,
            "eval_fraction": 0.1,
        },
        "eval": {"every_steps": 2},
        "seed": 0,
        "report": {"plot": False},  # no loss.png: ~0.5 s of matplotlib a run
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {
            "max_steps": STEPS,
            "batch_size": 4,
            "grad_accum": 2,
            "lr": 1e-3,
            "max_grad_norm": 0.5,
            "scheduler": "constant",
        },
        "checkpoint": {"every_steps": 2},
    }
    return root, recipe


@pytest.fixture(scope="module")
def one_process(base) -> Path:
    root, recipe = base
    path, out = write(root, recipe, "one")
    finetune(str(path), cwd=root)
    return out


def packed(recipe: dict) -> dict:
    return {
        **recipe,
        "data": {**recipe["data"], "packing": True, "max_seq_len": 512},
        "train": {**recipe["train"], "batch_size": 2},
    }


@pytest.fixture(scope="module")
def one_packed(base) -> Path:
    root, recipe = base
    path, out = write(root, packed(recipe), "one-packed")
    finetune(str(path), cwd=root)
    return out


@pytest.mark.parametrize(
    "mode, nproc, rows, strategy",
    # Ulysses on plain rows is the packed case without the cuts: tests/test_context_attention.py checks its logits.
    # fsdp (cp x FSDP): each rank holds half of every layer's weights too, gathered for its forward; the
    # gradients' reduce-scatter sums the parts; the held-out batches run on both ranks of the group.
    [("ring", 2, "plain", "auto"), ("ring", 4, "packed", "auto"), ("ulysses", 2, "packed", "auto"), ("ring", 2, "plain", "fsdp")],
    ids=["ring", "ring-packed-x2-replicas", "ulysses-packed", "ring-fsdp"],
)
def test_a_sequence_split_over_two_ranks_trains_as_one_process(base, one_process, one_packed, mode, nproc, rows, strategy):
    root, recipe = base
    reference = one_packed if rows == "packed" else one_process
    recipe = packed(recipe) if rows == "packed" else recipe
    batch = recipe["train"]["batch_size"] // (nproc // 2)  # the same global batch: batch_size is per replica
    distributed = {"context_parallel": 2, "context_parallel_mode": mode, "strategy": strategy}
    name = f"cp2-{mode}-{nproc}-{rows}-{strategy}"
    path, out = write(root, recipe, name, distributed=distributed, train__batch_size=batch)
    proc = finetune(str(path), "--nproc", str(nproc), cwd=root)
    replicas = "1 replica" if nproc == 2 else "2 replicas"
    sharded = ", the weights sharded over all 2 (FSDP)" if strategy == "fsdp" else "\n"
    assert f"parallel: context parallel ({mode}), each sequence split over 2 processes x {replicas}{sharded}" in proc.stdout
    assert all(norm > 0.5 for _, norm in step_rows(reference))  # every update clipped
    assert_same_steps(reference, out, rel=1e-5)
    # Packed rows attend in fp32 matmuls (masked blocks), one process in sdpa: where a LoRA-B coordinate's
    # gradient is near zero, AdamW's m / sqrt(v) turns that rounding into up to ~1e-4 of its 4 updates.
    assert_adapters_close(adapter(reference), adapter(out), atol=1e-4 if rows == "packed" else 1e-5)
    assert eval_losses(out) == pytest.approx(eval_losses(reference), rel=1e-5) and len(eval_losses(out)) == 2  # split too


@pytest.mark.parametrize("sp", [False, True], ids=["cp2xtp2", "cp2xtp2-sp"])
def test_a_sequence_split_over_tensor_parallel_shares_trains_as_one_process(base, one_process, sp):
    # cp2 x tp2 (4 processes, 1 replica): each rank holds half of every layer (2 of the 4 heads, half the MLP) and
    # half of every row; the ring runs over the shares' heads, the shares' partial gradients are summed over
    # their tensor-parallel group, then over the context-parallel parts. The 4-bit shares are the whole weights'
    # blocks (hidden 128: whole 64-element blocks), so the base is one process's. The vocabulary is split over
    # each tensor-parallel pair too (vocab_parallel): each part's loss from its pair's columns of the logits.
    # sp: each part's positions split again over its tensor-parallel pair between the split linears (the part
    # padded to an even length with tokens that attend only to themselves).
    root, recipe = base
    distributed = {"context_parallel": 2, "tensor_parallel": 2, "vocab_parallel": True, "sequence_parallel": sp}
    path, out = write(root, recipe, f"cp2-tp2-{sp}", distributed=distributed)
    proc = finetune(str(path), "--nproc", "4", cwd=root)
    said = "each sequence split over 2 processes x 2 tensor-parallel ranks (each layer split, the vocabulary too) x 1 replica"
    assert said in proc.stdout
    assert_same_steps(one_process, out, rel=1e-5)
    assert_adapters_close(adapter(one_process), adapter(out))
    assert eval_losses(out) == pytest.approx(eval_losses(one_process), rel=1e-5)


def test_a_sequence_split_over_pipeline_stages_trains_as_one_process(base, one_packed):
    # cp2 x pp2 (4 processes, 1 replica): each part of the rows runs a pipeline of its own (2 stages of 1 layer, 1F1B
    # over the 2 micro-batches); each stage's attention rings with the same stage of the other part's pipeline, and
    # each stage's gradients are summed over the parts. Packed rows: each micro-batch's part splits its examples
    # apart differently, so a stage that ran one micro-batch's part for another fails (seen). The held-out batches
    # run through both pipelines, each part's loss over its own targets.
    root, recipe = base
    distributed = {"context_parallel": 2, "pipeline_parallel": 2}
    path, out = write(root, packed(recipe), "cp2-pp2", distributed=distributed)
    proc = finetune(str(path), "--nproc", "4", cwd=root)
    said = "2 stages of 1 layers over 2 processes x 2 context-parallel ranks (ring, each sequence split) x 1 replica"
    assert said in proc.stdout
    assert_same_steps(one_packed, out, rel=1e-5)
    assert_adapters_close(adapter(one_packed), adapter(out), atol=1e-4)  # packed rows: see the test above
    assert eval_losses(out) == pytest.approx(eval_losses(one_packed), rel=1e-5) and len(eval_losses(out)) == 2


def eval_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_the_one_card_levers_split_as_one_process_trains(base, one_process):
    # Chunked loss over each rank's targets, tiled MLP, checkpointed inputs, the vocabulary tables and each
    # rank's own copy of the 4-bit layers in host RAM: each moves or chunks what a rank computes on its part,
    # never what it computes. (On a CPU the streamed layers go nowhere: a GPU run moves them.)
    root, recipe = base
    memory = {
        "loss": "chunked",
        "loss_chunk": 16,
        "tiled_mlp": 2,
        "activation_offload": True,
        "embeddings": "cpu",
        "base_weights": "cpu",
    }
    path, out = write(root, recipe, "cp2-levers", distributed={"context_parallel": 2}, memory=memory)
    finetune(str(path), "--nproc", "2", cwd=root)
    assert_same_steps(one_process, out, rel=1e-5)
    assert_adapters_close(adapter(one_process), adapter(out))


DRIVER = """
import os, sys
import torch
from finetune.config.schema import load_recipe
from finetune.parallel import ring
from finetune.trainer import Trainer

cap = int(os.environ.get("CAP", "0"))
if cap:  # no forward of the model may see more tokens a row than the cap
    embed = torch.nn.Embedding.forward
    def capped(self, ids):
        assert ids.shape[-1] <= cap, f"a forward of {ids.shape[-1]} tokens a row, over the cap of {cap}"
        return embed(self, ids)
    torch.nn.Embedding.forward = capped
if os.environ.get("OWN_KEYS_ONLY"):  # the ring broken: each rank's queries see only its own keys
    pairs = ring._pairs
    ring._pairs = lambda split, mine, theirs: pairs(split, mine, theirs) if mine == theirs else iter(())
if os.environ.get("SP_UNREDUCED"):  # sequence parallelism's reduce-scatter keeps each rank's partial sum
    import torch.distributed as dist
    dist.reduce_scatter = lambda out, parts, group=None: out.copy_(parts[dist.get_rank(group)])
if os.environ.get("FSDP_AVERAGES"):  # broken: FSDP's reduce-scatter averages the parts' gradients (its default)
    from torch.distributed.fsdp import FSDPModule
    FSDPModule.set_gradient_divide_factor = lambda self, factor: None
if os.environ.get("PARTS_UNSUMMED"):  # broken: a share's gradient never summed over the context-parallel parts
    from finetune.parallel import tensor
    tensor.dims_group = lambda mesh, dims: None
if os.environ.get("STAGE_PARTS_UNSUMMED"):  # broken: a stage's gradient never summed over the other parts' pipelines
    from finetune.parallel.pipeline import Pipeline
    Pipeline.sync_gradients = lambda self, params: None
Trainer(load_recipe(sys.argv[1]), progress=False).train()
"""


def test_keys_that_never_travel_fail_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    recipe, out = write(tmp_path, recipe_dict, "own-keys", distributed={"context_parallel": 2})
    run_driver(tmp_path, DRIVER, recipe, OWN_KEYS_ONLY="1")
    (loss_one, _), (loss_bad, _) = step_rows(one_process)[0], step_rows(out)[0]
    assert loss_bad != pytest.approx(loss_one, rel=1e-3)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one_process, out, rel=1e-5)


def test_shares_whose_parts_are_never_summed_fail_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    distributed = {"context_parallel": 2, "tensor_parallel": 2}
    recipe, out = write(tmp_path, recipe_dict, "unsummed", distributed=distributed, train__max_steps=2)
    run_driver(tmp_path, DRIVER, recipe, nproc=4, PARTS_UNSUMMED="1")
    assert_only_the_gradient_differs(one_process, out)


def test_stages_whose_parts_are_never_summed_fail_the_comparison(base, one_packed, tmp_path):
    root, recipe_dict = base
    distributed = {"context_parallel": 2, "pipeline_parallel": 2}
    recipe, out = write(tmp_path, packed(recipe_dict), "stage-unsummed", distributed=distributed, train__max_steps=1, eval={})
    run_driver(tmp_path, DRIVER, recipe, nproc=4, STAGE_PARTS_UNSUMMED="1")
    assert_only_the_gradient_differs(one_packed, out)


def assert_only_the_gradient_differs(reference: Path, out: Path) -> None:
    """A negative control that leaves a gradient unsummed: its first step's loss is the reference's, its norm is not."""
    (loss_one, norm_one), (loss_bad, norm_bad) = step_rows(reference)[0], step_rows(out)[0]
    assert loss_bad == pytest.approx(loss_one, rel=1e-5)  # the forward is right; each part's gradient stays its own
    assert norm_bad != pytest.approx(norm_one, rel=1e-3)


def test_sequence_parallel_parts_whose_partial_outputs_are_never_summed_fail_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    distributed = {"context_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True}
    recipe, out = write(tmp_path, recipe_dict, "sp-unreduced", distributed=distributed, train__max_steps=1)
    run_driver(tmp_path, DRIVER, recipe, nproc=4, SP_UNREDUCED="1")
    assert step_rows(out)[0][0] != pytest.approx(step_rows(one_process)[0][0], rel=1e-3)  # the forward itself


def test_fsdp_shards_whose_parts_are_averaged_fail_the_comparison(base, one_process, tmp_path):
    root, recipe_dict = base
    distributed = {"context_parallel": 2, "strategy": "fsdp"}
    recipe, out = write(tmp_path, recipe_dict, "averaged", distributed=distributed, train__max_steps=1)
    run_driver(tmp_path, DRIVER, recipe, FSDP_AVERAGES="1")
    (loss_one, norm_one), (loss_bad, norm_bad) = step_rows(one_process)[0], step_rows(out)[0]
    assert loss_bad == pytest.approx(loss_one, rel=1e-5)  # the forward is right; the gradient is half of it
    assert norm_bad == pytest.approx(norm_one / 2, rel=1e-4)


def test_rows_longer_than_one_process_takes_train_on_two(base, tmp_path):
    # A cap on the tokens any forward sees a row: one process cannot train rows of 100 characters under a cap
    # of 60; two, each holding a half (+1 token), train them as the uncapped process did.
    from conftest import write_jsonl

    root, recipe_dict = base
    rows = [{"text": "".join(str((i * 7 + j) % 10) for j in range(100))} for i in range(8)]
    data = {"path": str(write_jsonl(tmp_path / "long.jsonl", rows)), "format": "text", "max_seq_len": 256}
    recipe = {**recipe_dict, "data": data, "eval": {}, "train": {**recipe_dict["train"], "max_steps": 2, "grad_accum": 1}}
    reference, ref = write(tmp_path, recipe, "uncapped")
    run_driver(tmp_path, DRIVER, reference, nproc=1)
    alone, _ = write(tmp_path, recipe, "capped-alone")
    with pytest.raises(AssertionError, match="over the cap of 60"):
        run_driver(tmp_path, DRIVER, alone, nproc=1, CAP="60")
    split, out = write(tmp_path, recipe, "capped-split", distributed={"context_parallel": 2})
    run_driver(tmp_path, DRIVER, split, CAP="60")
    assert_same_steps(ref, out, rel=1e-5)
    assert_adapters_close(adapter(ref), adapter(out))


def test_sigterm_under_context_parallelism_resumes_on_one_process(base, tmp_path):
    # Every rank of the group holds the whole adapter: the checkpoint is one process's, and the run resumed
    # on one process ends where an uninterrupted one-process run ends.
    root, recipe_dict = base
    total = 12
    recipe, out = write(tmp_path, recipe_dict, "stopped", distributed={"context_parallel": 2})
    ref_recipe, ref = write(tmp_path, recipe_dict, "straight")
    finetune(str(ref_recipe), f"train.max_steps={total}", cwd=tmp_path)
    stopped = stopped_under_sigterm(recipe, out, tmp_path)
    assert stopped <= total - 2, stopped
    proc = finetune(str(recipe), "distributed.context_parallel=1", f"train.max_steps={total}", "resume=auto", cwd=tmp_path)
    assert "resume: allowed change distributed.context_parallel: 2 -> 1" in proc.stdout
    assert_adapters_close(adapter(ref), adapter(out))
