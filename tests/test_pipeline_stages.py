"""Pipeline parallelism without processes: the grid of stages x replicas, the rules a recipe and a launch
are checked against, and the stage modules run one after the other in one process (they must give
what the whole model gives). The multi-process runs: tests/e2e/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_llama
from test_config import MINIMAL, problems_of

from finetune.config.schema import build_recipe
from finetune.data import IGNORE_INDEX
from finetune.declarations.layout import Layout, launch_problems
from finetune.errors import ConfigError
from finetune.objectives.loss import CausalLMLoss
from finetune.parallel.stages import Stage, pad_window, stage_placement


def test_ranks_are_numbered_pipeline_outermost():
    # 2 stages x 2 replicas: ranks 0, 1 run stage 0 (replicas 0, 1); ranks 2, 3 stage 1.
    got = [(x.stage, x.replica, x.pipeline_ranks(x.replica), x.stage_ranks(x.stage)) for x in (Layout(2, 2, r) for r in range(4))]
    assert got == [(0, 0, [0, 2], [0, 1]), (0, 1, [1, 3], [0, 1]), (1, 0, [0, 2], [2, 3]), (1, 1, [1, 3], [2, 3])]
    interleaved = Layout(2, 1, 1, virtual_stages=2)
    assert interleaved.stages_of_rank == [1, 3] and interleaved.stage_count == 4
    assert [interleaved.layer_range(s, 8) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    cfg = build_recipe({**MINIMAL, "distributed": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}})
    assert (Layout.of(cfg, 3, 4).replicas, Layout.of(cfg, 3, 4).stage) == (2, 1)
    assert not Layout.of(build_recipe(MINIMAL), 1, 2).pipelined  # pipeline_parallel=1: two replicas, no stages


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"distributed": {"pipeline_parallel": 2, "strategy": "fsdp"}}, "does not shard them. Set distributed.strategy=auto"),
        ({"distributed": {"pipeline_parallel": 2}, "lora": None, "quant": {"bits": None}}, "full fine-tuning is not pipelined"),
        (
            {
                "distributed": {"pipeline_parallel": 2},
                "train": {"objective": "dpo", "precompute_reference": True},
                "data": {"path": "d.jsonl", "format": "preference"},
            },
            "Set train.precompute_reference=false",
        ),
        ({"distributed": {"pipeline_parallel": 2}, "memory": {"base_weights": "cpu"}}, "memory.base_weights=cpu: a stage keeps"),
        ({"distributed": {"pipeline_parallel": 2, "grad_compression": "bf16"}}, "a hook of DDP's all-reduce"),
        ({"distributed": {"pipeline_parallel": 2}, "precision": "fp16"}, "each stage's GradScaler would decide alone"),
        (
            {"distributed": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"}},
            "needs distributed.virtual_stages >= 2",
        ),
        (
            {"distributed": {"pipeline_parallel": 2, "virtual_stages": 2}},
            "needs distributed.pipeline_schedule=interleaved_1f1b (it is 1f1b)",
        ),
    ],
)
def test_a_recipe_the_pipeline_cannot_run_is_refused_naming_the_fix(extra, says):
    problems = problems_of({**MINIMAL, **extra, "train": {"grad_accum": 2, **extra.get("train", {})}})
    assert any(says in p for p in problems), problems
    assert any("distributed.pipeline_parallel=1" in p or "virtual_stages" in p for p in problems)


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_with_the_same_global_batch():
    (got,) = problems_of({**MINIMAL, "distributed": {"pipeline_parallel": 2}, "train": {"batch_size": 16}})
    assert got == (
        "distributed.pipeline_schedule=1f1b needs at least as many micro-batches as stages (train.grad_accum=1 < 2). "
        "Set train.grad_accum=2 train.batch_size=8 (the same 16 examples per step per replica), or "
        "distributed.pipeline_schedule=gpipe."
    )
    (got,) = problems_of(
        {
            **MINIMAL,
            "distributed": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
            "train": {"grad_accum": 5},
        }
    )
    assert "needs train.grad_accum to be a multiple of its 2 rounds of 2 micro-batches (it is 5)" in got
    build_recipe({**MINIMAL, "distributed": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}})  # gpipe takes any


def test_a_launch_that_cannot_split_is_refused_before_loading():
    cfg = build_recipe({**MINIMAL, "distributed": {"pipeline_parallel": 4}, "train": {"grad_accum": 4}})
    assert launch_problems(cfg, 8, 32, "llama") == []
    world, layers, family = launch_problems(cfg, 6, 30, "gemma2")
    assert "on 6 processes: the processes must be stages x replicas. Launch with --nproc 4 or a multiple" in world
    assert (
        "the model has 30 decoder layers, which do not split evenly into 4. pipeline_parallel values that do: 2, 3, 5, 6, 10, 15"
        in layers
    )
    assert "a 'gemma2' model; stages run the decoder families llama, mistral, qwen2, qwen3" in family
    assert launch_problems(cfg, 1, None, None)[0].startswith("distributed.pipeline_parallel=4 on 1 processes")


def test_a_window_is_right_padded_to_one_shape_that_trains_nothing_more():
    a = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "labels": torch.tensor([[-100, 6, 7]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
    }
    b = {
        "input_ids": torch.tensor([[8, 9]]),
        "labels": torch.tensor([[-100, 9]]),
        "attention_mask": torch.ones(1, 2, dtype=torch.long),
    }
    w = pad_window([a, b], longest=128)
    assert w["input_ids"].shape == (2, 64)  # bucketed: a few shapes per run
    assert w["input_ids"][:, :3].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert w["labels"][1, 1:].tolist() == [9] + [IGNORE_INDEX] * 62 and int((w["labels"] != IGNORE_INDEX).sum()) == 3
    assert w["attention_mask"].sum(1).tolist() == [3, 2]
    assert w["position_ids"][1, :4].tolist() == [0, 1, 2, 3]
    assert pad_window([a], longest=3)["input_ids"].shape == (1, 3)  # never past data.max_seq_len


def test_stages_run_one_after_another_give_the_whole_models_loss_and_gradients(tmp_path):
    from transformers import AutoModelForCausalLM

    build_tiny_llama(tmp_path, vocab_size=64, layers=4)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (2, 10))
    batches = [
        {"input_ids": ids[:1], "labels": ids[:1].clone(), "attention_mask": torch.ones(1, 10, dtype=torch.long)},
        {"input_ids": ids[1:, :7], "labels": ids[1:, :7].clone(), "attention_mask": torch.ones(1, 7, dtype=torch.long)},
    ]
    loss = CausalLMLoss()
    want = sum(loss(model, b)[0] for b in batches)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    w = pad_window(batches, longest=256)
    first, last = Stage(model.model, 0, 2, True, False), Stage(model.model, 2, 4, False, True)
    assert len(list(first.parameters())) == len(list(model.model.layers[:2].parameters()))  # its layers only
    hidden = last(first(w["input_ids"], w["attention_mask"], w["position_ids"]), w["attention_mask"], w["position_ids"])
    got, n = loss.head_loss(model, hidden, w["labels"])
    assert n == 9 + 6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    got.backward()
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)
    chunked = CausalLMLoss(chunk_rows=4)  # the chunked loss on the last stage: the same sum
    torch.testing.assert_close(chunked.head_loss(model, hidden, w["labels"])[0], want, rtol=1e-6, atol=1e-5)


def test_a_trainer_that_overrides_compute_loss_is_refused_under_a_pipeline():
    from types import SimpleNamespace

    from finetune.parallel.pipeline import Pipeline
    from finetune.parallel.room import Room
    from finetune.trainer import Trainer

    class Custom(Trainer):
        def compute_loss(self, model, batch):
            return super().compute_loss(model, batch)

    main = SimpleNamespace(is_main_process=False)
    stages = SimpleNamespace(objective=None, accelerator=main)
    with pytest.raises(ConfigError, match="Custom overrides compute_loss, which a pipeline cannot call"):
        Pipeline.fit_objective(stages, Custom, Trainer.compute_loss, "loss")  # type: ignore[arg-type]
    Pipeline.fit_objective(stages, Trainer, Trainer.compute_loss, "loss")  # type: ignore[arg-type]  # the trainer's own: runs
    assert stages.objective == "loss"
    Room.fit_objective(SimpleNamespace(), Custom, Trainer.compute_loss, "loss")  # type: ignore[arg-type]  # no pipeline: runs


def test_a_stage_reads_only_its_own_weights(tmp_path, checkpoint_reads):
    # The tensors the loader materializes from the checkpoint, per stage: the other stages' layers are
    # never read (safetensors slices are lazy until indexed), and their LoRA waits on the meta device.
    from finetune.model.load import load_model

    build_tiny_llama(tmp_path, vocab_size=64, layers=4)
    read = checkpoint_reads
    recipe = {
        "model": {"path": str(tmp_path)},
        "data": {"path": "d.jsonl"},
        "output_dir": "o",
        "precision": "fp32",
        "lora": {"r": 4},
    }
    cfg = build_recipe(recipe)
    for rank, layers in ((0, {"0", "1"}), (1, {"2", "3"})):
        read.clear()
        place = stage_placement(Layout(2, 1, rank), 4, False, torch.device("cpu"))
        model = load_model(cfg, "fp32", torch.device("cpu"), placement=place)
        assert {k.split(".")[2] for k in read if k.startswith("model.layers.")} == layers
        assert ("model.embed_tokens.weight" in read) == (rank == 0) and ("lm_head.weight" in read) == (rank == 1)
        held = {n.split(".")[4] for n, p in model.named_parameters() if p.requires_grad and not p.is_meta}
        assert held == layers


def test_packed_rows_keep_their_segments_and_padding_is_one_more():
    row = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "labels": torch.tensor([[-100, 6, 7, -100, 9]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
    }
    short = {k: v[:, :3] for k, v in row.items()}
    w = pad_window([row, short], longest=7)
    assert "attention_mask" not in w  # packed rows: the model finds the examples from the positions
    assert w["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 0, 1, 2, 3]]
    assert w["labels"][1].tolist() == [-100, 6, 7] + [IGNORE_INDEX] * 4


def test_the_cli_refuses_a_launch_that_cannot_split_once_before_torchrun(monkeypatch, tmp_path, capsys):
    from finetune.cli import commands

    monkeypatch.setattr(commands, "run_launcher", lambda *a, **k: pytest.fail("torchrun was started"))
    args = [
        "run",
        "demo-cpu",
        "--nproc",
        "3",
        "distributed.pipeline_parallel=2",
        "train.grad_accum=2",
        f"output_dir={tmp_path / 'r'}",
    ]
    assert commands.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("distributed.pipeline_parallel=2 on 3 processes: the processes must be stages x replicas") == 1


def test_a_tied_head_is_loaded_on_the_last_stage_with_the_embeddings_weights(tmp_path):
    # Tied models (small Llama-3.2 and Qwen2.5) share one table: the last stage reads it for its head.
    from safetensors.torch import load_file

    from finetune.model.load import load_model

    build_tiny_llama(tmp_path, vocab_size=64, layers=4, tied=True)
    table = load_file(str(tmp_path / "model.safetensors"))["model.embed_tokens.weight"]
    cfg = build_recipe(
        {"model": {"path": str(tmp_path)}, "data": {"path": "d.jsonl"}, "output_dir": "o", "precision": "fp32", "lora": {"r": 4}}
    )
    last = load_model(cfg, "fp32", torch.device("cpu"), placement=stage_placement(Layout(2, 1, 1), 4, True, torch.device("cpu")))
    head = last.base_model.model.lm_head.weight
    assert not head.is_meta and torch.equal(head, table)
    assert stage_placement(Layout(2, 1, 0), 4, True, torch.device("cpu"))["lm_head"] == "meta"  # the first: no head


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stages_loaded_apart_in_4_bit_give_the_whole_models_loss_and_lora_gradients(tmp_path, device):
    # Each rank loads its stage alone (the others' modules on meta, never read), quantizes it to NF4 and
    # draws its LoRA as one process would: run one after the other they are the whole 4-bit model. On
    # CUDA (gpu): the meta device_map beside bitsandbytes' CUDA quantization, which the CPU never runs.
    from finetune.model.load import load_model

    build_tiny_llama(tmp_path, vocab_size=64, layers=4)
    recipe = {"model": {"path": str(tmp_path)}, "data": {"path": "d.jsonl"}, "output_dir": "o", "precision": "fp32"}
    cfg = build_recipe({**recipe, "lora": {"r": 4, "dropout": 0.0}})  # B's gradient would see each run's dropout mask
    on = torch.device(device)

    def load(placement=None):
        torch.manual_seed(cfg.seed)  # as the trainer does before loading: every rank draws the same LoRA
        return load_model(cfg, "fp32", on, placement=placement)

    whole = load()
    parts = [load(stage_placement(Layout(2, 1, r), 4, False, on)) for r in (0, 1)]
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in whole.modules()) == 4 * 7  # every decoder linear
    for part, held in zip(parts, ((0, 1), (2, 3))):
        layers = part.base_model.model.model.layers
        assert sum(isinstance(m, bnb.nn.Linear4bit) for i in held for m in layers[i].modules()) == 2 * 7
        assert all(p.device.type == on.type for i in held for p in layers[i].parameters())
        assert all(p.is_meta for i in set(range(4)) - set(held) for p in layers[i].parameters())
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (2, 12), device=on)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    loss = CausalLMLoss()
    want, n = loss(whole, batch)
    want.backward()
    w = pad_window([{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)], longest=256)
    first = Stage(parts[0].base_model.model.model, 0, 2, True, False)
    last = Stage(parts[1].base_model.model.model, 2, 4, False, True)
    hidden = first(w["input_ids"], w["attention_mask"], w["position_ids"])
    got, m = loss.head_loss(parts[1].base_model.model, last(hidden, w["attention_mask"], w["position_ids"]), w["labels"])
    assert m == n == 2 * 11
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    got.backward()
    grads = {k: p.grad for k, p in whole.named_parameters() if p.grad is not None}
    for part, held in zip(parts, ((0, 1), (2, 3))):
        mine = {k: p.grad for k, p in part.named_parameters() if p.grad is not None}
        assert {k.split(".")[4] for k in mine} == {str(i) for i in held}
        for k, g in mine.items():
            torch.testing.assert_close(g, grads[k], rtol=1e-4, atol=1e-4)  # of entries up to ~7
