"""benchmarks/step_profile.py: each op of a step goes to the part of the module it ran in, its backward too."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import load_benchmark

bench = load_benchmark("step_profile.py")


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        q = self.q_proj(x)[None]
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)[0]


class Block(torch.nn.Module):
    """A decoder-like block: an attention module (its q projection, then sdpa), a norm, the head."""

    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.norm = torch.nn.LayerNorm(32)
        self.lm_head = torch.nn.Linear(32, 11, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.self_attn(x)))


def test_a_steps_ops_go_to_the_part_of_the_module_that_ran_them_forward_and_backward():
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = get_peft_model(Block(), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    labelled = bench.Labelled(model)
    x = torch.randn(6, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(x)
        torch.nn.functional.cross_entropy(logits, torch.arange(6) % 11).backward()
    labelled.remove()
    seconds, names = bench.parts_of(prof.events(), device=False)
    mm = {part: Counter(n for n in ops if n in ("aten::mm", "aten::addmm")) for part, ops in names.items()}
    # LoRA: A and B forward (2 mm), each one's weight gradient and input gradient backward (4 mm)
    assert sum(mm["LoRA"].values()) == 6
    # the frozen base projection: its forward (addmm, with bias) and its input's gradient (mm): no weight gradient
    assert mm["base matmuls"] == Counter({"aten::addmm": 1, "aten::mm": 1})
    # the head is the loss's: its forward and its input's gradient (peft freezes its weight)
    assert mm["loss (head + cross-entropy)"] == Counter({"aten::mm": 2})
    assert any("scaled_dot_product" in n for n in names["attention"])
    assert any("layer_norm" in n for n in names["norms, rope, activations, elementwise"])  # the block's `norm`
    assert any("log_softmax" in n for n in names["loss (head + cross-entropy)"])
    assert all(s >= 0 for s in seconds.values())
    rows = bench.table(seconds, wall=sum(seconds.values()) + 0.5)
    assert [p for p, _, _ in rows] == [*bench.PARTS, bench.OVERHEAD] and rows[-1][1] == pytest.approx(0.5)


def test_the_demos_modules_are_labelled_by_their_names_and_kinds():
    names = {
        "base_model.model.model.layers.0": "layer",
        "base_model.model.model.layers.0.self_attn": "attention",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer": "base",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default": "lora",
        "base_model.model.model.layers.0.mlp.down_proj.lora_dropout.default": "lora",
        "base_model.model.model.norm": "layer",
        "base_model.model.model.embed_tokens": "layer",
        "base_model.model.lm_head": "head",
        "base_model.model.model.layers.0.mlp": None,
    }
    for name, label in names.items():
        assert bench.scope_of(name, torch.nn.Identity()) == label, name
    wrapper = torch.nn.Identity()
    wrapper.lora_A = torch.nn.ModuleDict()  # peft's LoRA layer around a base: its own ops (casts, the sum) are LoRA's
    assert bench.scope_of("base_model.model.model.layers.0.self_attn.q_proj", wrapper) == "lora"
