"""Tensor parallelism without processes: which tensors split along which dimension, the config a rank
builds, the rank grid, what a recipe or a launch cannot split, and a rank's share read from the
checkpoint (no other bytes). The multi-process runs: tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama
from test_config import MINIMAL, problems_of

from finetune.declarations.layout import Layout
from finetune.model.partial import Split
from finetune.parallel.tensor import narrowed, problems, split_dim

L = "base_model.model.model.layers.3"


@pytest.mark.parametrize(
    "name, dim",
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),  # column-parallel: its heads' rows
        ("model.layers.0.self_attn.k_proj.bias", 0),  # Qwen2's biases go with the rows
        ("model.layers.0.self_attn.o_proj.weight", 1),  # row-parallel: its heads' columns
        ("model.layers.0.mlp.gate_proj.weight", 0),
        ("model.layers.0.mlp.down_proj.weight", 1),
        ("model.layers.0.input_layernorm.weight", None),  # norms, embeddings, head: whole
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
        (f"{L}.self_attn.q_proj.lora_A.default.weight", None),  # column: A reads the whole input
        (f"{L}.self_attn.q_proj.lora_B.default.weight", 0),
        (f"{L}.mlp.down_proj.lora_A.default.weight", 1),  # row: A reads the rank's share
        (f"{L}.mlp.down_proj.lora_B.weight", None),  # (as an adapter file names it) B writes the whole output
        (f"{L}.self_attn.q_proj.base_layer.weight", 0),
    ],
)
def test_each_tensor_splits_along_megatrons_dimension(name, dim):
    assert split_dim(name) == dim


def test_a_rank_builds_its_share_of_heads_and_mlp_with_the_head_dim_kept():
    from transformers import LlamaConfig

    whole = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    mine = narrowed(whole, 2)
    assert (mine.num_attention_heads, mine.num_key_value_heads, mine.intermediate_size, mine.head_dim) == (2, 1, 128, 32)
    assert whole.num_attention_heads == 4  # the whole config untouched
    assert problems(whole, 2) == []
    (said,) = problems(whole, 4)  # 2 key/value heads do not split into 4
    assert "the model's 2 key/value heads do not split into 4; values that split heads, key/value heads and the MLP: 2" in said


def test_ranks_are_numbered_tensor_parallel_innermost():
    grid = [Layout(1, 2, r, tp=2) for r in range(4)]
    assert [(x.replica, x.tp_rank) for x in grid] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert grid[3].copies == "2 replicas of 2 tensor-parallel ranks"


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"distributed": {"tensor_parallel": 2, "strategy": "fsdp"}}, "it does not shard them"),
        ({"distributed": {"tensor_parallel": 2}, "lora": {"method": "dora"}}, "lora.method=dora is not split yet"),
        ({"distributed": {"tensor_parallel": 2}, "memory": {"base_weights": "disk"}}, "memory.base_weights=device or cpu"),
        ({"distributed": {"tensor_parallel": 2}, "memory": {"embeddings": "cpu"}}, "memory.embeddings=device"),
        ({"distributed": {"tensor_parallel": 2}, "memory": {"optimizer_offload": True}}, "memory.optimizer_offload=false"),
        ({"distributed": {"tensor_parallel": 2}, "precision": "fp16"}, "decide each rank's skip alone"),
    ],
)
def test_a_recipe_tensor_parallelism_cannot_run_is_refused_naming_the_fix(extra, says):
    assert any(says in p for p in problems_of({**MINIMAL, **extra}))


def test_a_launch_that_cannot_split_is_refused_before_loading(tmp_path):
    from finetune.config.schema import build_recipe
    from finetune.parallel.split_checks import split_problems

    build_tiny_llama(tmp_path, vocab_size=64, hidden=128)  # 4 heads, 2 key/value heads
    cfg = build_recipe({**MINIMAL, "model": {"path": str(tmp_path)}, "distributed": {"tensor_parallel": 4}})
    said = split_problems(cfg, 6)
    assert any("on 6 processes: the processes must be tensor-parallel ranks x replicas" in p for p in said)
    assert any("2 key/value heads do not split into 4" in p for p in said)
    staged = build_recipe(
        {
            **MINIMAL,
            "model": {"path": str(tmp_path)},
            "distributed": {"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_schedule": "gpipe"},
        }
    )
    said = split_problems(staged, 6)
    assert said == [
        "distributed.pipeline_parallel=2 x distributed.tensor_parallel=2 on 6 processes: the processes must be stages x "
        "tensor-parallel ranks x replicas. Launch with --nproc 4 or a multiple of it (4, 8, ...)."
    ]
    assert split_problems(staged, 8) == []


def test_a_split_stage_reads_only_its_share_of_its_own_layers(tmp_path, checkpoint_reads):
    # pipeline x tensor parallelism: stage 1's second tensor-parallel rank (rank 3 of 2 x 2) reads its half of
    # layer 1's split weights, layer 1's norms and the head whole, and nothing of layer 0 or the embeddings.
    from transformers import AutoConfig

    from finetune.config.schema import build_recipe
    from finetune.model.load import load_model
    from finetune.parallel.stages import stage_placement

    build_tiny_llama(tmp_path, vocab_size=64, hidden=128)
    layout = Layout(2, 1, 3, tp=2)
    assert (layout.stage, layout.tp_rank, layout.pipeline_ranks(0), layout.tensor_ranks(1)) == (1, 1, [1, 3], [2, 3])
    cfg = build_recipe({**MINIMAL, "model": {"path": str(tmp_path)}, "precision": "fp32", "lora": {"r": 4}})
    place = stage_placement(layout, 2, False, torch.device("cpu"))
    split = Split(split_dim, 1, 2, narrowed(AutoConfig.from_pretrained(tmp_path), 2))
    model = load_model(cfg, "fp32", torch.device("cpu"), placement=place, split=split)
    assert {k.split(".")[2] for k in checkpoint_reads if k.startswith("model.layers.")} == {"1"}
    assert "model.embed_tokens.weight" not in checkpoint_reads and checkpoint_reads["lm_head.weight"] == (64, 128)
    assert checkpoint_reads["model.layers.1.self_attn.q_proj.weight"] == (64, 128)
    assert checkpoint_reads["model.layers.1.mlp.down_proj.weight"] == (128, 128)
    layer0 = model.get_base_model().model.layers[0].self_attn.q_proj
    assert layer0.weight.is_meta and tuple(layer0.weight.shape)[0] * 2 == 128  # another stage's share, never read


def test_a_rank_reads_only_its_share_of_each_split_weight(tmp_path, checkpoint_reads):
    # What the loader materializes per rank: the split weights' slices only; quantized from them.
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from finetune.config.schema import build_recipe
    from finetune.model.load import load_base_model

    build_tiny_llama(tmp_path, vocab_size=64, hidden=128)
    whole = load_file(str(tmp_path / "model.safetensors"))
    read = checkpoint_reads
    cfg = build_recipe({**MINIMAL, "model": {"path": str(tmp_path)}, "precision": "fp32", "quant": {"bits": None}})
    conf = narrowed(AutoConfig.from_pretrained(tmp_path), 2)
    model = load_base_model(cfg, "fp32", torch.device("cpu"), split=Split(split_dim, 1, 2, conf))
    assert read["model.layers.0.self_attn.q_proj.weight"] == (64, 128)  # 2 of 4 heads x 32
    assert read["model.layers.0.self_attn.o_proj.weight"] == (128, 64)
    assert read["model.layers.0.mlp.down_proj.weight"] == (128, 128)
    assert read["model.embed_tokens.weight"] == (64, 128)  # whole
    q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, whole["model.layers.0.self_attn.q_proj.weight"][64:])  # rank 1: the second half
    down = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(down, whole["model.layers.1.mlp.down_proj.weight"][:, 128:])


def test_a_tensor_parallel_plan_counts_its_replicas_not_its_ranks(tmp_path):
    from finetune.config.schema import build_recipe
    from finetune.gpus import find_gpu
    from finetune.plan import plan_recipe

    build_tiny_llama(tmp_path, vocab_size=64, hidden=128)
    recipe = {**MINIMAL, "model": {"path": str(tmp_path)}, "train": {"batch_size": 2, "grad_accum": 3}}
    split = plan_recipe(build_recipe({**recipe, "distributed": {"tensor_parallel": 2}}), find_gpu("rtx4090"), gpus=4)
    assert split.setup.global_batch == 2 * 3 * 2  # 4 processes = 2 replicas of 2 ranks
    assert split.notes[0].startswith("tensor parallel: 2 ranks x 2 replicas; each rank holds 1/2 of every decoder linear")


def test_only_the_whole_lora_tensors_a_share_adds_to_are_summed_over_the_group():
    from finetune.parallel.tensor import partial_gradient

    assert partial_gradient(f"{L}.self_attn.q_proj.lora_A.default.weight")  # every rank's rows feed its input gradient
    assert partial_gradient(f"{L}.mlp.down_proj.lora_B.default.weight")  # every rank adds to its output
    assert not partial_gradient(f"{L}.self_attn.q_proj.lora_B.default.weight")  # split: each rank its own rows
    assert not partial_gradient("base_model.model.lm_head.lora_A.default.weight")  # whole computation on every rank


def test_a_ranks_planned_weights_are_what_its_loaded_share_holds_and_the_step_adds_its_all_reduces(tmp_path):
    # The real loader, rank 1 of 2 of a 4-bit Llama (hidden 256): the bytes of every parameter it holds and of
    # its quantization constants against the planner's weight terms for that rank.
    from dataclasses import replace

    from transformers import AutoConfig

    from finetune.config.schema import build_recipe
    from finetune.declarations.strategies import DDP
    from finetune.gpus import find_gpu
    from finetune.model.load import load_model
    from finetune.plan import plan_recipe
    from finetune.plan.memory import estimate
    from finetune.plan.recipe import planning_inputs, setup_of
    from finetune.plan.stages import tensor_rank_shape

    build_tiny_llama(tmp_path, vocab_size=256, hidden=256, layers=2)
    recipe = {**MINIMAL, "model": {"path": str(tmp_path)}, "precision": "fp32", "lora": {"r": 8}}
    cfg = build_recipe({**recipe, "distributed": {"tensor_parallel": 2}})
    conf = narrowed(AutoConfig.from_pretrained(tmp_path), 2)
    model = load_model(cfg, "fp32", torch.device("cpu"), split=Split(split_dim, 1, 2, conf))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    constants = sum(
        m.weight.quant_state.absmax.numel() * m.weight.quant_state.absmax.element_size()
        + m.weight.quant_state.state2.absmax.numel() * 4
        for m in model.modules()
        if getattr(getattr(m, "weight", None), "quant_state", None) is not None
    )
    shape, facts, kw = planning_inputs(cfg, None)
    one = replace(setup_of(cfg, 2), gpus=1, sharding=DDP.name, tp=1)
    planned = estimate(tensor_rank_shape(shape, 2), facts, one, None, **kw)
    terms = ("weights_quantized", "quant_constants", "weights_unquantized", "lora_weights")
    assert held + constants == pytest.approx(sum(planned.component(k) for k in terms), rel=0.01)
    # The step: 2 all-reduces per layer, forward, backward and the checkpointed recompute, of a micro-batch's
    # hidden states, 2 (N - 1) / N of them each way on the GPU link.
    gpu = find_gpu("rtx4090")
    e = plan_recipe(cfg, gpu, gpus=2)
    s = e.setup
    hidden_states = s.rows * s.seq_len * 256 * 4
    ring = 2 * (1 / 2) * hidden_states / (gpu.interconnect_gbps * 1e9 * 0.8)
    assert e.step_time_parts["tensor_allreduce"] == pytest.approx(2 * 2 * 3 * ring * s.grad_accum, rel=1e-9)
    assert "12 all-reduces of" in e.notes[0] and e.setup.global_batch == s.batch_size * s.grad_accum


def test_a_split_stages_planned_weights_are_what_its_loaded_share_holds(tmp_path):
    # pipeline x tensor parallelism: the planner's rank for stage 1 of 2 x 2 against the real loader's rank 3
    # (its half of layers 2-3's linears, the norm and head whole); the step adds its own layers' all-reduces.
    from transformers import AutoConfig

    from finetune.config.schema import build_recipe
    from finetune.gpus import find_gpu
    from finetune.model.load import load_model
    from finetune.parallel.stages import stage_placement
    from finetune.parallel.tensor import cut_shares_from_whole
    from finetune.plan import plan_recipe
    from finetune.plan.recipe import planning_inputs, setup_of
    from finetune.plan.stages import _ranks

    build_tiny_llama(tmp_path, vocab_size=256, hidden=256, layers=4)
    distributed = {"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_schedule": "gpipe"}
    cfg = build_recipe(
        {**MINIMAL, "model": {"path": str(tmp_path)}, "precision": "fp32", "lora": {"r": 8}, "distributed": distributed}
    )
    split = Split(split_dim, 1, 2, narrowed(AutoConfig.from_pretrained(tmp_path), 2))
    place = stage_placement(Layout(2, 1, 3, tp=2), 4, False, torch.device("cpu"))
    model = load_model(cfg, "fp32", torch.device("cpu"), placement=place, split=split)
    cut_shares_from_whole(model, cfg, 2, 1)  # as TensorParallel.loaded: the row shares' absmax in fp32
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    states = {
        id(m.weight): m.weight.quant_state
        for m in model.modules()
        if getattr(getattr(m, "weight", None), "quant_state", None) is not None and not m.weight.is_meta
    }
    # each weight once (peft's wrapper answers .weight with its base layer's); double quant: its groups' scales, its
    # 256-entry code table and offset (the planner's quantized_bytes counts them)
    nested = [q for q in states.values() if q.nested]
    constants = sum(q.absmax.numel() * q.absmax.element_size() for q in states.values())
    constants += sum(q.state2.absmax.numel() * 4 + q.state2.code.numel() * 4 + 4 for q in nested)
    shape, facts, kw = planning_inputs(cfg, None)
    layout, planned, _ = _ranks(shape, facts, setup_of(cfg, 4), None, **kw)[1]
    assert (layout.stage, layout.tp) == (1, 2)
    terms = ("weights_quantized", "quant_constants", "weights_unquantized", "lora_weights")
    assert held + constants == pytest.approx(sum(planned.component(k) for k in terms), rel=0.01)
    gpu = find_gpu("rtx4090")
    e = plan_recipe(cfg, gpu, gpus=4)
    s = e.setup
    ring = 2 * (1 / 2) * s.rows * s.seq_len * 256 * 4 / (gpu.interconnect_gbps * 1e9 * 0.8)
    assert e.step_time_parts["tensor_allreduce"] == pytest.approx(2 * 2 * 3 * ring * s.grad_accum, rel=1e-9)  # 2 layers each
    assert "pipeline: 2 stages x 2 tensor-parallel ranks" in e.notes[2] and s.global_batch == s.batch_size * s.grad_accum


def test_a_layout_refuses_the_fp16_that_precision_auto_chose_at_launch():
    # (the recipe rules refuse precision=fp16; auto picks fp16 only on a GPU without bf16, known at launch)
    from types import SimpleNamespace

    from finetune.errors import ConfigError
    from finetune.parallel.pipeline import Pipeline
    from finetune.parallel.tensor import TensorParallel

    both = SimpleNamespace(distributed=SimpleNamespace(pipeline_parallel=2, tensor_parallel=2))
    with pytest.raises(
        ConfigError, match="pipeline_parallel=2 x distributed.tensor_parallel=2 with fp16: each rank's GradScaler"
    ):
        Pipeline.shard(SimpleNamespace(cfg=both), None, torch.float16)  # type: ignore[arg-type]  # before any model
    split = SimpleNamespace(distributed=SimpleNamespace(pipeline_parallel=1, tensor_parallel=2))
    with pytest.raises(ConfigError, match=r"- distributed.tensor_parallel=2 with fp16"):
        TensorParallel.shard(SimpleNamespace(cfg=split), None, torch.float16)  # type: ignore[arg-type]


def test_a_ranks_4bit_share_is_one_process_quantization_bit_for_bit(tmp_path):
    # NF4 with double quant, as the recipes quantize: each rank's share, cut from the whole weight's
    # quantization, dequantizes to exactly one process's values; quantized alone it does not (double quant's
    # offset is the mean of the whole tensor's absmax, and its groups of 256 blocks are the whole's).
    from bitsandbytes.functional import dequantize_4bit
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from finetune.config.schema import build_recipe
    from finetune.model.load import load_base_model
    from finetune.model.partial import Split
    from finetune.parallel.tensor import cut_shares_from_whole

    # hidden 256: every share whole blocks of 64, each column-parallel share (q, k, v, gate, up) also whole groups of
    # 256 blocks (k: 64 rows x 256 = 256 blocks), so it keeps double quant; o's and down's are strided over the rows.
    build_tiny_llama(tmp_path, vocab_size=64, hidden=256)
    cfg = build_recipe({**MINIMAL, "model": {"path": str(tmp_path)}, "precision": "fp32"})
    assert (cfg.quant.bits, cfg.quant.quant_type, cfg.quant.double_quant) == (4, "nf4", True)

    def dequantized(model) -> dict[str, torch.Tensor]:
        return {
            n.replace(".base_layer", ""): dequantize_4bit(m.weight.data, m.weight.quant_state)
            for n, m in model.named_modules()
            if type(getattr(m, "weight", None)).__name__ == "Params4bit" and split_dim(n + ".weight") is not None
        }

    one = dequantized(load_base_model(cfg, "fp32", torch.device("cpu")))
    conf, alone_differs = narrowed(AutoConfig.from_pretrained(tmp_path), 2), 0
    for rank in (0, 1):
        share = load_base_model(cfg, "fp32", torch.device("cpu"), split=Split(split_dim, rank, 2, conf))
        alone = dequantized(share)
        # As the trainer cuts: under peft's wrappers, whose .weight is their base layer's (each weight cut once).
        wrapped = get_peft_model(share, LoraConfig(r=4, target_modules="all-linear"))
        cut_shares_from_whole(wrapped, cfg, 2, rank)
        cut = dequantized(share)
        assert cut.keys() == one.keys() and len(cut) == 14  # 7 split linears x 2 layers
        kinds = {
            n.removesuffix(".base_layer").rsplit(".", 1)[-1]: m.weight.quant_state
            for n, m in share.named_modules()
            if type(getattr(m, "weight", None)).__name__ == "Params4bit"
        }
        assert {n for n, q in kinds.items() if q.nested} == {
            "q_proj",
            "k_proj",
            "v_proj",
            "gate_proj",
            "up_proj",
        }  # o, down: fp32
        for name, whole in one.items():
            dim = split_dim(name + ".weight")
            n = whole.shape[dim] // 2
            assert torch.equal(cut[name], whole.narrow(dim, rank * n, n)), name
            alone_differs += not torch.equal(alone[name], whole.narrow(dim, rank * n, n))
    assert alone_differs == 28  # every share quantized alone differs: what the cut mends
    # Without double quant a share of whole blocks quantizes alone as the whole does: TensorParallel reads nothing.
    single = build_recipe({**MINIMAL, "model": {"path": str(tmp_path)}, "precision": "fp32", "quant": {"double_quant": False}})
    one = dequantized(load_base_model(single, "fp32", torch.device("cpu")))
    alone = dequantized(load_base_model(single, "fp32", torch.device("cpu"), split=Split(split_dim, 1, 2, conf)))
    for name, whole in one.items():
        dim = split_dim(name + ".weight")
        assert torch.equal(alone[name], whole.narrow(dim, whole.shape[dim] // 2, whole.shape[dim] // 2)), name


def test_shares_that_straddle_4bit_blocks_are_said_before_loading_with_the_exact_degrees():
    from transformers import AutoConfig

    from finetune.model.partial import share_blocks
    from finetune.parallel.tensor import exactness_note

    demo = AutoConfig.from_pretrained(Path(__file__).parents[1] / "finetune" / "assets" / "tiny-llama")
    assert exactness_note(demo, 2) == (
        "note: distributed.tensor_parallel=2: the shares of o_proj (80 columns), down_proj (224 columns) are not whole "
        "64-element blocks of the whole weights' 4-bit quantization, so each rank quantizes its own and the base "
        "differs from one process's; tensor_parallel values exact for this model: none"
    )
    llama8b = AutoConfig.from_pretrained(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b")
    assert exactness_note(llama8b, 2) is None and exactness_note(llama8b, 8) is None
    # Golden blocks: rows split (one run) and columns split (a run in every row) of a (4, 256) weight.
    assert share_blocks((4, 256), 0, 1, 2, 64).tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert share_blocks((4, 256), 1, 1, 2, 64).tolist() == [2, 3, 6, 7, 10, 11, 14, 15]
    assert share_blocks((4, 160), 1, 0, 2, 64) is None  # 80 columns: a block straddles


def test_rows_padded_for_sequence_parallelism_train_and_count_what_they_did():
    from finetune.parallel.sequence import SPLIT_KEY, pad_rows

    batch = {
        "input_ids": torch.tensor([[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]]),
        "labels": torch.tensor([[-100, -100, 6, 7, 2], [-100, 8, 2, -100, -100]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    }
    out = pad_rows(batch, 2)
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 2, 0], [1, 8, 2, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, -100, 6, 7, 2, -100], [-100, 8, 2, -100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    assert int(out["num_tokens"]) == 8 and out[SPLIT_KEY] is True
    packed = {"input_ids": torch.tensor([[1, 5, 2, 1, 6, 7, 2]]), "labels": torch.tensor([[-100, 5, 2, -100, 6, 7, 2]])}
    packed |= {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]]), "num_tokens": torch.tensor(7)}
    out = pad_rows(packed, 4)  # positions go on from the last example's: after every real token, never attended
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]] and int(out["num_tokens"]) == 7
    assert pad_rows(batch, 5)["input_ids"] is batch["input_ids"]  # a multiple already: as it was


def test_sequence_parallelism_is_refused_where_it_does_not_split_yet():
    alone = problems_of({**MINIMAL, "distributed": {"sequence_parallel": True}})
    assert any("distributed.sequence_parallel=true splits the sequence between a tensor-parallel group" in p for p in alone)
    piped = {"tensor_parallel": 2, "pipeline_parallel": 2, "sequence_parallel": True}
    said = problems_of({**MINIMAL, "distributed": piped})
    assert any("sequence_parallel=true with distributed.pipeline_parallel=2: not yet" in p for p in said)
    from finetune.config.schema import build_recipe

    both = {"tensor_parallel": 2, "context_parallel": 2, "sequence_parallel": True}  # cp x tp x sp runs
    assert build_recipe({**MINIMAL, "distributed": both}).distributed.sequence_parallel

    assert build_recipe(
        {**MINIMAL, "distributed": {"tensor_parallel": 2, "sequence_parallel": True}}
    ).distributed.sequence_parallel
