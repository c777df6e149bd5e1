"""model.kernels (finetune/model/kernels.py): when liger's kernels are chosen, what is refused and how,
and what finetune hands liger's per-family function.

The CPU tests here never run liger: they drive stand-ins with the signatures of liger's
apply_liger_kernel_to_* functions, so they check finetune's own logic only (what it passes, what it
refuses, the classes it puts back afterwards). liger's real kernels are Triton (CUDA only): their
training equality is the `gpu` test at the end, with liger-kernel from `pip install 'finetune[gpu]'`
(benchmarks/gpu_session.sh installs it on a lease)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.config.schema import build_recipe
from finetune.errors import ConfigError, ModelError
from finetune.metrics import read_metrics
from finetune.model import kernels
from finetune.trainer import Trainer

FAMILIES = {"llama": object(), "qwen2": object()}


def test_auto_picks_the_models_own_modules_until_a_lease_measures_a_kernel_set_faster():
    assert kernels.AUTO_ON_CUDA == "none"  # (session 14's lease: liger undecided within the noise)
    assert kernels.choose("auto", "cuda", "llama", FAMILIES) == "none"
    assert kernels.choose("auto", "cpu", "llama", FAMILIES) == "none"


def test_auto_set_to_liger_picks_it_only_on_cuda_when_installed_for_a_known_family(monkeypatch):
    monkeypatch.setattr(kernels, "AUTO_ON_CUDA", "liger")
    assert kernels.choose("auto", "cuda", "llama", FAMILIES) == "liger"
    assert kernels.choose("auto", "cpu", "llama", FAMILIES) == "none"  # never on a CPU
    assert kernels.choose("auto", "cuda", "llama", None) == "none"  # not installed
    assert kernels.choose("auto", "cuda", "phi", FAMILIES) == "none"  # a family liger does not know
    assert kernels.choose("none", "cuda", "llama", FAMILIES) == "none"
    assert kernels.choose("liger", "cuda", "qwen2", FAMILIES) == "liger"


@pytest.mark.parametrize(
    "device,model_type,families,said",
    [
        ("cpu", "llama", FAMILIES, "Triton, CUDA only; this run is on cpu. Fix: use model.kernels=auto"),
        ("cuda", "llama", None, "liger-kernel is not installed. Fix: pip install 'finetune[gpu]'"),
        ("cuda", "phi", FAMILIES, "no kernels for model_type 'phi' (it has: llama, qwen2)"),
    ],
)
def test_liger_says_what_is_missing(device, model_type, families, said):
    with pytest.raises(ConfigError) as err:
        kernels.choose("liger", device, model_type, families)
    assert said in str(err.value) and "model.kernels=liger" in str(err.value)


def test_liger_gets_the_base_model_and_only_the_pieces_its_function_takes(monkeypatch, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    calls = []

    def stand_in_for_llama(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
    ):
        calls.append(dict(rope=rope, ce=cross_entropy, flce=fused_linear_cross_entropy, rms=rms_norm, swiglu=swiglu, model=model))

    monkeypatch.setattr(kernels, "liger_families", lambda: {"llama": stand_in_for_llama})
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules="all-linear"))
    assert kernels.apply_kernels(peft_model, "auto", "cpu") == "none" and calls == []
    assert kernels.apply_kernels(peft_model, "auto", "cuda") == "none" and calls == []  # (AUTO_ON_CUDA)
    assert kernels.apply_kernels(peft_model, "liger", "cuda") == "liger"
    # liger's defaults but its loss pieces (a new model.forward): off
    assert calls == [dict(rope=True, ce=False, flce=False, rms=True, swiglu=True, model=base)]


def test_a_model_loaded_after_liger_gets_its_own_modules(monkeypatch, tiny_model_dir):
    # liger swaps classes in transformers' modeling module for the whole process (seen on an H100: a
    # kernels=none run after an auto one got LigerSwiGLUMLP); finetune puts the classes back at once.
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    class FusedMLP(torch.nn.Module):
        pass

    def rope(*args, **kwargs):
        return None

    def stand_in_for_llama(model=None):  # what liger's function does, both ways
        monkeypatch.setattr(modeling_llama, "LlamaMLP", FusedMLP)
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope)
        model.model.layers[0].mlp.fused = True  # its per-instance patch of the model in hand

    own = modeling_llama.LlamaMLP
    monkeypatch.setattr(kernels, "liger_families", lambda: {"llama": stand_in_for_llama})
    first = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert kernels.apply_kernels(first, "liger", "cuda") == "liger" and first.model.layers[0].mlp.fused
    assert modeling_llama.LlamaMLP is own and modeling_llama.apply_rotary_pos_emb is rope
    later = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(later.model.layers[0].mlp) is own


def test_an_moe_model_keeps_its_experts_and_a_failing_patch_is_said(monkeypatch, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, vocab_size=64)  # fmt: skip
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **shape))
    calls = []

    def stand_in_for_qwen3_moe(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                        swiglu=True, model=None):  # fmt: skip
        calls.append(dict(rope=rope, swiglu=swiglu, flce=fused_linear_cross_entropy))

    def stand_in_for_glm4(rope=False, fused_linear_cross_entropy=True, model=None):
        raise NotImplementedError("liger_rotary_pos_emb is not available for Glm4 models.")

    families = {"qwen3_moe": stand_in_for_qwen3_moe, "glm4": stand_in_for_glm4}
    monkeypatch.setattr(kernels, "liger_families", lambda: families)
    assert kernels.apply_kernels(moe, "liger", "cuda") == "liger"
    assert calls == [dict(rope=True, swiglu=False, flce=False)]
    glm4 = AutoModelForCausalLM.from_config(AutoConfig.for_model("glm4", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                                 num_attention_heads=2, num_key_value_heads=1, vocab_size=64, pad_token_id=0))  # fmt: skip
    with pytest.raises(ModelError, match="patch for model_type 'glm4' failed: liger_rotary_pos_emb") as err:
        kernels.apply_kernels(glm4, "liger", "cuda")
    assert "model.kernels=none" in err.value.hint


def test_liger_on_a_cpu_run_stops_before_anything_is_written(recipe_dict, tmp_path):
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(tmp_path / "run"))
    data["model"] = {**data["model"], "kernels": "liger"}
    with pytest.raises(ConfigError, match="CUDA only"):
        Trainer(build_recipe(data), progress=False).train()
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_liger_kernels_train_like_the_model_own_modules(recipe_dict, tmp_path):
    # GPU only: liger-kernel's kernels are Triton. Needs the [gpu] extra.
    pytest.importorskip("liger_kernel", reason="model.kernels=liger needs pip install 'finetune[gpu]' (CUDA only)")

    def run(setting):
        # fp32 and clipping off: the fused kernels' forward and backward against the modules', step by step (bf16's
        # rounding, rel 2e-2, would hide a wrong backward).
        data = json.loads(json.dumps(recipe_dict))
        data.update(output_dir=str(tmp_path / setting), report={"plot": False}, precision="fp32")
        data["model"] = {**data["model"], "kernels": setting}
        data["train"].update(max_steps=3, max_grad_norm=None)
        trainer = Trainer(build_recipe(data), progress=False)
        trainer.train()
        mlp = trainer.accelerator.unwrap_model(trainer.model).get_base_model().model.layers[0].mlp
        rows = [r for r in read_metrics(tmp_path / setting / "metrics.jsonl") if "loss" in r]
        return [(r["loss"], r["grad_norm"]) for r in rows], mlp._get_name()

    plain, plain_name = run("none")  # first: liger's patch of the modeling module is process-wide
    fused, name = run("liger")
    assert name == "LigerSwiGLUMLP" and plain_name == "LlamaMLP"
    assert len(fused) == len(plain) == 3
    assert [loss for loss, _ in fused] == pytest.approx([loss for loss, _ in plain], rel=1e-4)
    assert [norm for _, norm in fused] == pytest.approx([norm for _, norm in plain], rel=1e-3)
    assert torch.cuda.is_available()
