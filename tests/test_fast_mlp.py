"""model.kernels=finetune's gated MLP block (finetune/model/fast_mlp.py): down(act(gate(x)) * up(x)) over LoRA'd 4-bit
projections as one node computes what peft over bitsandbytes computes (the output, the input's and all six adapter
matrices' gradients; dropout on, double quant on; fp32, and bf16 under autocast both ways peft casts), keeping fewer
tensors for backward; a down-adapter dropout mask left out of backward, or a wrong activation gradient, fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_char_tokenizer, build_tiny_llama
from test_fast_lora import _recipe

from finetune.config.schema import build_recipe
from finetune.model import fast_lora, fast_mlp
from finetune.trainer import Trainer

NAMES = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fast-mlp")
    build_tiny_llama(d, vocab_size=len(build_char_tokenizer(d)), hidden=128, layers=2)
    return d


def _first_mlp(recipe_dict, model, tmp_path):
    trainer = Trainer(build_recipe(_recipe(recipe_dict, model, tmp_path / "run")), progress=False)
    trainer.setup()
    mlp = next(m for m in trainer.model.modules() if hasattr(m, "gate_proj") and hasattr(m, "act_fn"))
    for name in NAMES:  # B is zero at init: give it values, so that B's role shows in every gradient
        torch.nn.init.normal_(getattr(mlp, name).lora_B["default"].weight, std=0.05)
    return mlp


def _pass(mlp, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """(output, input gradient, each adapter matrix's gradient) of one training call of the MLP."""
    mlp.train()
    x = x.clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the three adapters' dropout draws
    y = mlp(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    grads = [getattr(mlp, n).lora_A["default"].weight.grad.clone() for n in NAMES]
    grads += [getattr(mlp, n).lora_B["default"].weight.grad.clone() for n in NAMES]
    return [y.detach(), x.grad, *grads]


WHAT = ("output", "input gradient", *(f"{n} A gradient" for n in NAMES), *(f"{n} B gradient" for n in NAMES))


def _compare(fused, eager, rtol, atol):
    for f, e, what in zip(fused, eager, WHAT, strict=True):
        assert f.dtype == e.dtype, what
        torch.testing.assert_close(f, e, rtol=rtol, atol=atol, msg=what)


@pytest.mark.parametrize("mode", ["fp32", "bf16 autocast", "bf16 under CUDA's autocast"])
def test_the_mlp_block_computes_what_peft_over_bitsandbytes_computes(recipe_dict, tiny, tmp_path, monkeypatch, mode):
    mlp = _first_mlp(recipe_dict, tiny, tmp_path)
    assert mlp.down_proj.lora_dropout["default"].p == 0.1 and mlp.gate_proj.base_layer.weight.quant_state.nested
    x = torch.randn(2, 5, mlp.gate_proj.base_layer.in_features)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=mode != "fp32")
    if mode == "bf16 under CUDA's autocast":  # peft (and the block) then leave the adapter's input uncast
        real = torch.is_autocast_enabled
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: real(*device) if device else True)
    with autocast:
        eager = _pass(mlp, x, seed=3)
        assert fast_lora.install(mlp) == 3 and fast_mlp.install(mlp) == 1 and fast_mlp.install(mlp) == 0
        fused = _pass(mlp, x, seed=3)
    if mode == "fp32":
        _compare(fused, eager, rtol=1e-5, atol=1e-6)
    else:  # sums of bf16 products in another order than autograd's
        _compare(fused, eager, rtol=2e-2, atol=2e-3)
    mlp.eval()  # outside training, the model's own forward runs (peft's layers)
    with torch.no_grad():
        assert torch.equal(mlp(x), type(mlp).forward(mlp, x))


@pytest.mark.parametrize("broken", ["dropout mask left out of backward", "activation gradient of silu(e) taken as 1"])
def test_a_broken_block_fails_the_comparison(recipe_dict, tiny, tmp_path, monkeypatch, broken):
    mlp = _first_mlp(recipe_dict, tiny, tmp_path)
    x = torch.randn(2, 5, mlp.gate_proj.base_layer.in_features)
    eager = _pass(mlp, x, seed=3)
    if broken == "dropout mask left out of backward":
        dropped = fast_mlp._dropped
        monkeypatch.setattr(fast_mlp, "_dropped", lambda h, t, b, mask=None, scale_only=False: dropped(h, t, b, mask, scale_only) if mask is None else (h, mask))  # fmt: skip
    else:
        monkeypatch.setattr(torch.ops.aten, "silu_backward", lambda g, e: g)
    fast_lora.install(mlp)
    fast_mlp.install(mlp)
    fused = _pass(mlp, x, seed=3)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-6)  # forward untouched
    with pytest.raises(AssertionError):
        _compare(fused, eager, rtol=1e-5, atol=1e-6)


def test_the_block_keeps_fewer_tensors_for_backward(recipe_dict, tiny, tmp_path):
    # peft keeps act(e) and the down adapter's dropped input besides e and g (on a CPU its dropout's noise as floats
    # too); the block recomputes them, keeping its dropout mask as bytes.
    mlp = _first_mlp(recipe_dict, tiny, tmp_path)
    x = torch.randn(2, 5, mlp.gate_proj.base_layer.in_features, requires_grad=True)
    wide = mlp.gate_proj.base_layer.out_features

    def kept_bytes() -> int:
        seen: dict[int, int] = {}

        def pack(t):
            if t.shape[-1] == wide and t.numel() == 2 * 5 * wide:  # (not the down adapter's A)
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.manual_seed(3)
            mlp(x).sum().backward()
        return sum(seen.values())

    mlp.train()
    eager = kept_bytes()
    fast_lora.install(mlp)
    fast_mlp.install(mlp)
    fused = kept_bytes()
    row = 2 * 5 * wide * 4  # one fp32 [tokens x intermediate] tensor
    assert eager >= 5 * row and fused == 2 * row + 2 * 5 * wide  # e, g and a bool mask


def test_projections_whose_weights_lost_their_quantization_state_still_run_the_block(recipe_dict, tiny, tmp_path, monkeypatch):
    # FSDP's all-gather hands each projection a plain Parameter (the state waits on the module): repaired before the
    # block reads it, or every FSDP call would quietly run peft's forward (the same numbers, none of the savings).
    mlp = _first_mlp(recipe_dict, tiny, tmp_path)
    x = torch.randn(2, 5, mlp.gate_proj.base_layer.in_features)
    eager = _pass(mlp, x, seed=3)
    fast_lora.install(mlp)
    fast_mlp.install(mlp)
    for name in NAMES:
        base = getattr(mlp, name).base_layer
        base.quant_state = base.weight.quant_state
        base.weight = torch.nn.Parameter(base.weight.data, requires_grad=False)
    calls, block = [], fast_mlp.GatedMlpOver4bit.apply
    monkeypatch.setattr(fast_mlp.GatedMlpOver4bit, "apply", lambda *a: calls.append(1) or block(*a))
    _compare(_pass(mlp, x, seed=3), eager, rtol=1e-5, atol=1e-6)
    assert calls == [1]
