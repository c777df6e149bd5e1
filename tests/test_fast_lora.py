"""model.kernels=finetune (finetune/model/fast_lora.py): each LoRA'd 4-bit linear as one autograd function computes what
peft over bitsandbytes computes (forward, the input's, A's and B's gradients; dropout on, double quant on); a whole
run under it is the eager run step by step; a dropped scale or a transposed B fails the comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_char_tokenizer, build_tiny_llama

from finetune.config.schema import build_recipe
from finetune.metrics import read_metrics
from finetune.model import fast_lora, fast_mlp
from finetune.trainer import Trainer

FAMILIES = ("demo", "qwen2", "gemma2", "phi3")  # demo: the bundled Llama; gemma2: GELU-tanh; phi3: fused qkv, gate_up


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fast-lora")
    build_tiny_llama(d, vocab_size=len(build_char_tokenizer(d)), hidden=128, layers=2)
    return d


def _recipe(recipe_dict: dict, model: Path | str, out: Path, **changes) -> dict:
    data = json.loads(json.dumps(recipe_dict))
    data["model"]["path"] = str(model)
    data["output_dir"] = str(out)
    data["quant"] = {"bits": 4, "double_quant": True}
    data["lora"] = {"r": 8, "alpha": 16, "dropout": 0.1, "target": "all-linear"}
    data["train"].update(max_steps=3, batch_size=2, grad_accum=2)
    for key, value in changes.items():
        section, _, field = key.partition("__")
        data.setdefault(section, {})[field] = value
    return data


def _layer_pass(layer, x: torch.Tensor, seed: int):
    """(output, input gradient, A's and B's gradients) of one training call of a LoRA'd 4-bit linear."""
    layer.train()
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout's draws
    y = layer(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return y.detach(), x.grad, a.grad.clone(), b.grad.clone()


def _fused_layers(recipe_dict, tiny, tmp_path):
    trainer = Trainer(build_recipe(_recipe(recipe_dict, tiny, tmp_path / "run")), progress=False)
    trainer.setup()
    from peft.tuners.lora.bnb import Linear4bit

    layers = [m for m in trainer.model.modules() if isinstance(m, Linear4bit)]
    for m in layers:  # B is zero at init: give it values, so that B's role shows in every gradient
        torch.nn.init.normal_(m.lora_B["default"].weight, std=0.05)
    return layers


def test_one_lora_4bit_linear_computes_what_peft_over_bitsandbytes_computes(recipe_dict, tiny, tmp_path):
    layers = _fused_layers(recipe_dict, tiny, tmp_path)
    assert len(layers) == 2 * 7 and all(m.base_layer.weight.quant_state.nested for m in layers)  # double quant
    for layer in (layers[0], layers[6]):  # q_proj (128 -> 128) and down_proj (344 -> 128)
        x = torch.randn(2, 5, layer.base_layer.in_features)
        eager = _layer_pass(layer, x, seed=3)
        assert fast_lora.install(layer) == 1 and fast_lora.install(layer) == 0  # once
        fused = _layer_pass(layer, x, seed=3)
        for e, f, what in zip(eager, fused, ("output", "input gradient", "A gradient", "B gradient"), strict=True):
            torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-6, msg=what)  # (bitwise equal on this CPU)
        layer.eval()  # outside training, peft's own forward runs
        with torch.no_grad():
            assert torch.equal(layer(x), type(layer).forward(layer, x))


@pytest.mark.parametrize(
    "broken",
    ["scale dropped", "B transposed"],
)
def test_a_broken_fused_layer_fails_the_comparison(recipe_dict, tiny, tmp_path, monkeypatch, broken):
    layers = _fused_layers(recipe_dict, tiny, tmp_path)
    layer = layers[0]
    x = torch.randn(2, 5, layer.base_layer.in_features)
    eager = _layer_pass(layer, x, seed=3)
    apply = fast_lora.LoraOver4bit.apply
    if broken == "scale dropped":
        monkeypatch.setattr(fast_lora.LoraOver4bit, "apply", lambda *a: apply(*a[:-1], 1.0))
    else:  # B used as its transpose (a square adapter shape would hide it: q_proj's B is 128 x 8, A 8 x 128)
        monkeypatch.setattr(fast_lora.LoraOver4bit, "apply", lambda *a: apply(*a[:5], a[6].t(), a[5].t(), a[7]))
    fast_lora.install(layer)
    fused = _layer_pass(layer, x, seed=3)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-6)


