"""Long context on one card: memory.loss=chunked|auto never holds the whole logits.

The kernel's equality with the full path is in tests/test_linear_ce.py; here: the recipe
keys, the rules, the trainer path and the planner's terms (plan --max-seq).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config.schema import build_recipe, load_recipe
from finetune.errors import ConfigError
from finetune.gpus import find_gpu
from finetune.metrics import read_metrics
from finetune.plan import longest_trainable_seq, plan_recipe
from finetune.plan.inputs import DEFAULT_IMPL
from finetune.plan.memory import loss_peak_bytes
from finetune.trainer import Trainer

LLAMA_31_8B = str(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b")


def cfg_for(recipe_dict, out, **memory):
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    data["report"] = {"plot": False}
    data["train"]["max_steps"] = 3
    data["memory"] = {**data["memory"], **memory}
    return build_recipe(data)


def test_chunked_loss_trains_like_the_full_logits(recipe_dict, tmp_path):
    full = Trainer(cfg_for(recipe_dict, tmp_path / "full", loss="full"), progress=False)
    full.train()
    chunked = Trainer(cfg_for(recipe_dict, tmp_path / "chunked", loss="chunked", loss_chunk=16), progress=False)
    chunked.train()
    assert chunked.loss_fn.chunked_batches == 3 and full.loss_fn.chunked_batches == 0
    losses = lambda out: [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]  # noqa: E731
    assert losses(tmp_path / "chunked") == pytest.approx(losses(tmp_path / "full"), rel=1e-5)
    # auto: these batches (a few dozen targets) fit one chunk of 256: the one-matmul path, bitwise the same run.
    auto = Trainer(cfg_for(recipe_dict, tmp_path / "auto"), progress=False)
    auto.train()
    assert auto.loss_fn.chunked_batches == 0 and losses(tmp_path / "auto") == losses(tmp_path / "full")


def test_liger_under_fsdp_is_refused_and_needs_cuda(recipe_dict, tmp_path):
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(tmp_path / "r"), distributed={"strategy": "fsdp"}, quant={"bits": 4})
    build_recipe({**data, "memory": {"loss": "chunked"}})  # the head stays gathered after FSDP's forward
    data["memory"] = {"loss": "liger"}
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert "memory.loss=liger is not run under FSDP yet" in str(err.value)
    assert "use memory.loss=auto or chunked" in str(err.value)
    with pytest.raises(ConfigError) as err:
        Trainer(cfg_for(recipe_dict, tmp_path / "liger", loss="liger"), progress=False).train()
    assert "memory.loss=liger runs liger-kernel's CUDA kernel" in str(err.value) and "memory.loss=chunked" in str(err.value)


def test_the_planner_holds_one_chunk_of_logits():
    # The job: Llama-3.1-8B QLoRA, batch 2 x 2048, on a 4090 (128,256-token vocabulary).
    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "train.batch_size=2", "data.max_seq_len=2048"]
    full = plan_recipe(load_recipe("qlora-1x24gb", base + ["memory.loss=full"]), gpu)
    auto = plan_recipe(load_recipe("qlora-1x24gb", base), gpu)
    term = lambda e: next(c.bytes for c in e.components if c.key == "logits_loss")  # noqa: E731
    assert term(full) == loss_peak_bytes(2 * 2048, 128256, 2, DEFAULT_IMPL)
    assert term(auto) == loss_peak_bytes(256, 128256, 2, DEFAULT_IMPL)  # one chunk of memory.loss_chunk
    assert full.peak_bytes - auto.peak_bytes >= 4 * 2**30  # the logits were most of the 14 GiB peak
    assert auto.step_time_s > full.step_time_s  # the head runs again in backward


def test_plan_max_seq_finds_the_longest_sequence_at_batch_1():
    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl"]
    full = longest_trainable_seq(load_recipe("qlora-1x24gb", base + ["memory.loss=full"]), gpu)
    auto = longest_trainable_seq(load_recipe("qlora-1x24gb", base), gpu)
    assert 6_000 < full.as_written < 10_000  # about 8k with whole logits (the number)
    assert auto.as_written > 2.5 * full.as_written
    assert auto.best >= auto.as_written and full.best >= auto.as_written  # the search may chunk the loss too
    # The answer is the edge: one token more does not fit as written.
    cfg = load_recipe("qlora-1x24gb", base + ["train.batch_size=1", "train.grad_accum=1"])
    edge = plan_recipe(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_seq_len": auto.as_written})}), gpu)
    over = plan_recipe(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_seq_len": auto.as_written + 1})}), gpu)
    assert edge.peak_bytes <= 0.9 * gpu.memory_bytes < over.peak_bytes


def test_plan_max_seq_on_the_command_line(capsys):
    from finetune.cli.commands import main

    assert (
        main(
            [
                "plan",
                "qlora-1x24gb",
                "model.path=" + LLAMA_31_8B,
                "data.path=unused.jsonl",
                "--gpu",
                "rtx4090",
                "--max-seq",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    cfg = load_recipe("qlora-1x24gb", ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl"])
    found = longest_trainable_seq(cfg, find_gpu("rtx4090", None))
    assert (out["as_written"], out["best"]) == (found.as_written, found.best) and out["gpu"] == "rtx4090"
    assert "loss in chunks of 256" in out["best_setup"]


@pytest.mark.parametrize("checkpointing", ["none", "all"])
def test_tiled_mlp_equals_the_whole_mlp_loss_and_gradients(recipe_dict, tmp_path, checkpointing):
    # memory.tiled_mlp=3: every decoder MLP runs over 3 tiles of the sequence, each recomputed in
    # backward (inside the layer's own recomputation when it is checkpointed too).
    import torch

    def loss_and_grads(tiles):
        data = json.loads(json.dumps(recipe_dict))
        data.update(output_dir=str(tmp_path / f"t{tiles}"), report={"plot": False})
        data["lora"]["dropout"] = 0.0
        data["memory"] = {"activation_checkpointing": checkpointing, "tiled_mlp": tiles}
        trainer = Trainer(build_recipe(data), progress=False)
        trainer.setup()
        model, batch = trainer.model, trainer.step_batches(0)[0]
        loss, n = trainer.compute_loss(model, batch)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        return trainer, batch, loss.detach(), grads

    whole_trainer, batch, whole, g_whole = loss_and_grads("off")
    tiled_trainer, _, tiled, g_tiled = loss_and_grads(3)
    assert batch["input_ids"].shape[1] >= 3  # something to tile
    mlps = [layer.mlp for layer in tiled_trainer.model.base_model.model.model.layers]
    assert all(getattr(m, "_finetune_tiled", False) for m in mlps)
    assert not any(getattr(layer.mlp, "_finetune_tiled", False) for layer in whole_trainer.model.base_model.model.model.layers)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=0)
    assert g_tiled.keys() == g_whole.keys() and any("mlp" in k for k in g_whole)
    for name in g_whole:
        torch.testing.assert_close(g_tiled[name], g_whole[name], rtol=1e-5, atol=1e-6)


def test_tiles_for_auto_off_and_a_number():
    from finetune.memory.tiled_mlp import tiles_for

    assert tiles_for("off", 100_000, 4096) == 1
    assert tiles_for("auto", 4096, 4096) == 1 and tiles_for("auto", 4097, 4096) == 2  # whole up to 4096 positions
    assert tiles_for("auto", 32_768, 4096) == 8 and tiles_for("auto", 32_768, 8192) == 4  # tiles of max(4096, hidden)
    assert tiles_for(4, 2048, 4096) == 4 and tiles_for(4, 3, 4096) == 3  # never more tiles than positions


def test_the_planner_holds_one_mlp_tile():
    # Llama-3.1-8B at 32k tokens: auto runs each MLP in 8 tiles of 4096 positions.
    from finetune.plan.inputs import RecipeFacts
    from finetune.plan.memory import mlp_saved_bytes_per_token

    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "train.batch_size=1", "data.max_seq_len=32768"]
    whole = plan_recipe(load_recipe("qlora-1x24gb", base + ["memory.tiled_mlp=off"]), gpu)
    tiled = plan_recipe(load_recipe("qlora-1x24gb", base), gpu)
    term = lambda e: next(c.bytes for c in e.components if c.key == "recompute_layer")  # noqa: E731
    cfg = load_recipe("qlora-1x24gb", base)
    mlp = 32768 * mlp_saved_bytes_per_token(whole.shape, RecipeFacts.from_config(cfg, "bf16"))
    hidden_in = 32768 * 2 * whole.shape.hidden  # the MLP input each layer keeps instead
    assert term(whole) - term(tiled) == mlp - mlp // 8 - hidden_in
    assert tiled.peak_bytes < whole.peak_bytes and tiled.step_time_s > whole.step_time_s  # MLP forward once more
    off = longest_trainable_seq(load_recipe("qlora-1x24gb", base[:2] + ["memory.tiled_mlp=off"]), gpu)
    auto = longest_trainable_seq(load_recipe("qlora-1x24gb", base[:2]), gpu)
    assert auto.as_written > off.as_written


def test_flex_attention_plans_no_mask_for_packed_rows():
    # flex_attention keeps packed examples apart with a block mask (128 x 128 tiles) instead of
    # sdpa's (rows, 1, T, T) bool mask: 16 GiB at 131,072 tokens.
    gpu = find_gpu("rtx4090", None)
    base = ["model.path=" + LLAMA_31_8B, "data.path=unused.jsonl", "data.packing=true"]
    mask = lambda *more: plan_recipe(load_recipe("qlora-longctx-1x24gb", base + list(more)), gpu).component("attention_mask")  # noqa: E731
    assert mask("model.attn_implementation=sdpa") == 131_072**2 and mask("model.attn_implementation=flex_attention") == 0
    assert mask("model.attn_implementation=flash_attention_2") == 0 and mask("data.packing=false") == 0


@pytest.mark.gpu
def test_packed_rows_under_flex_attention_train_like_sdpa(recipe_dict, tmp_path):
    # GPU only: torch's FlexAttention has no backward on CPU.
    def run(attention):
        # fp32 and clipping off: losses and pre-clip gradient norms step by step (bf16's rel 2e-2 would hide a
        # wrong backward, or a block mask that lets one packed example see another).
        data = json.loads(json.dumps(recipe_dict))
        data.update(output_dir=str(tmp_path / attention), report={"plot": False}, precision="fp32")
        data["model"] = {**data["model"], "attn_implementation": attention}
        data["data"]["packing"] = True
        data["train"].update(max_steps=2, batch_size=1, max_grad_norm=None)
        Trainer(build_recipe(data), progress=False).train()
        return [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / attention / "metrics.jsonl") if "loss" in r]

    flex, sdpa = run("flex_attention"), run("sdpa")
    assert len(flex) == len(sdpa) == 2
    assert [loss for loss, _ in flex] == pytest.approx([loss for loss, _ in sdpa], rel=1e-4)
    assert [norm for _, norm in flex] == pytest.approx([norm for _, norm in sdpa], rel=1e-3)
