"""finetune plan: exact parameter counts, the search, the written recipe, bad input, preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.config import build_recipe, load_recipe
from finetune.errors import GpuError, PlanError
from finetune.gpus import GiB, find_gpu, parse_bytes
from finetune.plan import (
    KNOBS, Recipe, Setup, candidates, estimate, fit, plan_recipe, preflight_memory, quantized_bytes, read_model_shape,
)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"

# Parameter counts the model cards publish (safetensors metadata), reproduced from config.json alone.
PUBLISHED_PARAMS = {
    "llama-2-7b": 6_738_415_616, "llama-2-70b": 68_976_648_192, "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
}


def recipe_for(model: str, tmp_path, **train) -> object:
    return build_recipe({
        "model": {"path": str(CONFIGS / model)}, "data": {"path": "d.jsonl", "max_seq_len": train.pop("seq", 2048)},
        "output_dir": str(tmp_path / "run"), "train": {"batch_size": 4, "grad_accum": 4, **train},
    })


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
    r = Recipe(4, True, 16, "all-linear", 0.05, False, 2)
    gpu = find_gpu("a100-80gb")
    peak = lambda **kw: estimate(shape, r, Setup(**{"batch_size": 1, "grad_accum": 1, **kw}), gpu).peak_bytes
    assert peak(batch_size=2) > peak(batch_size=1)
    assert peak(seq_len=4096) > peak(seq_len=2048)
    assert peak(gradient_checkpointing=False) > 2 * peak(gradient_checkpointing=True)
    fast = estimate(shape, r, Setup(batch_size=1, grad_accum=8, gradient_checkpointing=False), gpu)
    slow = estimate(shape, r, Setup(batch_size=1, grad_accum=8, gradient_checkpointing=True), gpu)
    assert slow.step_time_s > fast.step_time_s * 1.2  # checkpointing replays the forward


def test_search_keeps_the_global_batch_and_knobs_are_setup_fields():
    base = Setup(batch_size=4, grad_accum=4, gpus=2)
    found = candidates(base, max_gpus=2)
    assert all(s.global_batch == 32 for s in found)
    assert {s.gpus for s in found} == {1, 2} and {s.gradient_checkpointing for s in found} == {False, True}
    assert all(hasattr(base, k.name) for k in KNOBS)


def test_fit_writes_a_runnable_recipe_that_fits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "r.yaml"
    text = Path(__file__).parents[1].joinpath("recipes", "qlora-1x24gb.yaml").read_text()
    src.write_text(text)
    out = tmp_path / "fitted.yaml"
    code = main(["plan", str(src), f"model.path={CONFIGS / 'qwen2.5-7b'}", "train.batch_size=8", "train.grad_accum=2",
                 "--gpu", "rtx4090", "--fit", "--out", str(out), "--json"])
    assert code == 0
    written = out.read_text()
    assert written.startswith(f"# finetune run {out}\n")
    for line in written.splitlines():  # every key line carries a comment
        s = line.strip()
        if ":" in s and not s.startswith("#") and not s.endswith(":") and not s.startswith("description"):
            assert "#" in s, line
    cfg = load_recipe(out)
    assert cfg.model.path == str(CONFIGS / "qwen2.5-7b")
    assert cfg.train.batch_size * cfg.train.grad_accum == 16  # global batch kept
    assert plan_recipe(cfg, find_gpu("rtx4090")).fits
    assert not plan_recipe(load_recipe(src, [f"model.path={CONFIGS / 'qwen2.5-7b'}", "train.batch_size=8", "train.grad_accum=2"]),
                           find_gpu("rtx4090")).fits


def test_plan_json_is_one_object_in_bytes(tmp_path, capsys):
    src = tmp_path / "r.yaml"
    src.write_text(yaml.safe_dump({"model": {"path": str(CONFIGS / "mistral-7b")}, "data": {"path": "x.jsonl"}, "output_dir": "o"}))
    assert main(["plan", str(src), "--gpu", "l4", "--gpus", "1", "--host-ram", "16GB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"] == "l4" and isinstance(d["peak_bytes"], int) and isinstance(d["fits"], bool)
    assert {"weights_quantized", "lora_weights", "optimizer_state", "activations", "logits_loss", "cuda_context"} <= set(d["components"])
    assert d["host_ram_fits"] is True and d["step_time_s"] > 0


def test_unknown_gpu_lists_known_and_suggests_the_closest():
    with pytest.raises(GpuError) as err:
        find_gpu("rtx4080")
    assert "rtx4090" in str(err.value) and "did you mean 'rtx4090'" in str(err.value) and "--gpu-mem" in str(err.value)
    assert find_gpu("4090").name == "rtx4090" and find_gpu("RTX 3090").name == "rtx3090"
    assert find_gpu(None, "11GB").memory_bytes == 11 * GiB and parse_bytes("1.5 GiB") == int(1.5 * GiB)


def test_device_names_map_to_the_catalogue():
    from finetune.gpus import gpu_for_device

    for name, key in [("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
                      ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA L4", "l4"),
                      ("NVIDIA A10G", "a10g"), ("Tesla T4", "t4")]:
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
    assert main(["plan", shipped, "--gpu", "rtx4090"]) == 2  # Qwen/Qwen2.5-7B: no network, not cached
    assert "cannot read config.json of 'Qwen/Qwen2.5-7B'" in capsys.readouterr().err


def test_nothing_fits_says_the_minimum(tmp_path):
    cfg = recipe_for("llama-2-70b", tmp_path)
    with pytest.raises(PlanError) as err:
        fit(cfg, find_gpu("rtx3060"), max_gpus=1)
    msg = str(err.value)
    assert "the smallest needs" in msg and "--gpu-mem" in msg and "weights alone take" in msg


def test_fit_shards_and_offloads_a_70b_over_two_small_cards(tmp_path):
    # Two 12 GB cards: only FSDP with the shards in host RAM fits a 4-bit 70B.
    from finetune.plan import changes_of

    cfg = recipe_for("llama-2-70b", tmp_path)
    current, best = fit(cfg, find_gpu("rtx3060"), max_gpus=2)
    assert (best.setup.gpus, best.setup.sharding, best.setup.cpu_offload) == (2, "fsdp", True)
    assert best.fits and best.host_ram_bytes > 2 * 17 * 2**30  # each process holds half the 4-bit weights in RAM
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
    assert "fits as: train.batch_size=" in problems[0] and "--skip-memory-check" in problems[0]
    problems, notes = preflight_memory(cfg, refuse=False)
    assert not problems and "more than 1.1" in notes[0]
    ok = recipe_for("llama-2-7b", tmp_path, batch_size=1, grad_accum=16, seq=1024)
    problems, notes = preflight_memory(ok)
    assert not problems and "per GPU of 12.00 GiB" in notes[0]