def _steps(out: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_under_the_fused_layers_is_the_eager_run_step_by_step(recipe_dict, tmp_path, monkeypatch, family):
    from peft.tuners.lora.bnb import Linear4bit
    from test_family_matrix import build_tiny

    monkeypatch.setattr(fast_mlp, "worth_it", lambda device_type: True)  # the CUDA choice: the MLP blocks too
    blocks, block = [0], fast_mlp.GatedMlpOver4bit.apply  # the MLP blocks' calls (under the recipe's tiled MLP)
    monkeypatch.setattr(fast_mlp.GatedMlpOver4bit, "apply", lambda *a: blocks.__setitem__(0, blocks[0] + 1) or block(*a))
    model = "asset:tiny-llama" if family == "demo" else build_tiny(family, tmp_path / family)
    runs = {}
    for kernels in ("none", "finetune"):
        cfg = build_recipe(_recipe(recipe_dict, model, tmp_path / kernels, model__kernels=kernels))
        trainer = Trainer(cfg, progress=False)
        trainer.train()
        runs[kernels] = _steps(tmp_path / kernels)
        if kernels == "finetune":
            lora = [m for m in trainer.model.modules() if isinstance(m, Linear4bit)]
            assert lora and all(getattr(m.forward, "__func__", None) is fast_lora._fused_forward for m in lora)
            assert (blocks[0] == 0) == (family == "phi3")  # phi3: one gate_up projection, not the block's form
    assert len(runs["none"]) == 3
    for (loss_e, norm_e), (loss_f, norm_f) in zip(runs["none"], runs["finetune"], strict=True):
        assert loss_f == pytest.approx(loss_e, rel=1e-5) and norm_f == pytest.approx(norm_e, rel=1e-5)


def test_a_profile_splits_the_fused_node_into_the_base_matmul_and_the_adapter(recipe_dict, tiny, tmp_path):
    # One autograd node runs both: its ranges (forward and backward) give benchmarks/step_profile.py the parts.
    from conftest import load_benchmark
    from torch.profiler import ProfilerActivity, profile

    bench = load_benchmark("step_profile.py")
    layer = _fused_layers(recipe_dict, tiny, tmp_path)[0]
    fast_lora.install(layer)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _layer_pass(layer, torch.randn(2, 5, layer.base_layer.in_features), seed=3)
    _, names = bench.parts_of(prof.events(), device=False)
    # the 4-bit matmul forward (bitsandbytes' gemm dequantizes inside it on a CPU) and the input's gradient backward
    assert names["base matmuls"].count("bitsandbytes::gemm_4bit") == 1 and names["base matmuls"].count("aten::mm") == 2
    assert names["4-bit dequantization"].count("bitsandbytes::dequantize_4bit") == 2  # once forward, once backward
    assert names["LoRA"].count("aten::mm") == 2 + 4  # forward: A, B; backward: their weight gradients, their inputs'


def test_a_weight_that_lost_its_quantization_state_is_repaired_first(recipe_dict, tiny, tmp_path, monkeypatch):
    # FSDP's all-gather hands the layer a plain Parameter: bitsandbytes repairs it from the module before the fused
    # path reads the state (it raised "'Parameter' object has no attribute 'quant_state'", seen under FSDP on 2).
    layer = _fused_layers(recipe_dict, tiny, tmp_path)[0]
    x = torch.randn(2, 5, layer.base_layer.in_features)
    eager = _layer_pass(layer, x, seed=3)
    fast_lora.install(layer)
    base = layer.base_layer
    base.quant_state = base.weight.quant_state  # what FSDP's units keep (bitsandbytes' repair reads it there)
    base.weight = torch.nn.Parameter(base.weight.data, requires_grad=False)
    assert not hasattr(base.weight, "quant_state")
    calls, fused = [], fast_lora.LoraOver4bit.apply
    monkeypatch.setattr(fast_lora.LoraOver4bit, "apply", lambda *a: calls.append(1) or fused(*a))
    torch.testing.assert_close(_layer_pass(layer, x, seed=3)[0], eager[0], rtol=1e-5, atol=1e-6)
    assert calls == [1]  # the fused node ran (peft's forward would give the same numbers)


def test_the_packed_weight_is_saved_where_checkpointing_can_drop_it(recipe_dict, tiny, tmp_path):
    # A ctx attribute would keep every (streamed) layer's weight alive from forward to backward; saved as a tensor,
    # activation checkpointing's hooks see it (memory/stream.py's _Saved4bitMatmul, for the same reason).
    layer = _fused_layers(recipe_dict, tiny, tmp_path)[0]
    fast_lora.install(layer)
    seen: list[int] = []
    x = torch.randn(2, 5, layer.base_layer.in_features, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.untyped_storage().data_ptr()) or t, lambda t: t):
        y = layer(x)
    assert layer.base_layer.weight.untyped_storage().data_ptr() in seen
    y.sum().backward()


def test_inside_cudas_autocast_the_adapters_input_is_not_cast_as_in_peft(recipe_dict, tiny, tmp_path, monkeypatch):
    # peft casts the adapter's input to its dtype only where torch.is_autocast_enabled() (CUDA's) is false; the fused
    # path follows it. CUDA's answer faked on this CPU, under the CPU's autocast: both paths take the other branch.
    layer = _fused_layers(recipe_dict, tiny, tmp_path)[0]
    x = torch.randn(2, 5, layer.base_layer.in_features, dtype=torch.bfloat16)
    real = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: real(*device) if device else True)
    with torch.autocast("cpu", torch.bfloat16):
        eager = _layer_pass(layer, x, seed=3)
        fast_lora.install(layer)
        fused = _layer_pass(layer, x, seed=3)
    for e, f, what in zip(eager, fused, ("output", "input gradient", "A gradient", "B gradient"), strict=True):
        assert e.dtype == f.dtype, what
        torch.testing.assert_close(f, e, rtol=1e-2, atol=1e-3, msg=what)  # (bitwise here)
