"""The plan of context parallelism (finetune/plan/context.py): each rank's part of every sequence, the ring's
or Ulysses' buffers and traffic, the longest sequence over several GPUs, and the shipped recipe."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_plan import CONFIGS

import finetune.plan.context as context
from finetune.cli.commands import main
from finetune.config.schema import load_recipe
from finetune.errors import PlanError
from finetune.gpus import find_gpu
from finetune.plan import longest_trainable_seq, plan_recipe
from finetune.plan.context import rank_tokens
from finetune.plan.fitting import FIT_HEADROOM, longest_fitting_seq
from finetune.plan.inputs import describe_setup
from finetune.plan.recipe import planning_inputs, setup_of

RECIPE = Path(__file__).parents[1] / "recipes" / "qlora-longctx-2x24gb.yaml"
GPU = find_gpu("rtx4090")
# Llama-3.1-8B: 32 layers, hidden 4096, 32 heads x 128, 8 K/V heads; bf16 on an RTX 4090
L, H, QD, KVD, HD, B = 32, 4096, 32 * 128, 8 * 128, 128, 2


def recipe(*overrides: str):
    return load_recipe(RECIPE, [f"model.path={CONFIGS / 'llama-3.1-8b'}", *overrides])


def test_a_rank_runs_two_of_2n_chunks_and_one_token_more():
    assert rank_tokens(65536, 2) == (32768, 32769)
    assert rank_tokens(65537, 2) == (32770, 32771)  # padded to a multiple of 2N = 4: 65540 / 2
    assert rank_tokens(100, 3) == (34, 35)  # 2 x ceil(100 / 6)


def test_each_rank_keeps_the_activations_of_its_part_and_the_whole_model():
    # No offload: a checkpointed layer keeps its input (local tokens x hidden, bf16), plus RoPE's cos and sin.
    plain = ("memory.activation_offload=false", "memory.base_weights=device", "data.max_seq_len=65536")
    split = plan_recipe(recipe(*plain), GPU, gpus=2)
    whole = plan_recipe(recipe(*plain, "distributed.context_parallel=1"), GPU, gpus=2)  # DDP, a sequence per GPU
    per_token = L * H * B + 2 * HD * B
    assert whole.component("activations") == 65536 * per_token
    assert split.component("activations") == 32769 * per_token
    assert whole.component("activations") - split.component("activations") == (65536 - 32769) * per_token
    assert split.component("final_norm") == 32769 * 4 * H  # the final norm's fp32 input: the part's tokens
    for key in ("weights_quantized", "quant_constants", "lora_weights", "optimizer_state", "ddp_buckets"):
        assert split.component(key) == whole.component(key) > 0, key  # every rank holds the model, as DDP's
    assert split.peak_bytes < whole.peak_bytes


def test_offloaded_inputs_in_host_ram_are_each_process_part():
    # activation_offload: 31 of 32 checkpointed inputs pinned per process, each a power-of-two block
    e = plan_recipe(recipe("data.max_seq_len=65536"), GPU, gpus=2)
    block = 1 << (32769 * H * B - 1).bit_length()  # 256 MiB + 8 KiB rounds up to 512 MiB
    assert e.host_ram_parts["activations"] == 31 * block == 31 * 512 * 2**20


def test_the_ring_buffers_are_in_the_peak_and_ulysses_holds_the_copies_it_sends():
    ring = plan_recipe(recipe("data.max_seq_len=65536"), GPU, gpus=2)
    # One ring per K/V head (parallel/ring.py): a group of 4 query heads and 1 K/V head at a time. Backward,
    # per token of the part: the group's fp32 dQ; its K/V in hand and arriving; the fp32 dK/dV accumulators
    # in hand and arriving; on a GPU a chunk pair's K/V repeated to the 4 heads (half the part), that pair's dQ
    # and repeated dK, dV from the kernel; the layer's fp32 log-sum-exp.
    qg, kg = 4 * HD, HD
    per_token = 4 * qg + 2 * 2 * kg * B + 2 * 2 * 4 * kg + qg * B + qg * B // 2 + qg * B + 4 * 32
    assert per_token == 7_808
    assert ring.component("context_buffers") == 32769 * per_token
    assert ring.peak_phase != "attention"  # one group's buffers: a layer's MLP backward weighs more
    uly = plan_recipe(recipe("data.max_seq_len=65536", "distributed.context_parallel_mode=ulysses"), GPU, gpus=2)
    assert uly.component("context_buffers") == 32769 * 2 * B * (2 * QD + 2 * KVD)  # q, k, v, out sent + received
    # 16 ranks: the 8 K/V heads do not divide, so Ulysses repeats them to the 32 query heads
    many = plan_recipe(
        recipe("data.max_seq_len=65536", "distributed.context_parallel=16", "distributed.context_parallel_mode=ulysses"),
        GPU,
        gpus=16,
    )
    assert many.component("context_buffers") == rank_tokens(65536, 16)[1] * 2 * B * 4 * QD


def test_ulysses_needs_heads_that_divide_and_the_gpus_must_hold_whole_groups():
    with pytest.raises(PlanError, match="32 attention heads do not divide over 3 ranks"):
        plan_recipe(recipe("distributed.context_parallel=3", "distributed.context_parallel_mode=ulysses"), GPU, gpus=3)
    with pytest.raises(PlanError, match="context-parallel ranks x replicas"):
        plan_recipe(recipe(), GPU, gpus=3)
    cfg = recipe("distributed.context_parallel_mode=ulysses")
    assert context.context_choices(cfg, plan_recipe(cfg, GPU, gpus=2).shape, 8) == (2, 4, 8)  # not 3, 5, 6, 7


def test_each_rank_computes_half_the_step_and_the_ring_hides_under_attention():
    local = ("memory.activation_offload=false", "memory.base_weights=device")
    one = plan_recipe(recipe("distributed.context_parallel=1", *local), GPU, gpus=1)
    two = plan_recipe(recipe(*local), GPU, gpus=2)
    # the same sequences, each half on each GPU: half the compute, attention over the whole span included
    assert two.step_time_parts["compute"] == pytest.approx(one.step_time_parts["compute"] / 2, rel=1e-4)
    # K/V of 131,070 tokens x 8 heads x 128 bf16: 0.54 GB per hop at 25 GB/s x 0.8 vs seconds of attention
    assert two.step_time_parts["context_traffic"] > 0 and two.step_time_parts["context_exposed"] == 0
    uly = plan_recipe(recipe(*local, "distributed.context_parallel_mode=ulysses"), GPU, gpus=2)
    a2a = (
        1 / 2 * 4 * rank_tokens(262_140, 2)[1] * B * (2 * QD + 2 * KVD) / (GPU.interconnect_gbps * 1e9 * 0.8) * L * (2 + 1)
    )  # 4 micro-batches
    assert uly.step_time_parts["context_exposed"] == pytest.approx(a2a, rel=1e-9)  # all-to-alls are not hidden
    assert uly.step_time_s - two.step_time_s == pytest.approx(a2a, rel=1e-6)


def test_max_seq_over_two_gpus_is_twice_one_card(monkeypatch):
    cfg = recipe("memory.base_weights=device")
    # one card of a 2-GPU DDP run (its all-reduce buckets too): the recipe without the split, batch 1
    ddp = recipe("memory.base_weights=device", "distributed.context_parallel=1")
    shape, facts, kw = planning_inputs(ddp, GPU)
    base = replace(setup_of(ddp, 2), batch_size=1, grad_accum=1)
    one_card = longest_fitting_seq(shape, facts, base, GPU, upper=1 << 20, **kw)
    two = longest_trainable_seq(cfg, GPU, max_gpus=2).as_written
    rings = context.buffer_bytes_per_token
    monkeypatch.setattr(context, "buffer_bytes_per_token", lambda *a: 0)  # a split without buffers
    unbuffered = longest_trainable_seq(cfg, GPU, max_gpus=2).as_written
    assert 2 * one_card - 6 <= unbuffered <= 2 * one_card  # each rank: one card's tokens (+1, padded to 4)
    assert two == unbuffered  # one K/V head group's buffers at a time: never the peak
    monkeypatch.setattr(context, "buffer_bytes_per_token", lambda *a: 16 * rings(*a))  # a ring of the whole layer's heads
    assert one_card < longest_trainable_seq(cfg, GPU, max_gpus=2).as_written < two  # such buffers would cost length


def test_the_recipe_fits_two_cards_and_plan_max_seq_says_how_long(capsys):
    e = plan_recipe(recipe(), GPU, gpus=2)
    assert e.setup.cp == 2 and e.setup.seq_len == 262_140
    assert e.peak_bytes <= (1 - FIT_HEADROOM) * GPU.memory_bytes
    args = ["plan", str(RECIPE), f"model.path={CONFIGS / 'llama-3.1-8b'}", "--gpu", "rtx4090", "--gpus", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "context parallel 2 ranks, ring (as written)" in out and "ring attention buffers" in out
    assert main([*args, "--max-seq"]) == 0
    out = capsys.readouterr().out
    longest = longest_trainable_seq(recipe(), GPU, max_gpus=2)
    assert f"as written      {longest.as_written:,} tokens" in out
    assert longest.best >= longest.as_written >= 330_000  # issue 28's target: twice one card's 167,478
    four = longest_trainable_seq(recipe(), GPU, max_gpus=4)  # the search splits over the 4 GPUs
    assert four.best_setup is not None and four.best_setup.cp == 4 and four.best >= 2 * longest.as_written


def test_cp_x_tp_plans_a_share_of_every_layer_over_a_part_of_every_sequence():
    # 4 GPUs as cp2 x tp2: a rank holds tp2's share of the layers (its weights, its LoRA) and runs cp2's part of
    # each sequence (its activations, the ring over the share's 16 heads); the tp all-reduces carry a part's
    # hidden states: half of tp2's at the whole sequence.
    device = ("memory.base_weights=device", "memory.embeddings=device", "memory.activation_offload=false")
    seq = ("data.max_seq_len=65536",)
    both = plan_recipe(recipe(*device, *seq, "distributed.tensor_parallel=2"), GPU, gpus=4)
    tp = plan_recipe(recipe(*device, *seq, "distributed.tensor_parallel=2", "distributed.context_parallel=1"), GPU, gpus=2)
    cp = plan_recipe(recipe(*device, *seq), GPU, gpus=2)
    assert "tensor parallel: 2 ranks x 2 context-parallel ranks (ring) x 1 replica" in describe_setup(both.setup)
    for key in ("weights_quantized", "lora_weights", "optimizer_state"):
        assert both.component(key) == tp.component(key) > 0, key
    assert both.component("activations") == cp.component("activations") == 32769 * (L * H * B + 2 * HD * B)
    assert both.component("recompute_layer") < cp.component("recompute_layer")  # the share's heads and MLP only
    parts = both.step_time_parts
    assert parts["tensor_allreduce"] == pytest.approx(tp.step_time_parts["tensor_allreduce"] * 32769 / 65536, rel=1e-9)
    assert parts["context_traffic"] == pytest.approx(cp.step_time_parts["context_traffic"] / 2, rel=1e-9)  # 8 -> 4 K/V heads
    assert both.peak_bytes < min(tp.peak_bytes, cp.peak_bytes)


def test_cp_x_pp_plans_each_stage_over_a_part_of_every_sequence():
    # 4 GPUs as pp2 x cp2: a rank holds its stage's layers (pp2's weights, LoRA, AdamW) and runs cp2's part of each
    # sequence through them (its activations: half of pp2's, its micro-batches held as pp2's); the sends between
    # the stages carry a part's hidden states. --fit tries the composition.
    device = ("memory.base_weights=device", "memory.embeddings=device", "memory.activation_offload=false")
    seq = ("data.max_seq_len=65536", "train.grad_accum=4")
    both = plan_recipe(recipe(*device, *seq, "distributed.pipeline_parallel=2"), GPU, gpus=4)
    pp = plan_recipe(recipe(*device, *seq, "distributed.pipeline_parallel=2", "distributed.context_parallel=1"), GPU, gpus=2)
    assert "(pipeline: 2 stages x 2 context-parallel ranks (ring) x 1 replica, 1f1b)" in describe_setup(both.setup)
    for key in ("weights_quantized", "lora_weights", "optimizer_state"):
        assert both.component(key) == pp.component(key) > 0, key
    assert both.component("activations") == pytest.approx(pp.component("activations") * 32769 / 65536, rel=1e-12)
    parts = both.step_time_parts
    assert parts["pipeline_p2p"] == pytest.approx(pp.step_time_parts["pipeline_p2p"] * 32769 / 65536, rel=1e-9)
    assert parts["context_traffic"] > 0 == pp.step_time_parts.get("context_traffic", 0)
    assert both.peak_bytes < pp.peak_bytes
    from finetune.plan.fitting import candidates

    cfg = recipe(*device, *seq, "distributed.pipeline_parallel=2")
    found = candidates(setup_of(cfg), 4, planning_inputs(cfg, GPU)[1], layouts=((2, 1),), contexts=(2,))
    assert any(s.pp == 2 and s.cp == 2 and s.gpus == 4 for s in found)


def test_cp_x_fsdp_plans_a_shard_of_the_weights_over_a_part_of_every_sequence():
    # distributed.strategy=fsdp: each rank holds half of every weight (FSDP over both), gathers a layer at a time
    # and has no DDP buckets; its activations are still its part's.
    device = ("memory.base_weights=device", "memory.embeddings=device", "memory.activation_offload=false")
    seq = ("data.max_seq_len=65536",)
    sharded = plan_recipe(recipe(*device, *seq, "distributed.strategy=fsdp"), GPU, gpus=2)
    whole = plan_recipe(recipe(*device, *seq), GPU, gpus=2)
    for key in ("weights_quantized", "lora_weights", "optimizer_state"):
        assert sharded.component(key) == pytest.approx(whole.component(key) / 2, rel=1e-3), key
    assert sharded.component("ddp_buckets") == 0 < whole.component("ddp_buckets")
    assert sharded.component("fsdp_gathered") > 0 == whole.component("fsdp_gathered")
    assert sharded.component("activations") == whole.component("activations") == 32769 * (L * H * B + 2 * HD * B)
    assert "holds 1/2 of the weights (FSDP: a layer gathered at a time)" in sharded.notes[0]
    assert describe_setup(sharded.setup).startswith(
        "2 GPUs (context parallel, ring: each sequence over 2 ranks x 1 replica) (FSDP)"
    )
    # --fit tries it: FSDP's parts, its shards on the GPUs (never streamed: FSDP's own rules)
    from finetune.plan.fitting import candidates

    cfg = recipe(*device, *seq, "distributed.strategy=fsdp")
    found = candidates(setup_of(cfg), 2, planning_inputs(cfg, GPU)[1], contexts=(2,))
    parts = [s for s in found if s.cp == 2 and s.sharding == "fsdp"]
    assert parts and not any(s.streams_weights or s.embeddings != "device" for s in parts)


def test_sequence_parallelism_plans_a_share_of_the_residual_streams_positions():
    # tp2 with sequence parallelism: a checkpointed layer's input, the two norms' fp32 inputs and the final norm's
    # are half of the positions on each rank; what the split linears keep (gathered) is unchanged.
    device = ("memory.base_weights=device", "memory.embeddings=device", "memory.activation_offload=false")
    tp = (*device, "data.max_seq_len=65536", "distributed.tensor_parallel=2", "distributed.context_parallel=1")
    plain, sp = (plan_recipe(recipe(*tp, f"distributed.sequence_parallel={on}"), GPU, gpus=2) for on in ("false", "true"))
    assert "sequence parallel" in describe_setup(sp.setup) and "sequence parallel" not in describe_setup(plain.setup)
    tokens = 65536
    assert plain.component("activations") == L * tokens * H * B + 2 * tokens * HD * B
    assert sp.component("activations") == L * tokens * H * B // 2 + 2 * tokens * HD * B
    assert sp.component("final_norm") * 2 == plain.component("final_norm") == tokens * 4 * H
    assert plain.component("recompute_layer") - sp.component("recompute_layer") == tokens * 2 * 4 * H // 2
    assert sp.step_time_s == plain.step_time_s  # an all-gather and a reduce-scatter carry an all-reduce's bytes


def test_parked_inputs_on_disk_keep_330k_tokens_of_an_8b_within_a_workstations_host_ram():
    # Issue 47's target: Llama-3.1-8B on 2 x RTX 4090 at >= 330,000 tokens without the ~141 GiB of host RAM the
    # checkpointed inputs take in pinned blocks (each rounded up to a power of two). activation_offload=disk parks them
    # in files: host RAM holds the 2 blocks in flight; the disk's writes and reads hide under the layers' compute.
    seq = ("data.max_seq_len=330000",)
    host = plan_recipe(recipe(*seq), GPU, gpus=2)
    disk = plan_recipe(recipe(*seq, "memory.activation_offload=disk"), GPU, gpus=2)
    part = 165001 * H * B  # a rank's part of one layer's input
    assert disk.peak_bytes == host.peak_bytes <= (1 - FIT_HEADROOM) * GPU.memory_bytes
    assert host.host_ram_bytes > 140 * 2**30 and disk.host_ram_bytes < 32 * 2**30
    assert host.host_ram_parts["activations"] - disk.host_ram_parts["activations"] == (L - 1 - 2) * 2**31  # 2 GiB blocks
    assert disk.disk_parts["parked_activations"] == 2 * (L - 1) * part  # each process's, the first layer's input kept
    assert disk.step_time_parts["host_transfer_exposed"] == pytest.approx(host.step_time_parts["host_transfer_exposed"])
    assert any("each process writes 168 GB a step to the disk" in note for note in disk.notes)  # 4 micro-batches


def test_each_process_parks_its_own_inputs_whatever_the_layout():
    # tp2 without sequence parallelism: each rank parks the whole sequence's inputs (twice one GPU's files); a
    # pipeline's stages write their layers' inputs once per micro-batch whatever their schedule holds at once.
    seq = ("data.max_seq_len=65536", "memory.activation_offload=disk", "distributed.context_parallel=1")
    device = ("memory.base_weights=device", "memory.embeddings=device")
    one = plan_recipe(recipe(*seq, *device), GPU, gpus=1)
    tp = plan_recipe(recipe(*seq, *device, "distributed.tensor_parallel=2"), GPU, gpus=2)
    assert tp.disk_parts["parked_activations"] == 2 * one.disk_parts["parked_activations"] > 0
    notes = {}
    for schedule in ("gpipe", "1f1b"):
        staged = (*seq, *device, "distributed.pipeline_parallel=2", f"distributed.pipeline_schedule={schedule}")
        e = plan_recipe(recipe(*staged, "train.grad_accum=4"), GPU, gpus=2)
        notes[schedule] = next(n for n in e.notes if "each process writes" in n)
    assert notes["gpipe"] == notes["1f1b"]  # 4 micro-batches through 16 layers a stage, either way


def test_fit_composes_context_and_stages_only_where_the_objective_trains_on_them():
    from finetune.plan.fitting import candidates

    cfg = load_recipe(
        "dpo-qlora-1x24gb", [f"model.path={CONFIGS / 'llama-3.1-8b'}", "data.path=d.jsonl", "distributed.context_parallel=2"]
    )
    found = candidates(setup_of(cfg), 4, planning_inputs(cfg, GPU)[1], layouts=((2, 1),), contexts=(2,), layers=32)
    assert any(s.cp == 2 for s in found) and any(s.pp == 2 for s in found)  # each alone
    assert not any(s.cp > 1 and s.pp > 1 for s in found)  # cp x pp trains sft only
