"""finetune plan: exact parameter counts, the search, the written recipe, bad input, preflight."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from finetune.cli.commands import main
from finetune.config.schema import build_recipe, load_recipe
from finetune.errors import GpuError, PlanError
from finetune.gpus import GiB, find_gpu, parse_bytes
from finetune.plan import (
    KNOBS,
    RecipeFacts,
    Setup,
    candidates,
    estimate,
    fit,
    loaded_weight_bytes,
    plan_recipe,
    preflight_memory,
    quantized_bytes,
    read_model_shape,
    runnable,
    search,
    setup_of,
)
from finetune.plan.speed import MATMUL_EFFICIENCY, forward_seconds, predicted_mfu, token_flops
from finetune.plan.terms import pinned_block_bytes

CONFIGS = Path(__file__).parent / "fixtures" / "configs"

# Parameter counts the model cards publish (safetensors metadata), reproduced from config.json alone.
PUBLISHED_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
}


def recipe_for(model: str, tmp_path, **train) -> object:
    return build_recipe(
        {
            "model": {"path": str(CONFIGS / model)},
            "data": {"path": "d.jsonl", "max_seq_len": train.pop("seq", 2048)},
            "output_dir": str(tmp_path / "run"),
            "train": {"batch_size": 4, "grad_accum": 4, **train},
        }
    )


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_from_config_json_are_exact(name):
    shape = read_model_shape(str(CONFIGS / name))
    assert shape.total_params == PUBLISHED_PARAMS[name]
    parts = shape.linear_params + shape.embedding_params + shape.head_params + shape.other_params
    assert parts == shape.total_params  # every parameter is in exactly one bucket


def test_nf4_double_quant_costs_what_bitsandbytes_stores():
    import bitsandbytes.functional as F
    import torch

    w = torch.randn(512, 384)
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    real = packed.numel() * packed.element_size() + sum(
        t.numel() * t.element_size() for t in (state.absmax, state.state2.absmax, state.state2.code, state.offset)
    )
    weight, constants = quantized_bytes(w.numel(), 512, 4, True, 2)
    assert weight + constants == real
    assert weight == w.numel() // 2 and abs(constants / w.numel() - 1 / 64) < 0.01  # ~0.127 bits/param of absmax


def test_inference_loads_the_whole_4bit_70b_of_the_streaming_recipe():
    # generate/eval/export load every layer onto the device: the recipe's base_weights=cpu does not apply there.
    cfg = load_recipe("qlora-stream-70b-1x24gb", [f"model.path={CONFIGS / 'llama-3-70b'}"])
    assert cfg.memory.base_weights == "cpu"
    # 4-bit linears 31.88 GiB + double-quant absmax 1.01 + bf16 embeddings/head/norms 3.92 + fp32 LoRA r=16 0.77
    assert round(loaded_weight_bytes(cfg, "bf16") / GiB, 2) == 37.58
    plan = plan_recipe(cfg, find_gpu("rtx4090"))  # training streams all but 3 layers: far less on the GPU
    assert plan.component("weights_quantized") == 0 and plan.component("weights_streamed") < 2 * GiB


def test_qlora_7b_on_24gb_numbers(tmp_path):
    cfg = recipe_for("llama-2-7b", tmp_path, batch_size=1, grad_accum=16)
    e = plan_recipe(cfg, find_gpu("rtx4090"))
    assert e.trainable_params == 39_976_960  # r=16 on all 7 linears of 32 layers
    assert 3.0 * GiB < e.component("weights_quantized") + e.component("quant_constants") < 3.4 * GiB
    assert e.component("weights_unquantized") == (2 * 131_072_000 + 266_240) * 2
    assert e.component("optimizer_state") == 2 * e.component("lora_weights") == 2 * 39_976_960 * 4
    assert e.fits and 6 * GiB < e.peak_bytes < 10 * GiB
    d = e.to_dict()
    assert d["peak_bytes"] == e.peak_bytes and d["fits"] and d["step_time_s"] > 0
    assert sum(d["components"][k] for k in d["in_peak"]) == d["peak_bytes"]


def test_memory_grows_with_batch_and_sequence_and_shrinks_with_checkpointing(tmp_path):
    shape = read_model_shape(str(CONFIGS / "llama-3-8b"))
    r = RecipeFacts(4, True, 16, "all-linear", 0.05, False, 2)
    gpu = find_gpu("a100-80gb")

    def peak(**kw):
        return estimate(shape, r, Setup(**{"batch_size": 1, "grad_accum": 1, **kw}), gpu).peak_bytes

    assert peak(batch_size=2) > peak(batch_size=1)
    assert peak(seq_len=4096) > peak(seq_len=2048)
    assert peak(checkpoint_every=0) > 2 * peak(checkpoint_every=1)
    fast = estimate(shape, r, Setup(batch_size=1, grad_accum=8, checkpoint_every=0), gpu)
    slow = estimate(shape, r, Setup(batch_size=1, grad_accum=8, checkpoint_every=1), gpu)
    assert slow.step_time_s > fast.step_time_s * 1.2  # checkpointing replays the forward


def test_search_keeps_the_global_batch_and_knobs_are_setup_fields():
    base = Setup(batch_size=4, grad_accum=4, gpus=2)
    found = candidates(base, max_gpus=2)
    assert all(s.global_batch == 32 for s in found)
    assert {s.gpus for s in found} == {1, 2} and {s.checkpoint_every for s in found} == {0, 1, 2, 4}
    assert all(hasattr(base, k.name) for k in KNOBS)


def test_fit_writes_a_runnable_recipe_that_fits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "r.yaml"
    text = Path(__file__).parents[1].joinpath("recipes", "qlora-1x24gb.yaml").read_text()
    src.write_text(text)
    out = tmp_path / "fitted.yaml"
    # batch 32 x 1: does not fit a 4090 as written (31.6 GiB with the tables in host RAM; 16 x 2 does)
    code = main(
        [
            "plan",
            str(src),
            f"model.path={CONFIGS / 'qwen2.5-7b'}",
            "train.batch_size=32",
            "train.grad_accum=1",
            "--gpu",
            "rtx4090",
            "--host-ram",
            "64GB",
            "--fit",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    written = out.read_text()
    assert written.startswith(f"# finetune run {out}\n")
    for line in written.splitlines():  # every key line carries a comment
        s = line.strip()
        if ":" in s and not s.startswith("#") and not s.endswith(":") and not s.startswith("description"):
            assert "#" in s, line
    cfg = load_recipe(out)
    assert cfg.model.path == str(CONFIGS / "qwen2.5-7b")
    assert cfg.train.batch_size * cfg.train.grad_accum == 32  # global batch kept
    assert plan_recipe(cfg, find_gpu("rtx4090")).fits
    assert not plan_recipe(
        load_recipe(src, [f"model.path={CONFIGS / 'qwen2.5-7b'}", "train.batch_size=32", "train.grad_accum=1"]),
        find_gpu("rtx4090"),
    ).fits


def test_plan_json_is_one_object_in_bytes(tmp_path, capsys):
    src = tmp_path / "r.yaml"
    src.write_text(
        yaml.safe_dump({"model": {"path": str(CONFIGS / "mistral-7b")}, "data": {"path": "x.jsonl"}, "output_dir": "o"})
    )
    assert main(["plan", str(src), "--gpu", "l4", "--gpus", "1", "--host-ram", "16GB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"] == "l4" and isinstance(d["peak_bytes"], int) and isinstance(d["fits"], bool)
    assert {"weights_quantized", "lora_weights", "optimizer_state", "activations", "logits_loss", "cuda_context"} <= set(
        d["components"]
    )
    assert d["host_ram_fits"] is True and d["step_time_s"] > 0


def test_unknown_gpu_lists_known_and_suggests_the_closest():
    with pytest.raises(GpuError) as err:
        find_gpu("rtx4080")
    assert "rtx4090" in str(err.value) and "did you mean 'rtx4090'" in str(err.value) and "--gpu-mem" in str(err.value)
    assert find_gpu("4090").name == "rtx4090" and find_gpu("RTX 3090").name == "rtx3090"
    assert find_gpu(None, "11GB").memory_bytes == 11 * GiB and parse_bytes("1.5 GiB") == int(1.5 * GiB)


def test_device_names_map_to_the_catalogue():
    from finetune.gpus import gpu_for_device

    for name, key in [
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A10G", "a10g"),
        ("Tesla T4", "t4"),
    ]:
        assert gpu_for_device(name, 5 * GiB).name == key, name
    other = gpu_for_device("Some New GPU", 7 * GiB)
    assert other.memory_bytes == 7 * GiB and other.name == "Some New GPU"


def test_unreadable_model_config_says_path_and_fix(tmp_path):
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(PlanError) as err:
        read_model_shape(str(bad))
    assert str(bad) in err.value.message and err.value.hint
    with pytest.raises(PlanError) as err:
        read_model_shape("no-such-org/no-such-model")  # HF_HUB_OFFLINE=1 in the tests
    assert "no-such-org/no-such-model" in err.value.message and "HF_HUB_OFFLINE" in err.value.hint


def test_cli_bad_input_exits_2(tmp_path, capsys):
    shipped = str(Path(__file__).parents[1] / "recipes" / "qlora-1x24gb.yaml")
    assert main(["plan", shipped, "--gpu", "rtx9090"]) == 2
    assert "unknown GPU 'rtx9090'" in capsys.readouterr().err
    assert main(["plan", shipped, "--gpu", "rtx4090"]) == 2  # Qwen/Qwen2.5-7B: no network, an empty HF cache (conftest)
    assert "cannot read config.json of 'Qwen/Qwen2.5-7B'" in capsys.readouterr().err


def test_nothing_fits_says_the_minimum(tmp_path):
    # A 4-bit 70B fits one 12 GB card by streaming its layers (test_fit_streams_a_70b_on_one_24gb_card); on 4 GB the
    # resident part alone (quant constants, embeddings, head, LoRA state, 3 streamed layers) is too much.
    cfg = recipe_for("llama-2-70b", tmp_path)
    with pytest.raises(PlanError) as err:
        fit(cfg, find_gpu(None, "4GB"), max_gpus=1)
    msg = str(err.value)
    assert "the smallest needs" in msg and "--gpu-mem" in msg and "weights alone take" in msg
    assert "base weights streamed from cpu" in msg  # the smallest setup it tried streams the weights


def test_fit_shards_and_offloads_a_70b_over_two_small_cards(tmp_path):
    # Two 12 GB cards: only FSDP with the shards in host RAM fits a 4-bit 70B.
    from finetune.plan import changes_of

    cfg = recipe_for("llama-2-70b", tmp_path)
    current, best = fit(cfg, find_gpu("rtx3060"), max_gpus=2)
    assert (best.setup.gpus, best.setup.sharding, best.setup.cpu_offload) == (2, "fsdp", True)
    assert best.fits
    # Each process first builds the whole 4-bit model in RAM (trainer/build.py), then keeps half of it
    # as offloaded shards: the load, not the shards, sets its host RAM.
    h = best.host_ram_parts
    assert best.loads_whole_model and h["loading"] > 2 * h["fsdp_shards"] > 34 * GiB
    kept = h["streamed_weights"] + h["activations"] + h["optimizer"] + h["fsdp_shards"]
    assert best.host_ram_bytes == 2 * (h["libraries"] + max(h["loading"], kept))
    changes = changes_of(best, current.setup)
    assert changes["distributed.strategy"] == "fsdp" and changes["distributed.cpu_offload"] is True


def test_preflight_refuses_on_cuda_when_clearly_over_and_only_notes_on_cpu(tmp_path, monkeypatch):
    import torch

    from finetune import hardware

    cfg = recipe_for("llama-2-7b", tmp_path, batch_size=16, grad_accum=1)
    problems, notes = preflight_memory(cfg)  # this machine: CPU
    assert not problems and notes[0].startswith("memory estimate: peak")

    monkeypatch.setattr(hardware, "detect_device", lambda: hardware.Device("cuda", "NVIDIA GeForce RTX 3060", True, True))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA GeForce RTX 3060")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: type("P", (), {"total_memory": 12 * GiB})())
    problems, notes = preflight_memory(cfg)
    assert len(problems) == 1 and "more than 1.1 x the device memory" in problems[0]
    assert "fits as: " in problems[0] and "train.batch_size=" in problems[0] and "--skip-memory-check" in problems[0]
    problems, notes = preflight_memory(cfg, refuse=False)
    assert not problems and "more than 1.1" in notes[0]
    ok = recipe_for("llama-2-7b", tmp_path, batch_size=1, grad_accum=16, seq=1024)
    problems, notes = preflight_memory(ok)
    assert not problems and "per GPU of 12.00 GiB" in notes[0]
    # A pipeline is checked by its fullest stage; the fix names the pipeline's own levers (--fit searches none).
    staged = build_recipe({**cfg.to_dict(), "distributed": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}})
    problems, notes = preflight_memory(staged)
    assert len(problems) == 1 and "the fullest of 2 pipeline stages: more than 1.1 x" in problems[0]
    assert "raise distributed.pipeline_parallel" in problems[0] and "fits as" not in problems[0]
    staged_ok = build_recipe({**ok.to_dict(), "distributed": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}})
    problems, notes = preflight_memory(staged_ok)
    assert not problems and "the fullest of 2 pipeline stages" in notes[0]
    whole, stage = plan_recipe(ok, find_gpu("rtx3060")), plan_recipe(staged_ok, find_gpu("rtx3060"))
    assert stage.peak_bytes < whole.peak_bytes  # half the layers


# ----------------------------------------------------------------------------- memory modes (memory.*)

NF4 = RecipeFacts(4, True, 16, "all-linear", 0.05, False, 2)
REPO_RECIPES = Path(__file__).parents[1] / "recipes"  # this checkout's (finetune.recipes may point at another install)


def test_every_kth_layer_checkpointing_sits_between_none_and_all():
    shape = read_model_shape(str(CONFIGS / "llama-3-8b"))  # 32 layers
    gpu = find_gpu("a100-80gb")
    e = {k: estimate(shape, NF4, Setup(batch_size=1, grad_accum=8, checkpoint_every=k), gpu) for k in (0, 4, 2, 1)}
    rope = 2 * 2048 * shape.head_dim * 2
    full, inputs = (e[k].component("activations") - rope for k in (0, 1))
    # every 2nd: 16 layers keep their input, 16 keep everything; every 4th: 8 and 24
    assert e[2].component("activations") - rope == 16 * inputs // 32 + 16 * full // 32
    assert e[4].component("activations") - rope == 8 * inputs // 32 + 24 * full // 32
    assert e[0].peak_bytes > e[4].peak_bytes > e[2].peak_bytes > e[1].peak_bytes
    assert e[0].step_time_s < e[4].step_time_s < e[2].step_time_s < e[1].step_time_s
    # the recompute replays 1/2 of the layers: half the cost that checkpointing all of them adds
    assert e[2].step_time_s - e[0].step_time_s == pytest.approx((e[1].step_time_s - e[0].step_time_s) / 2, rel=1e-9)


def test_streaming_base_weights_leaves_three_layers_on_the_gpu():
    shape = read_model_shape(str(CONFIGS / "llama-3-70b"))  # 80 layers
    gpu = find_gpu("rtx4090")
    setup = Setup(batch_size=1, grad_accum=16)
    device = estimate(shape, NF4, setup, gpu, model_on_disk=True)
    cpu = estimate(shape, NF4, replace(setup, base_weights="cpu"), gpu, model_on_disk=True)
    disk = estimate(shape, NF4, replace(setup, base_weights="disk"), gpu, model_on_disk=True)
    weights = device.component("weights_quantized")
    assert 31 * GiB < weights < 33 * GiB  # 4-bit packed decoder linears of 70.6B parameters
    for e in (cpu, disk):
        assert e.component("weights_quantized") == 0
        assert e.component("weights_streamed") == 3 * weights // 80  # ~1.2 GiB
        assert e.component("quant_constants") == device.component("quant_constants")  # absmax stays resident
        assert device.peak_allocated_bytes - e.peak_allocated_bytes == weights - 3 * weights // 80
    assert device.peak_bytes > 48 * GiB and cpu.peak_bytes < 17 * GiB
    # cpu: the weights are pinned in host RAM, and the whole model is built there while loading;
    # disk: they are a file, written layer by layer as bitsandbytes quantizes them.
    # Each linear's packed weight is its own pinned block, rounded up to a power of two (torch's host
    # allocator): Llama-3-70B's MLP weights (8192 x 28672 / 2 = 112 MiB) take 128 MiB each.
    pinned = sum(g.count * pinned_block_bytes(g.in_features * g.out_features // 2) for g in shape.linears)
    assert pinned - weights == 80 * 3 * 16 * 2**20
    assert cpu.host_ram_parts["streamed_weights"] == pinned and disk.host_ram_parts["streamed_weights"] == 0
    assert cpu.host_ram_bytes >= weights + 3 * GiB and cpu.host_ram_parts["loading"] > weights
    resident = device.component("quant_constants") + device.component("weights_unquantized")
    assert disk.host_ram_parts["loading"] == cpu.host_ram_parts["loading"] - weights
    assert disk.host_ram_parts["loading"] - resident == device.host_ram_parts["loading"]  # one shard
    assert cpu.loads_whole_model and not disk.loads_whole_model
    # 16-bit weights are not captured: they are moved to the file once the model is built.
    bf16 = estimate(shape, replace(NF4, quant_bits=None), replace(setup, base_weights="disk"), gpu, model_on_disk=True)
    assert bf16.loads_whole_model
    assert disk.disk_bytes - device.disk_bytes == weights and cpu.disk_bytes == device.disk_bytes


def test_streaming_costs_the_host_link_time_it_cannot_hide():
    from finetune.plan import NVME_READ_GBPS, forward_seconds

    shape = read_model_shape(str(CONFIGS / "llama-3-70b"))
    gpu = find_gpu("rtx4090")  # PCIe 4.0: 25 GB/s pinned
    setup = Setup(batch_size=1, grad_accum=16)
    device = estimate(shape, NF4, setup, gpu)
    weights = device.component("weights_quantized")
    per_micro = (device.step_time_s - device.step_time_parts["optimizer"]) / 16
    fwd = forward_seconds(shape, NF4, setup, gpu, device.trainable_params)
    bwd = per_micro - fwd
    for mode, rate in [("cpu", 25e9), ("disk", NVME_READ_GBPS * 1e9)]:
        e = estimate(shape, NF4, replace(setup, base_weights=mode), gpu)
        x = weights / rate  # one pass over the 80 layers: forward, and again in the recompute
        expected = max(fwd, x) + max(bwd, x) + 2 * x / 80 - per_micro  # per-layer max(compute, copy); the first layer is exposed
        assert e.step_time_s - device.step_time_s == pytest.approx(16 * expected, rel=1e-6)
        assert e.step_time_parts["host_transfer"] == pytest.approx(16 * 2 * x, rel=1e-9)
    cpu = estimate(shape, NF4, replace(setup, base_weights="cpu"), gpu)
    assert cpu.step_time_s / device.step_time_s < 1.01  # 1.3 GiB a layer at 25 GB/s hides behind 2048 tokens of compute
    disk = estimate(shape, NF4, replace(setup, base_weights="disk"), gpu)
    assert disk.step_time_s / device.step_time_s > 1.5  # a cold NVMe at 3.5 GB/s does not


def test_activation_offload_keeps_two_layers_on_the_gpu_and_the_rest_in_host_ram():
    # Checkpointing none: every layer keeps all it saves, and that is what offload moves.
    shape = read_model_shape(str(CONFIGS / "llama-3-8b"))
    gpu = find_gpu("rtx3060")
    base = estimate(shape, NF4, Setup(batch_size=1, grad_accum=8, checkpoint_every=0), gpu)
    off = estimate(shape, NF4, Setup(batch_size=1, grad_accum=8, checkpoint_every=0, activation_offload=True), gpu)
    rope = 2 * 2048 * shape.head_dim * 2
    layer, rest = divmod(base.component("activations") - rope, 32)
    assert rest == 0 and 450 * 2**20 < layer < 550 * 2**20  # ~500 MiB a layer at 2048 tokens
    assert off.component("activations") == 2 * layer + rope  # copies keep up with compute: no backlog
    assert off.host_ram_parts["activations"] == 32 * layer
    assert base.peak_allocated_bytes - off.peak_allocated_bytes == 30 * layer
    # out on a side stream in forward (hidden), back on the compute stream in backward (not hidden)
    assert off.step_time_s - base.step_time_s == pytest.approx(8 * 32 * layer / 25e9, rel=1e-6)
    # Every 2nd layer checkpointed: the 16 others offload all they save, the 16 checkpointed their input
    # (but the first layer: see below); on the GPU two of each are in flight.
    half = estimate(shape, NF4, Setup(batch_size=1, grad_accum=8, checkpoint_every=2, activation_offload=True), gpu)
    layer_input = 2048 * 2 * shape.hidden
    assert half.host_ram_parts["activations"] == 16 * layer + 15 * layer_input
    assert half.component("activations") == 2 * layer + (1 + 2) * layer_input + rope


def test_offloaded_checkpoints_keep_two_layer_inputs_on_the_gpu_and_the_rest_in_host_ram():
    # Checkpointing all: each layer keeps only its input (bf16, 2048 x 4096: 16 MiB); with offload
    # those wait in pinned host RAM, two on the GPU (the one recomputing, the one prefetched). The first
    # layer's input stays: the embeddings' output, a leaf that trains, which autograd holds anyway.
    shape = read_model_shape(str(CONFIGS / "llama-3-8b"))
    gpu = find_gpu("rtx4090")
    kept = estimate(shape, NF4, Setup(batch_size=1, grad_accum=8, checkpoint_every=1), gpu)
    off = estimate(shape, NF4, Setup(batch_size=1, grad_accum=8, checkpoint_every=1, activation_offload=True), gpu)
    rope = 2 * 2048 * shape.head_dim * 2
    layer_input = 2048 * 2 * 4096
    assert kept.component("activations") == 32 * layer_input + rope == 537_919_488
    assert off.component("activations") == (1 + 2) * layer_input + rope == 51_380_224
    assert off.host_ram_parts["activations"] == 31 * layer_input == 520_093_696
    assert kept.peak_allocated_bytes - off.peak_allocated_bytes == 29 * layer_input
    assert kept.host_ram_parts["activations"] == 0
    activations = next(c for c in off.components if c.key == "activations")
    assert activations.label == "activations in flight to/from host RAM (checkpointed layer inputs)"
    # speed.py counts the copies back as exposed, though memory/activation_offload.py prefetches them: an upper bound
    # of 8 micro-batches x 496 MiB / 25 GB/s (0.17 s) on a multi-second step.
    assert off.step_time_s - kept.step_time_s == pytest.approx(8 * 31 * layer_input / 25e9, rel=1e-6)
    # A setup the trainer runs now, so the search may propose it.
    assert runnable(off.setup)


def test_optimizer_offload_moves_adamw_state_to_host_ram():
    shape = read_model_shape(str(CONFIGS / "llama-3-8b"))
    gpu = find_gpu("rtx3060")
    base = estimate(shape, NF4, Setup(batch_size=1, grad_accum=16), gpu)
    off = estimate(shape, NF4, Setup(batch_size=1, grad_accum=16, optimizer_offload=True), gpu)
    n = base.trainable_params
    assert base.component("optimizer_state") == 2 * 4 * n and off.component("optimizer_state") == 0
    assert off.component("lora_weights") == base.component("lora_weights") and off.component("gradients") == base.component(
        "gradients"
    )
    assert off.host_ram_parts["optimizer"] == 4 * 4 * n  # fp32 weight copy, fp32 grad, 2 fp32 moments
    assert base.peak_allocated_bytes - off.peak_allocated_bytes == 2 * 4 * n
    # grads out and weights back over PCIe, then 64 B/param of AdamW traffic at 10 GB/s on the host
    assert off.step_time_parts["optimizer"] == pytest.approx(2 * 4 * n / 25e9 + 64 * n / 10e9, rel=1e-9)
    assert off.step_time_s - base.step_time_s == pytest.approx(
        off.step_time_parts["optimizer"] - base.step_time_parts["optimizer"], rel=1e-9
    )


def test_search_offloads_only_when_nothing_faster_fits(tmp_path):
    shape = read_model_shape(str(CONFIGS / "llama-2-7b"))
    # a 7B on an 80 GB card: the fastest setup keeps everything on the GPU
    best, estimates = search(shape, NF4, Setup(batch_size=1, grad_accum=16), find_gpu("a100-80gb"), max_gpus=1)
    assert best.setup.offload_rank == 0 and best.setup.checkpoint_every == 0
    assert any(e.setup.base_weights == "cpu" for e in estimates)  # tried, not chosen
    # streaming never pairs with partial checkpointing or several processes; 8-bit layers are not streamed
    for s in candidates(Setup(batch_size=2, grad_accum=4, gpus=2), max_gpus=2, recipe=NF4):
        assert not s.streams_weights or (s.gpus == 1 and s.checkpoint_every == 1 and s.sharding == "ddp")
        assert not (s.sharding == "fsdp" and s.optimizer_offload)
    int8 = RecipeFacts(8, False, 16, "all-linear", 0.05, False, 2)
    assert not any(s.streams_weights for s in candidates(Setup(batch_size=1, grad_accum=1), 1, int8))


@pytest.mark.parametrize(
    "values",
    [
        {"memory.activation_checkpointing": "none", "memory.activation_offload": True},
        {"memory.activation_checkpointing": 2, "memory.optimizer_offload": True},
        {"memory.base_weights": "cpu", "memory.optimizer_offload": True},
        {"memory.base_weights": "disk", "memory.optimizer_offload": True},
        {"memory.activation_checkpointing": 4, "memory.activation_offload": True, "memory.optimizer_offload": True},
    ],
)
def test_changes_of_writes_recipe_values_that_setup_of_reads_back(tmp_path, values):
    from finetune.config.schema import build_recipe
    from finetune.plan import changes_of, setup_of

    base_cfg = recipe_for("llama-3-8b", tmp_path)
    base = setup_of(base_cfg)
    tree = base_cfg.to_dict()
    for dotted, v in values.items():
        section, key = dotted.split(".")
        tree[section][key] = v
    cfg = build_recipe(tree)  # the values are valid recipe values (cross-field rules included)
    setup = setup_of(cfg)
    e = plan_recipe(cfg, find_gpu("rtx4090"))
    assert changes_of(e, base) == values  # Setup -> recipe keys, and recipe keys -> Setup, agree
    assert (setup.checkpoint_every, setup.activation_offload, setup.base_weights, setup.optimizer_offload) == (
        cfg.memory.checkpoint_every,
        cfg.memory.activation_offload,
        cfg.memory.base_weights,
        cfg.memory.optimizer_offload,
    )


def test_fit_streams_a_70b_on_one_24gb_card(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "70b.yaml"
    code = main(
        [
            "plan",
            str(REPO_RECIPES / "qlora-1x24gb.yaml"),
            f"model.path={CONFIGS / 'llama-3-70b'}",
            "--gpu",
            "rtx4090",
            "--host-ram",
            "64GB",
            "--fit",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert changes["memory.base_weights"] == "cpu"
    cfg = load_recipe(out)  # validates: schema and cross-field rules
    assert cfg.memory.base_weights == "cpu" and cfg.memory.activation_checkpointing == "all"
    e = plan_recipe(cfg, find_gpu("rtx4090"))
    assert e.peak_bytes <= 0.9 * 24 * GiB and e.host_ram_parts["streamed_weights"] > 31 * GiB
    assert not plan_recipe(replace_memory(cfg, base_weights="device"), find_gpu("rtx4090")).fits  # ~56 GiB without streaming


def replace_memory(cfg, **memory):
    return cfg.model_copy(update={"memory": cfg.memory.model_copy(update=memory)})


@pytest.mark.parametrize(
    "name, model, gpu",
    [
        ("qlora-offload-1x12gb", "qwen2.5-7b", "rtx3060"),
        ("qlora-offload-1x12gb", "llama-3-8b", "rtx3060"),
        ("qlora-stream-70b-1x24gb", "llama-3-70b", "rtx4090"),
        ("qlora-stream-70b-1x24gb", "qwen2.5-72b", "rtx4090"),
    ],
)
def test_offload_recipes_fit_their_cards_and_need_their_offload(name, model, gpu):
    # Loaded from this checkout: the schema test (test_config) reads the installed finetune.recipes.
    path = REPO_RECIPES / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("# finetune run")
    for line in text.splitlines():
        s = line.strip()
        if ":" in s and not s.startswith("#") and not s.endswith(":") and not s.startswith("description"):
            assert "#" in s, f"{name}: key without a comment: {line!r}"
    cfg = load_recipe(path, [f"model.path={CONFIGS / model}"])
    card = find_gpu(gpu)
    e = plan_recipe(cfg, card)
    assert e.peak_bytes <= 0.9 * card.memory_bytes, f"{name} with {model}: {e.peak_bytes / GiB:.2f} GiB"
    plain = replace_memory(cfg, activation_offload=False, optimizer_offload=False, base_weights="device")
    assert plan_recipe(plain, card).peak_bytes > 0.9 * card.memory_bytes  # the offload is needed, not decoration


def test_search_leaves_out_offload_the_host_ram_cannot_hold():
    shape = read_model_shape(str(CONFIGS / "mistral-7b"))
    gpu, base = find_gpu("rtx3060"), Setup(batch_size=2, grad_accum=8)
    best, _ = search(shape, NF4, base, gpu, max_gpus=1)
    # no recompute, every activation (~33 GiB) in pinned RAM: faster on a slow GPU, if the host has the RAM
    assert (best.setup.checkpoint_every, best.setup.activation_offload) == (0, True) and best.host_ram_bytes > 32 * GiB
    small, _ = search(shape, NF4, base, gpu, max_gpus=1, host_ram=16 * GiB)
    assert small.host_ram_bytes <= 16 * GiB and small.step_time_s > best.step_time_s


def test_fit_cli_passes_host_ram_to_the_search(tmp_path, monkeypatch, capsys):
    # `--fit --host-ram 16GB` must not write a recipe whose pinned activations need 33 GiB of RAM.
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "r.yaml"
    src.write_text((REPO_RECIPES / "qlora-1x24gb.yaml").read_text())
    common = [
        "plan",
        str(src),
        f"model.path={CONFIGS / 'mistral-7b'}",
        "train.batch_size=2",
        "train.grad_accum=8",
        "--gpu",
        "rtx3060",
        "--fit",
        "--json",
    ]
    assert main([*common, "--host-ram", "1TB", "--out", str(tmp_path / "any.yaml")]) == 0
    unlimited = json.loads(capsys.readouterr().out)["best"]
    assert unlimited["host_ram_bytes"] > 32 * GiB  # the fastest setup pins every activation
    assert main([*common, "--host-ram", "16GB", "--out", str(tmp_path / "small.yaml")]) == 0
    small = json.loads(capsys.readouterr().out)["best"]
    assert small["host_ram_bytes"] <= 16 * GiB and small["step_time_s"] > unlimited["step_time_s"]
    written = plan_recipe(load_recipe(tmp_path / "small.yaml"), find_gpu("rtx3060"))  # the file says what was chosen
    assert written.fits and written.host_ram_bytes == small["host_ram_bytes"]


def test_fit_streams_from_disk_when_ram_cannot_pin_the_weights_and_names_ram_when_nothing_loads(tmp_path):
    cfg = recipe_for("llama-3-70b", tmp_path)
    _, roomy = fit(cfg, find_gpu("rtx4090"), host_ram=64 * GiB)
    assert roomy.setup.base_weights == "cpu"  # as fast as not streaming, and it needs no disk
    _, tight = fit(cfg, find_gpu("rtx4090"), host_ram=24 * GiB)
    assert tight.setup.base_weights == "disk" and tight.host_ram_bytes <= 24 * GiB
    with pytest.raises(PlanError) as err:
        fit(cfg, find_gpu("rtx4090"), host_ram=8 * GiB)
    assert "needs more host RAM than 8.00 GiB" in str(err.value) and "--host-ram" in err.value.hint


def test_a_preference_pair_is_two_sequences_and_dpo_adds_a_reference_forward():
    shape = read_model_shape(str(CONFIGS / "llama-3.1-8b"))
    r = RecipeFacts(4, True, 16, "all-linear", 0.0, False, 2)
    gpu = find_gpu("rtx4090")
    sft = estimate(shape, r, Setup(batch_size=4, grad_accum=1, seq_len=1024), gpu)
    simpo = estimate(shape, r, Setup(batch_size=2, grad_accum=1, seq_len=1024, sequences_per_example=2), gpu)
    dpo = estimate(shape, r, Setup(batch_size=2, grad_accum=1, seq_len=1024, sequences_per_example=2, reference_passes=1), gpu)
    # 2 pairs = 4 sequences: the same activations, logits and compute as 4 SFT examples.
    assert simpo.peak_bytes == sft.peak_bytes and simpo.step_time_s == sft.step_time_s
    # DPO's reference is one more forward without gradients: its time, not its memory.
    assert dpo.peak_bytes == simpo.peak_bytes
    one_forward = forward_seconds(
        shape, r, Setup(batch_size=2, grad_accum=1, seq_len=1024, sequences_per_example=2), gpu, sft.trainable_params
    )
    assert dpo.step_time_s == pytest.approx(simpo.step_time_s + one_forward, rel=1e-9)


def test_the_dpo_recipe_plans_its_pairs(tmp_path):
    cfg = load_recipe("dpo-qlora-1x24gb", [f"model.path={CONFIGS / 'llama-3.1-8b'}", "data.path=d.jsonl"])
    setup = setup_of(cfg)
    assert (setup.batch_size, setup.rows, setup.reference_passes) == (2, 4, 1)
    pre = setup_of(load_recipe("dpo-qlora-1x24gb", ["train.precompute_reference=true", "data.path=d.jsonl"]))
    assert pre.reference_passes == 0


def test_a_preference_loss_plans_every_response_tokens_logits_at_once():
    # objectives/preference.py scores a pair's response tokens in one head call (runs/evaluate.row_logps):
    # memory.loss=auto's chunks are the causal-LM loss's only. Planned as chunked, the DPO recipe's peak was
    # 34% under what an H100 measured (benchmarks/README.md, session 14); planned so, within 0.3%.
    cfg = load_recipe("dpo-qlora-1x24gb", [f"model.path={CONFIGS / 'llama-3.1-8b'}", "data.path=d.jsonl"])
    setup = setup_of(cfg)
    assert not setup.head_in_chunks and setup.loss_rows == 0 and setup.loss == "auto"
    logits = {c.key: c.bytes for c in plan_recipe(cfg, find_gpu("rtx4090")).components}["logits_loss"]
    assert logits == 4 * 1024 * 128_256 * 12  # bf16 logits + their gathered copy + fp32 upcast + fp32 log-softmax
    sft = setup_of(load_recipe("qlora-1x24gb", [f"model.path={CONFIGS / 'llama-3.1-8b'}", "data.path=d.jsonl"]))
    assert sft.head_in_chunks and sft.loss_rows == 256  # the same memory.loss: one chunk of target positions


def test_plan_prints_the_mfu_it_predicts_next_to_the_step_time():
    from finetune.plan import report

    shape = read_model_shape(str(CONFIGS / "llama-3-8b"))
    gpu = find_gpu("h100")
    found = {}
    for ckpt in (0, 1):
        setup = Setup(batch_size=2, grad_accum=4, checkpoint_every=ckpt, seq_len=2048)
        e = estimate(shape, NF4, setup, gpu)
        # MFU: the model's FLOPs of a step (no recomputation) over the GPU's peak for the step's time.
        model_flops = 2 * 2048 * 4 * token_flops(shape, NF4, setup, e.trainable_params).model
        mfu = model_flops / (e.step_time_s * gpu.bf16_tflops * 1e12)
        assert predicted_mfu(e.step_time_s, e.step_time_parts) == pytest.approx(mfu, rel=1e-9)
        assert f"s/step, {e.tokens_per_step / e.step_time_s:,.0f} tokens/s, MFU {mfu:.0%} (compute" in report(e)
        found[ckpt] = (e, mfu)
    (plain, mfu0), (replayed, mfu1) = found[0], found[1]
    assert 0.25 < mfu1 < mfu0 < MATMUL_EFFICIENCY  # dequantization and the replayed layers cost time, not model FLOPs
    # The replayed layers are the recompute part: the same model seconds either way.
    model_s = [e.step_time_parts["compute"] - e.step_time_parts["recompute"] for e in (plain, replayed)]
    assert model_s[0] == pytest.approx(model_s[1], rel=1e-12)
    assert replayed.step_time_parts["recompute"] > plain.step_time_parts["recompute"] == 0  # loss full, no tiles
    assert mfu0 == pytest.approx(MATMUL_EFFICIENCY * plain.step_time_parts["compute"] / plain.step_time_s, rel=1e-9)


# ----------------------------------------------------------------------------- mixture of experts


def test_moe_parameters_every_expert_for_memory_the_active_ones_for_flops():
    from finetune.plan.speed import token_flops

    shape = read_model_shape(str(CONFIGS / "qwen3-30b-a3b"))
    L, h, V, E, k, f = 48, 2048, 151936, 128, 8, 768  # Qwen3-30B-A3B's config.json
    attention = L * (h * 32 * 128 + 2 * h * 4 * 128 + 32 * 128 * h)  # q, k, v, o (head_dim 128, 4 kv heads)
    expert = 3 * f * h  # gate, up, down of one expert
    rest = L * E * h + L * (2 * h + 2 * 128) + h + 2 * V * h  # routers, norms (q/k norms too), embeddings and head
    assert shape.total_params == attention + L * E * expert + rest == 30_532_122_624
    assert shape.active_params == attention + L * k * expert + rest == 3_353_032_704
    assert shape.total_params == pytest.approx(30.5e9, rel=0.002)  # the model card: 30.5B total,
    assert shape.active_params == pytest.approx(3.3e9, rel=0.02)  # 3.3B activated
    assert shape.linear_params + shape.expert_params + shape.embedding_params + shape.head_params + shape.other_params == (
        shape.total_params
    )
    assert shape.expert_layer_params == E * expert and shape.intermediate == k * f  # one token's experts: k x 768 wide
    # Memory: every expert 4-bit, one fused tensor per parameter and layer (finetune/model/moe.py).
    setup = Setup(batch_size=1, grad_accum=1)
    e = estimate(shape, NF4, setup, find_gpu("rtx4090"))
    groups = [(g.in_features * g.out_features, g.out_features, g.count) for g in shape.linears]
    groups += [(g.experts * g.in_features * g.out_features, g.out_features, g.count) for g in shape.experts]
    assert e.component("weights_quantized") + e.component("quant_constants") == sum(
        sum(quantized_bytes(n, out, 4, True, 2)) * count for n, out, count in groups
    )
    # int8 leaves the experts 16-bit (bitsandbytes converts nn.Linear only)
    int8 = estimate(shape, replace(NF4, quant_bits=8), setup, find_gpu("h100"))
    assert int8.component("weights_unquantized") >= shape.expert_params * 2
    # FLOPs: a token multiplies by its 8 active experts, not the 128
    attn = 2 * 2048 * 32 * 128 * L
    assert (
        token_flops(shape, NF4, setup, 0).forward
        == 2 * (shape.linear_params + shape.active_expert_params + shape.head_params) + attn
    )


def test_moe_lora_on_the_experts_counts_an_adapter_per_expert():
    shape = read_model_shape(str(CONFIGS / "qwen3-30b-a3b"))
    attention = estimate(shape, replace(NF4, lora_target=("q_proj", "k_proj", "v_proj", "o_proj")), Setup(1, 1), None)
    experts = estimate(shape, replace(NF4, lora_target=("q_proj", "k_proj", "v_proj", "o_proj", "experts")), Setup(1, 1), None)
    per_expert = 16 * ((2048 + 1536) + (768 + 2048))  # peft's ParamWrapper: r rows of A and columns of B per expert
    assert experts.trainable_params - attention.trainable_params == 128 * 48 * per_expert
    # backward holds the gradient of a layer's folded expert stack (W + B @ A, bf16)
    assert experts.component("dequant_buffer") == shape.expert_layer_params * 2


def test_moe_recipe_fits_one_24gb_card_and_needs_its_checkpointing():
    path = REPO_RECIPES / "qlora-moe-1x24gb.yaml"
    cfg = load_recipe(path, [f"model.path={CONFIGS / 'qwen3-30b-a3b'}"])
    card = find_gpu("rtx4090")
    e = plan_recipe(cfg, card)
    assert e.peak_bytes <= 0.9 * card.memory_bytes
    assert f"{e.peak_bytes / GiB:.2f} GiB" in path.read_text()  # the recipe states what the planner says
    # without checkpointing every MoE layer keeps its dequantized expert stack (1.1 GiB) for backward
    assert plan_recipe(replace_memory(cfg, activation_checkpointing="none"), card).peak_bytes > 4 * card.memory_bytes
    # --fit never proposes what model/load.py refuses for the 4-bit experts: streaming them or sharding them with FSDP
    best, tried = search(read_model_shape(str(CONFIGS / "qwen3-30b-a3b")), NF4, Setup(2, 8), card, max_gpus=2)
    assert best is not None and tried
    assert not any(e.setup.streams_weights or (e.setup.gpus > 1 and e.setup.sharding in ("fsdp", "zero3")) for e in tried)


def test_zero_terms_partition_what_each_stage_partitions(tmp_path):
    cfg = recipe_for("llama-3-8b", tmp_path)
    base = setup_of(cfg, gpus=2)
    shape, gpu = read_model_shape(str(CONFIGS / "llama-3-8b")), find_gpu("rtx4090")
    r = RecipeFacts.from_config(cfg, "bf16")
    ddp, z2, z3, z3_off = (
        estimate(shape, r, replace(base, **knobs), gpu)
        for knobs in (
            {},
            {"sharding": "zero2"},
            {"sharding": "zero3"},
            {"sharding": "zero3", "cpu_offload": True, "optimizer_offload": True},
        )
    )
    # ZeRO-2: optimizer state and gradients halved on 2 GPUs, weights whole, no DDP buckets.
    assert z2.component("optimizer_state") == ddp.component("optimizer_state") // 2
    assert z2.component("gradients") == ddp.component("gradients") // 2 and z2.component("ddp_buckets") == 0
    assert z2.component("weights_quantized") == ddp.component("weights_quantized")
    # ZeRO-3: the weights too, embeddings and head included (FSDP keeps those whole).
    assert z3.component("weights_quantized") == ddp.component("weights_quantized") // 2
    assert z3.component("weights_unquantized") == ddp.component("weights_unquantized") // 2
    # Offloaded: no weight or optimizer state on the GPU; they are in host RAM (per process, 2 processes).
    assert z3_off.component("weights_quantized") == z3_off.component("optimizer_state") == 0
    assert z3_off.host_ram_parts["fsdp_shards"] > 0 and z3_off.host_ram_parts["optimizer"] == z3_off.trainable_params // 2 * 16
    assert z3_off.peak_bytes < z3.peak_bytes and z2.peak_bytes < ddp.peak_bytes


def test_zero3_start_from_the_whole_model_bounds_the_peak_whatever_the_offload(tmp_path):
    # 70B in 4-bit is ~37 GiB: ZeRO-3 builds its engine from all of it on each GPU before partitioning.
    cfg = recipe_for("llama-3-70b", tmp_path, batch_size=1, grad_accum=16)
    off = replace(setup_of(cfg, gpus=8), sharding="zero3", cpu_offload=True, optimizer_offload=True)
    a100 = find_gpu("a100-80gb")
    e = plan_recipe(cfg, a100, gpus=8, setup=off)
    one = plan_recipe(cfg, a100, gpus=1)
    whole = sum(one.component(k) for k in ("weights_quantized", "quant_constants", "weights_unquantized"))
    assert e.peak_phase == "start" and e.peak_allocated_bytes == whole and whole > 35 * GiB
    assert any(n.startswith("ZeRO-3 starts from the whole model on each GPU") for n in e.notes)
    fsdp = plan_recipe(cfg, a100, gpus=8, setup=replace(off, sharding="fsdp", optimizer_offload=False))
    assert fsdp.peak_bytes < e.peak_bytes  # FSDP loads in CPU RAM and moves only its shards


def test_plan_on_two_gpus_shows_ddp_fsdp_and_zero_side_by_side(tmp_path, capsys):
    src = tmp_path / "r.yaml"
    src.write_text(
        yaml.safe_dump({"model": {"path": str(CONFIGS / "llama-3-8b")}, "data": {"path": "x.jsonl"}, "output_dir": "o"})
    )
    assert main(["plan", str(src), "--gpu", "rtx4090", "--gpus", "2"]) == 0
    table = capsys.readouterr().out.split("strategies on 2 GPUs")[1].splitlines()[1:]
    labels = [row.split(" peak ")[0].strip() for row in table]
    assert labels == [
        "ddp",
        "fsdp",
        "fsdp cpu_offload",
        "deepspeed zero2",
        "deepspeed zero2 offload_optimizer=cpu",
        "deepspeed zero3",
        "deepspeed zero3 offload_optimizer+params=cpu",
        "2 tensor-parallel ranks",  # then the layouts the model splits into (32 layers, 32 heads, 8 key/value heads)
        "pipeline 2 stages",
    ]
    assert main(["plan", str(src), "--gpu", "rtx4090", "--gpus", "2", "--json"]) == 0
    side = json.loads(capsys.readouterr().out)["strategies"]
    assert side["deepspeed zero2"]["peak_bytes"] < side["ddp"]["peak_bytes"]
