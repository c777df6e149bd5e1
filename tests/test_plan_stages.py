"""The plan of a pipeline (finetune/plan/stages.py): what each rank holds, how many micro-batches of
activations it keeps, the bubble, and the CLI's report of it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_plan import CONFIGS

from finetune.cli.commands import main
from finetune.config.schema import load_recipe
from finetune.declarations.layout import Layout
from finetune.errors import PlanError
from finetune.gpus import find_gpu
from finetune.plan import plan_recipe
from finetune.plan.memory import estimate
from finetune.plan.recipe import planning_inputs, setup_of
from finetune.plan.shape import read_model_shape
from finetune.plan.stages import bubble_factor, held_micro_batches, rank_shape

RECIPE = "qlora-ddp-nx24gb"


def recipe(*overrides: str):
    return load_recipe(RECIPE, [f"model.path={CONFIGS / 'llama-3-70b'}", "data.path=d.jsonl", *overrides])


def test_each_rank_holds_its_layers_and_the_first_the_embeddings_the_last_the_head():
    whole = read_model_shape(str(CONFIGS / "llama-3-70b"))
    first, last = (rank_shape(whole, Layout(2, 1, r)) for r in (0, 1))
    assert (first.layers, last.layers) == (40, 40)
    assert first.embedding_params == whole.embedding_params and first.head_matmul_params == 0
    assert last.embedding_params == 0 and last.head_matmul_params == whole.head_params == 128_256 * 8192
    assert first.total_params + last.total_params == whole.total_params  # nothing counted twice or lost
    assert all(g.count * 2 == w.count for g, w in zip(first.linears, whole.linears))
    tied = replace(whole, tied_embeddings=True, head_params=0)  # Llama-3.2-1B, Qwen2.5-0.5B: one table
    t_first, t_last = (rank_shape(tied, Layout(2, 1, r)) for r in (0, 1))
    assert t_first.head_matmul_params == 0 and t_last.head_matmul_params == t_last.embedding_params == tied.embedding_params
    interleaved = rank_shape(whole, Layout(2, 1, 0, virtual_stages=2))  # stages 0 and 2: layers 0-19, 40-59
    assert interleaved.layers == 40 and interleaved.embedding_params and not interleaved.head_params


@pytest.mark.parametrize(
    "schedule, pp, v, m, held",
    [
        ("gpipe", 4, 1, 8, [8, 8, 8, 8]),  # every micro-batch's forward before any backward
        ("1f1b", 4, 1, 8, [4, 3, 2, 1]),  # rank r warms up P - 1 - r, then one forward per backward
        ("1f1b", 4, 1, 2, [2, 2, 2, 1]),  # never more than there are micro-batches
        ("interleaved_1f1b", 2, 2, 4, [2.5, 1.5]),  # (2 (P - 1 - r) + (V - 1) P + 1) chunks of 1/V of the layers
        ("interleaved_1f1b", 2, 2, 1, [1.0, 1.0]),  # capped at m x V chunks
        ("interleaved_1f1b", 4, 2, 6, [6.0, 5.5, 4.5, 3.5]),  # a round of 6 when m is no multiple of P (torch's)
        ("interleaved_1f1b", 4, 2, 2, [2.0, 2.0, 2.0, 1.5]),
    ],
)
def test_the_micro_batches_a_rank_holds_follow_its_schedule(schedule, pp, v, m, held):
    assert [held_micro_batches(schedule, Layout(pp, 1, r, v), m) for r in range(pp)] == held


def test_the_bubble_is_the_ideal_one_of_the_schedules():
    # (P - 1) / (V m + P - 1) of the step: the "ideal" column of benchmarks/README.md's bubble table
    for schedule, v, m, ideal in (("1f1b", 1, 8, 1 / 9), ("gpipe", 1, 4, 1 / 5), ("interleaved_1f1b", 2, 8, 1 / 17)):
        assert 1 - 1 / bubble_factor(schedule, 2, v, m) == pytest.approx(ideal, rel=1e-12)


def test_a_pipeline_plans_its_fullest_rank_and_the_step_with_its_bubble():
    cfg = recipe("distributed.pipeline_parallel=4", "train.grad_accum=8", "train.batch_size=1")
    gpu = find_gpu("rtx4090")
    e = plan_recipe(cfg, gpu, gpus=4)
    shape, facts, kw = planning_inputs(cfg, gpu)
    one = replace(setup_of(cfg, 4), gpus=1, pp=1)
    whole = estimate(shape, facts, one, gpu, **kw)
    assert e.component("weights_quantized") * 4 == whole.component("weights_quantized")  # a quarter of the layers
    # Rank 0 (embeddings, 4 micro-batches held) is the fullest; its 20 layers' checkpointed inputs x 4.
    rank0 = estimate(rank_shape(shape, Layout(4, 1, 0)), facts, one, gpu, held=4, **kw)
    assert e.peak_bytes == rank0.peak_bytes and e.component("activations") == rank0.component("activations")
    per_layer_input = 2048 * 8192 * 2  # batch 1 x seq 2048 x hidden 8192, bf16
    rope = 2 * 2048 * 128 * 2
    assert rank0.component("activations") == 4 * (20 * per_layer_input + rope)
    assert e.component("logits_loss") == 0  # rank 0 has no head: only the last rank computes the loss
    assert "pipeline rank 3: layers 60-79 + norm + head + loss" in e.notes[3]
    assert "the bubble is 27% of the step" in e.notes[4]  # 3 / 11
    p = e.step_time_parts
    busy = p["compute"] + p["dequantize"] + p["host_transfer_exposed"]
    assert p["pipeline_bubble"] == pytest.approx(busy * 3 / 8, rel=1e-9)
    assert e.step_time_s == pytest.approx(busy + p["pipeline_bubble"] + p["pipeline_p2p"] + p["communication"] + p["optimizer"])
    assert e.tokens_per_step == 8 * 2048  # one replica: the stages share the micro-batches
    assert e.host_ram_bytes == 4 * whole.host_ram_bytes  # each process: the libraries and one weight shard at a time


def test_plan_prints_every_rank_and_compares_the_pipeline_with_the_other_strategies(capsys):
    model = f"model.path={CONFIGS / 'llama-3-70b'}"
    staged = ["distributed.pipeline_parallel=4", "train.grad_accum=4"]
    assert main(["plan", RECIPE, model, *staged, "--gpu", "rtx4090", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "setup      4 GPUs (pipeline: 4 stages x 1 replica, 1f1b)" in out
    assert out.count("note       pipeline rank") == 4
    table = out.split("strategies on 4 GPUs")[1]
    assert "pipeline 4 stages (as written)" in table
    # the other layouts of 4 GPUs beside DDP/FSDP/ZeRO (80 layers: 2 or 4 stages; 64 heads, 8 key/value heads)
    for other in ("pipeline 2 stages x 2 replicas", "pipeline 2 stages x 2 tensor-parallel ranks", "4 tensor-parallel ranks"):
        assert f"\n  {other} " in table, other


def test_fit_searches_pipelines_and_tensor_parallel_layouts_and_writes_the_one_it_picks(tmp_path):
    # Llama-3-70B on 4 x RTX 4090 with 64 GB of host RAM: no replica fits a card and FSDP's load of the whole
    # model per process needs 177 GiB of RAM, so the fastest setup that fits is a layout; the recipe written
    # runs it.
    from finetune.config.schema import build_recipe, read_recipe_file
    from finetune.plan import fit
    from finetune.plan.rewrite import write_fitted_recipe

    gpu, cfg = find_gpu("rtx4090"), recipe()
    current, best = fit(cfg, gpu, max_gpus=4, host_ram=64 * 2**30)
    s = best.setup
    assert not current.fits and (s.gpus, s.pp, s.tp) == (4, 4, 1), s  # README's "Why"
    assert s.global_batch == current.setup.global_batch and best.peak_bytes <= 0.9 * gpu.memory_bytes
    source = tmp_path / "ddp.yaml"
    source.write_text((Path(__file__).parents[1] / "recipes" / f"{RECIPE}.yaml").read_text())
    fitted = write_fitted_recipe(source, tmp_path / "fit.yaml", {"model.path": str(CONFIGS / "llama-3-70b")}, current, best, "t")
    written = build_recipe(read_recipe_file(fitted.path), str(fitted.path)).distributed
    assert (written.pipeline_parallel, written.tensor_parallel, written.pipeline_schedule) == (
        s.pp,
        s.tp,
        s.pipeline_schedule,
    )
    assert fitted.command.endswith("--nproc 4")
    # 2 nodes x 2 over 10 Gbit/s: 4 stages, one sender on the Ethernet (2 stages x 2 ranks send twice: both
    # ranks of a stage through the one link; README's "Why"), launched node by node; host RAM counted on the
    # fullest node (a 3-GPU setup would hold 2 of its 3 processes).
    from finetune.plan.fitting import node_ram

    nodes = replace(gpu, gpus_per_node=2, node_link_gbps=10 / 8)
    _, far = fit(cfg, nodes, max_gpus=4, host_ram=64 * 2**30)
    assert (far.setup.pp, far.setup.tp) == (4, 1), far.setup
    spread = write_fitted_recipe(source, tmp_path / "far.yaml", {"model.path": str(CONFIGS / "llama-3-70b")}, current, far, "t")
    assert "--nproc 2 --nnodes 2 --node-rank R" in spread.command
    assert node_ram(far, nodes) == pytest.approx(far.host_ram_bytes / 2)
    three = replace(far, setup=replace(far.setup, gpus=3))
    assert node_ram(three, nodes) == pytest.approx(far.host_ram_bytes * 2 / 3)


def test_across_two_nodes_only_what_crosses_them_pays_the_nodes_link():
    # 2 nodes x 2 RTX 4090 over 10 Gbit/s: a pipeline of 2 stages x 2 tensor-parallel ranks puts a stage on each
    # node: its all-reduces stay on PCIe, its sends cross the Ethernet; 4 tensor-parallel ranks span the nodes.
    from finetune.plan.recipe import plan_recipe as plan

    one_node, two = find_gpu("rtx4090"), replace(find_gpu("rtx4090"), gpus_per_node=2, node_link_gbps=10 / 8)
    assert (two.link_gbps([0, 1]), two.link_gbps([1, 2]), one_node.link_gbps([1, 2])) == (25.0, 1.25, 25.0)
    staged = recipe(
        "distributed.pipeline_parallel=2", "distributed.tensor_parallel=2", "train.batch_size=1", "train.grad_accum=16"
    )
    near, far = plan(staged, one_node, gpus=4).step_time_parts, plan(staged, two, gpus=4).step_time_parts
    assert far["tensor_allreduce"] == pytest.approx(near["tensor_allreduce"], rel=1e-9)
    # Both tensor-parallel ranks of a stage send their whole hidden states through the one Ethernet link between
    # the nodes; on one node each pair of GPUs has its own.
    assert far["pipeline_p2p"] == pytest.approx(near["pipeline_p2p"] * 25 / 1.25 * 2, rel=1e-9)
    split = recipe("distributed.tensor_parallel=4", "train.batch_size=1", "train.grad_accum=16")
    near, far = plan(split, one_node, gpus=4).step_time_parts, plan(split, two, gpus=4).step_time_parts
    assert far["tensor_allreduce"] == pytest.approx(near["tensor_allreduce"] * 25 / 1.25, rel=1e-9)
    replicas = recipe("train.batch_size=1", "train.grad_accum=16")  # DDP over 4 GPUs: its all-reduce spans the nodes
    near, far = plan(replicas, one_node, gpus=4).step_time_parts, plan(replicas, two, gpus=4).step_time_parts
    assert far["communication"] == pytest.approx(near["communication"] * 25 / 1.25, rel=1e-9)


def test_max_seq_plans_a_pipeline_on_the_gpus_one_replica_needs():
    from finetune.plan import longest_trainable_seq

    gpu = find_gpu("rtx4090")
    found = longest_trainable_seq(recipe("distributed.pipeline_parallel=4", "train.grad_accum=4"), gpu, max_gpus=4)
    assert found.as_written > 2048
    at = ("distributed.pipeline_parallel=4", "train.batch_size=1", "train.grad_accum=1", "distributed.pipeline_schedule=gpipe")
    for seq, fits in ((found.as_written, True), (found.as_written + 1, False)):
        e = plan_recipe(recipe(*at, f"data.max_seq_len={seq}"), gpu, 4)
        assert (e.peak_bytes <= 0.9 * gpu.memory_bytes) == fits, seq


def test_a_pipeline_that_cannot_split_the_model_is_refused_by_the_plan():
    with pytest.raises(PlanError, match="the stages must hold every layer"):
        plan_recipe(recipe("distributed.pipeline_parallel=3", "train.grad_accum=3"), find_gpu("rtx4090"), gpus=3)  # 80 layers


def test_a_ranks_planned_weights_are_what_its_loaded_stage_holds(tmp_path):
    # The real loader, a stage of a 4-layer 4-bit Llama (hidden 256): the bytes of every parameter it holds
    # (not on the meta device) and of its quantization constants, against the planner's weight terms.
    import torch
    from conftest import build_tiny_llama

    from finetune.config.schema import build_recipe
    from finetune.model.load import load_model
    from finetune.parallel.stages import stage_placement

    build_tiny_llama(tmp_path, vocab_size=512, hidden=256, layers=4)
    recipe = {"model": {"path": str(tmp_path)}, "data": {"path": "d.jsonl"}, "output_dir": "o", "precision": "fp32"}
    cfg = build_recipe({**recipe, "lora": {"r": 8}, "distributed": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}})
    shape, facts, kw = planning_inputs(cfg, None)
    one = replace(setup_of(cfg, 2), gpus=1, pp=1)
    for rank in (0, 1):
        planned = estimate(rank_shape(shape, Layout(2, 1, rank)), facts, one, None, **kw)
        place = stage_placement(Layout(2, 1, rank), 4, False, torch.device("cpu"))
        model = load_model(cfg, "fp32", torch.device("cpu"), placement=place)
        held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
        constants = sum(
            m.weight.quant_state.absmax.numel() * m.weight.quant_state.absmax.element_size()
            + m.weight.quant_state.state2.absmax.numel() * 4  # double quant's second-level constants
            for m in model.modules()
            if getattr(getattr(m, "weight", None), "quant_state", None) is not None and not m.weight.is_meta
        )
        terms = ("weights_quantized", "quant_constants", "weights_unquantized", "lora_weights")
        assert held + constants == pytest.approx(sum(planned.component(k) for k in terms), rel=0.01)


def test_uneven_stages_hold_the_layers_given_and_auto_balances_the_fullest_peak():
    assert [Layout(3, 1, 0, splits=(1, 3, 2)).layer_range(s, 6) for s in range(3)] == [(0, 1), (1, 4), (4, 6)]
    gpu = find_gpu("rtx4090")
    even = plan_recipe(
        load_recipe("qlora-pipeline-4x24gb", [f"model.path={CONFIGS / 'llama-3-70b'}", "data.path=d.jsonl"]), gpu, 4
    )
    auto = plan_recipe(
        load_recipe(
            "qlora-pipeline-4x24gb",
            [f"model.path={CONFIGS / 'llama-3-70b'}", "data.path=d.jsonl", "distributed.pipeline_layers=auto"],
        ),
        gpu,
        4,
    )
    # Rank 0 holds the embeddings (2 GiB) and 4 micro-batches: it gives layers to the ranks that hold fewer.
    assert auto.setup.pipeline_layers == (17, 21, 22, 20)
    assert auto.peak_bytes < even.peak_bytes - 1.5 * 2**30
    assert "pipeline rank 2: layers 38-59" in auto.notes[2]


@pytest.mark.parametrize(
    "layers, says",
    [
        ("[1,2,3]", "one count of at least 1 per stage (2 of them)"),
        ("[0,4]", "one count of at least 1 per stage"),
    ],
)
def test_a_layer_split_that_cannot_be_is_refused(layers, says):
    with pytest.raises(Exception, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(RECIPE, ["data.path=d.jsonl", "distributed.pipeline_parallel=2", f"distributed.pipeline_layers={layers}"])


def test_a_split_that_does_not_add_up_to_the_models_layers_is_refused_at_launch():
    from finetune.parallel.split_checks import split_problems

    cfg = recipe("distributed.pipeline_parallel=2", "distributed.pipeline_layers=[40,41]")
    (said,) = split_problems(cfg, 2)
    assert "adds up to 81 decoder layers, but the model has 80" in said
    assert (
        split_problems(recipe("distributed.pipeline_parallel=3", "train.grad_accum=3", "distributed.pipeline_layers=auto"), 3)
        == []
    )


def test_a_tensor_parallel_rank_keeps_its_row_shares_absmax_in_fp32():
    # model/partial.cut_from_whole: a column-parallel share of a real model is whole 256-block groups and keeps
    # double quant; a row-parallel share's blocks are strided over the rows, so its absmax is kept in fp32.
    from finetune.plan.stages import tensor_rank_shape
    from finetune.plan.terms import quantized_bytes

    cfg = recipe("distributed.pipeline_parallel=1", "distributed.tensor_parallel=2")
    e = plan_recipe(cfg, find_gpu("rtx4090"), gpus=2)
    share = tensor_rank_shape(read_model_shape(str(CONFIGS / "llama-3-70b")), 2)
    expected = 0
    for g in share.linears:
        double = g.name not in ("o_proj", "down_proj")
        expected += quantized_bytes(g.in_features * g.out_features, g.out_features, 4, double, 2)[1] * g.count
    assert e.component("quant_constants") == expected
    all_double = sum(
        quantized_bytes(g.in_features * g.out_features, g.out_features, 4, True, 2)[1] * g.count for g in share.linears
    )
    assert (
        0.5 * 2**30 < expected - all_double < 0.6 * 2**30
    )  # Llama-3-70B at tp2: o and down, 189M blocks a rank, 3 bytes more each


def test_layers_kept_on_the_gpu_stream_only_the_rest_and_a_share_that_fits_loads_there():
    # memory.device_layers under tensor parallelism: a rank's share of 50 of Llama-3-70B's 80 layers stays on the GPU,
    # of the other 30 it streams from host RAM; its whole share fits the card at load, so host RAM never holds it.
    from finetune.plan.stages import tensor_rank_shape
    from finetune.plan.terms import quantized_bytes

    tp2 = ("distributed.pipeline_parallel=1", "distributed.tensor_parallel=2", "memory.embeddings=device")
    device, kept = (
        plan_recipe(recipe(*tp2, *m), find_gpu("rtx4090"), gpus=2)
        for m in ((), ("memory.base_weights=cpu", "memory.device_layers=50"))
    )
    share = tensor_rank_shape(read_model_shape(str(CONFIGS / "llama-3-70b")), 2)
    per_layer = (
        sum(quantized_bytes(g.in_features * g.out_features, g.out_features, 4, True, 2)[0] * g.count for g in share.linears) / 80
    )
    assert device.component("weights_quantized") == pytest.approx(80 * per_layer, rel=1e-6)
    assert kept.component("weights_quantized") == pytest.approx(50 * per_layer, rel=1e-3)
    assert kept.component("weights_streamed") == pytest.approx(3 * per_layer, rel=1e-3)  # 3 streamed layers at once
    assert kept.host_ram_parts["streamed_weights"] >= 30 * per_layer  # pinned blocks: rounded up per weight
    assert kept.loads_on_gpu and kept.host_ram_parts["loading"] < 5 * 2**30  # one checkpoint shard
    # On a 12 GB card the whole share does not fit at load: it loads in host RAM, all of it
    small = plan_recipe(recipe(*tp2, "memory.base_weights=cpu", "memory.device_layers=50"), find_gpu("rtx3060"), gpus=2)
    assert not small.loads_on_gpu and small.host_ram_parts["loading"] > 80 * per_layer


def test_layers_kept_on_the_gpu_need_weights_that_stream():
    from test_config import MINIMAL, problems_of

    said = problems_of({**MINIMAL, "memory": {"device_layers": 4}})
    assert any("memory.device_layers=4 keeps that many of the streamed layers on the GPU" in p for p in said)
    said = problems_of({**MINIMAL, "distributed": {"tensor_parallel": 2}, "memory": {"base_weights": "disk"}})
    assert any("memory.base_weights=device or cpu" in p for p in said)


def test_fit_tries_stages_that_cannot_hold_equal_layers_and_interleaved_ones():
    # Llama-3-70B's 80 layers: 3 stages hold 26 + 27 + 27 (the first, with the embeddings and the most micro-batches
    # in flight, the fewest); 2 stages also run interleaved (2 virtual stages of 20 layers a rank, 16 micro-batches in
    # torch's rounds of 2). plan --fit writes the split it picks as pipeline_layers.
    from finetune.plan.fitting import candidates
    from finetune.plan.rewrite import setup_changes
    from finetune.plan.stages import plan_setup

    cfg = recipe()
    shape, facts, kw = planning_inputs(cfg, find_gpu("rtx4090"))
    base = setup_of(cfg)
    three = [s for s in candidates(base, 3, facts, layouts=((3, 1),), layers=80) if s.pp == 3]
    assert three and {s.pipeline_layers for s in three} == {(26, 27, 27)}
    e = plan_setup(shape, facts, three[0], find_gpu("rtx4090"), **kw)  # plans (an even split of 80 would be refused)
    assert "layers 0-25" in e.notes[0] and "layers 26-52" in e.notes[1]
    assert setup_changes(three[0], base, cfg)["distributed.pipeline_layers"] == [26, 27, 27]
    two = candidates(base, 2, facts, layouts=((2, 1),), layers=80)
    interleaved = [s for s in two if s.pipeline_schedule == "interleaved_1f1b"]
    assert interleaved and all(s.virtual_stages == 2 and s.pp == 2 and not s.pipeline_layers for s in interleaved)
    assert any(s.pipeline_schedule == "1f1b" for s in two)  # beside the plain one
    assert setup_changes(interleaved[0], base, cfg)["distributed.virtual_stages"] == 2


def test_fit_on_gpus_the_written_layout_does_not_divide_plans_it_on_fewer_and_searches_all():
    # qlora-pipeline-70b-2x24gb (2 stages) with 3 GPUs: as written on 2 of them, and the search's pick uses all 3
    # as 3 stages of 26 + 27 + 27 layers (it refused before: "the GPUs must be stages x replicas").
    from finetune.plan.fitting import fit

    cfg = load_recipe("qlora-pipeline-70b-2x24gb", [f"model.path={CONFIGS / 'llama-3-70b'}", "data.path=d.jsonl"])
    current, best = fit(cfg, find_gpu("rtx4090"), max_gpus=3, host_ram=64 * 2**30)
    assert (current.setup.gpus, current.setup.pp) == (2, 2)
    assert (best.setup.gpus, best.setup.pp, best.setup.pipeline_layers) == (3, 3, (26, 27, 27))


def test_plan_on_gpus_whose_count_the_layers_do_not_divide_compares_uneven_stages():
    # `finetune plan demo-cpu --gpus 3`: 4 layers over 3 stages as 1 + 1 + 2 (it raised "the stages must hold every
    # layer"); --fit's interleaved pick writes pipeline_layers=even beside virtual stages (auto would be refused).
    from finetune.plan.fitting import candidates
    from finetune.plan.recipe import compare_strategies
    from finetune.plan.rewrite import setup_changes

    rows = dict(compare_strategies(load_recipe("demo-cpu"), find_gpu("rtx4090"), 3))
    assert rows["pipeline 3 stages"].setup.pipeline_layers == (1, 1, 2)
    cfg = load_recipe("qlora-pipeline-70b-2x24gb", [f"model.path={CONFIGS / 'llama-3-70b'}", "data.path=d.jsonl"])
    assert cfg.distributed.pipeline_layers == "auto"
    shape, facts, _ = planning_inputs(cfg, find_gpu("rtx4090"))
    four = [s for s in candidates(setup_of(cfg), 4, facts, layouts=((4, 1),), layers=80) if s.virtual_stages == 2]
    changes = setup_changes(four[0], setup_of(cfg), cfg)
    assert changes["distributed.pipeline_layers"] == "even" and changes["distributed.virtual_stages"] == 2
    load_recipe(
        "qlora-pipeline-70b-2x24gb",
        [f"model.path={CONFIGS / 'llama-3-70b'}", "data.path=d.jsonl"] + [f"{k}={v}" for k, v in changes.items()],
    )  # the rules accept it
