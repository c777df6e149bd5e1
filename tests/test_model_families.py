"""Model families beyond Llama train with the shipped settings: tiny random-init models of
each architecture, built from transformers configs with the test tokenizer (no hub)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_packed_logits_match_each_example, build_char_tokenizer

from finetune.config.schema import build_recipe
from finetune.errors import ModelError
from finetune.metrics import read_metrics
from finetune.trainer import Trainer


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    d = tmp_path_factory.mktemp("tiny_gemma2")
    tok = build_char_tokenizer(d)
    cfg = Gemma2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Gemma2ForCausalLM(cfg).save_pretrained(d)
    return d


def cfg_for(recipe_dict, model_dir, out, **model):
    data = json.loads(json.dumps(recipe_dict))
    data["model"] = {"path": str(model_dir), **model}
    data["output_dir"] = str(out)
    data["report"] = {"plot": False}
    data["train"]["max_steps"] = 3
    return build_recipe(data)


def test_gemma2_trains_with_attention_auto_and_says_it_fell_back(recipe_dict, tiny_gemma2, tmp_path, capsys):
    # Gemma 2 does not support sdpa: auto (the default) loads it with eager and says so once.
    result = Trainer(cfg_for(recipe_dict, tiny_gemma2, tmp_path / "auto"), progress=False).train()
    out = capsys.readouterr().out
    assert out.count("Gemma2ForCausalLM does not support sdpa attention; using eager") == 1
    losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    # The soft-capped head goes through the chunked loss the same way (transform per chunk).
    chunked = cfg_for(recipe_dict, tiny_gemma2, tmp_path / "chunked")
    chunked = chunked.model_copy(update={"memory": chunked.memory.model_copy(update={"loss": "chunked", "loss_chunk": 16})})
    trainer = Trainer(chunked, progress=False)
    again = trainer.train()
    assert trainer.loss_fn.chunked_batches == 3 and trainer.loss_fn.chunk_rows == 16  # the probe found soft-capping right
    assert [r["loss"] for r in read_metrics(again.metrics_path) if "loss" in r] == pytest.approx(losses, rel=1e-5)


def test_an_attention_the_model_lacks_is_named_with_the_fix(recipe_dict, tiny_gemma2, tmp_path):
    with pytest.raises(ModelError) as err:
        Trainer(cfg_for(recipe_dict, tiny_gemma2, tmp_path / "sdpa", attn_implementation="sdpa"), progress=False).train()
    assert "model.attn_implementation=sdpa" in str(err.value) and "model.attn_implementation=auto" in str(err.value)


def test_llama_keeps_sdpa_under_auto(recipe_dict, tiny_model_dir, tmp_path):
    trainer = Trainer(cfg_for(recipe_dict, tiny_model_dir, tmp_path / "llama"), progress=False)
    trainer.setup()
    assert trainer.model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- mixture of experts (Qwen3-MoE, Mixtral)

MOE_FAMILIES = ["qwen3_moe", "mixtral"]


def build_tiny_moe(family: str, out):
    """A random 2-layer MoE (4 experts, 2 active) with the char tokenizer. initializer_range 0.1: the
    4-bit experts' rounding and the adapters move the logits far beyond the merge check's tolerance."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_char_tokenizer(out)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        initializer_range=0.1,
        router_aux_loss_coef=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if family == "qwen3_moe":
        cfg, cls = (
            Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, intermediate_size=128, head_dim=16, **common),
            Qwen3MoeForCausalLM,
        )
    else:
        cfg, cls = MixtralConfig(num_local_experts=4, intermediate_size=48, **common), MixtralForCausalLM
    torch.manual_seed(0)
    cls(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny_moe(request, tmp_path_factory):
    return request.param, build_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))


def moe_recipe(recipe_dict, model_dir, out, target, **data):
    cfg = json.loads(json.dumps(recipe_dict))
    cfg.update(model={"path": str(model_dir)}, output_dir=str(out), report={"plot": False}, quant={"bits": 4})
    cfg["data"].update(eval_fraction=0.0, **data)
    cfg["lora"].update(target=target, dropout=0.1)  # dropout on the linears; none inside the experts (peft cannot)
    cfg["train"].update(max_steps=3, lr=1e-2)
    return build_recipe(cfg)


@pytest.fixture(scope="module")
def trained_moe(tiny_moe, tmp_path_factory):
    """3 QLoRA steps of each MoE family, unpacked with LoRA on attention and every expert, and packed with all-linear."""
    from conftest import ALPACA_ROWS, write_jsonl

    family, model_dir = tiny_moe
    tmp = tmp_path_factory.mktemp(f"{family}_runs")
    data = {
        "model": {},
        "data": {"path": str(write_jsonl(tmp / "train.jsonl", ALPACA_ROWS[:24])), "format": "alpaca", "max_seq_len": 256},
    }
    base = {**data, "seed": 0, "precision": "fp32", "lora": {"r": 4, "alpha": 8}, "train": {"batch_size": 4}}
    base["memory"] = {"activation_checkpointing": "all"}  # recomputation re-dequantizes the experts: that path too
    runs = {}
    for name, target, extra in [
        ("experts", ["q_proj", "k_proj", "v_proj", "o_proj", "experts"], {}),
        ("packed", "all-linear", {"packing": True, "max_seq_len": 512}),
    ]:
        trainer = Trainer(moe_recipe(base, model_dir, tmp / name, target, **extra), progress=False)
        runs[name] = (trainer, trainer.train())
    return family, model_dir, runs


def test_moe_trains_qlora_with_4bit_experts_a_frozen_router_and_lora_on_the_experts(trained_moe):
    from finetune.export.merge import expert_loras
    from finetune.model import moe

    family, _, runs = trained_moe
    for name, (trainer, result) in runs.items():
        losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
        assert len(losses) == 3 and all(0 < x < 20 for x in losses), (family, name, losses)
        assert trainer.loss_fn.aux_coef == 0.02  # the load-balancing loss was added (its value: the test below)
        model = trainer.model
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trained and not any(".gate." in n or "router" in n for n in trained), "the router must stay frozen"
        assert all(".lora_" in n for n in trained)
        # every expert is 4-bit: the module holds a placeholder without memory outside a forward
        fused = moe.fused_expert_params(model)
        assert len(fused) == 4 and all(m._parameters[a].stride() == (0, 0, 0) for m, a in fused.values())
        assert moe.packed_bytes(model) < sum(m._parameters[a].numel() for m, a in fused.values())  # < 1 byte/param
        on_experts = [n for n in trained if ".experts." in n]
        assert bool(on_experts) == (name == "experts")
    # The merge's per-expert A/B reproduce what peft adds to each expert's slice (get_delta_weight).
    model = runs["experts"][0].model
    loras = expert_loras(model)
    wrappers = {
        f"{moe.plain_name(n)}.{m.parameter_name}": m for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"
    }
    assert set(wrappers) == set(loras) and len(loras) == 4
    for name, wrapper in wrappers.items():
        delta = torch.stack([x.scale * x.B @ x.A for x in loras[name]])
        torch.testing.assert_close(delta, wrapper.get_delta_weight("default"), rtol=1e-5, atol=1e-7)
        assert float(delta.abs().max()) > 1e-4, name  # the experts' adapters trained


def test_moe_packed_logits_equal_each_example_alone(trained_moe):
    family, _, runs = trained_moe
    assert_packed_logits_match_each_example(runs["packed"][0], family)


def test_moe_merged_export_passes_the_merge_check_only_with_the_experts_round_trip(trained_moe, tmp_path):
    from finetune.export.run import export_run, read_adapter, reference, stream_merge, verify
    from finetune.runs.open import open_run

    family, model_dir, runs = trained_moe
    cpu, run = torch.device("cpu"), runs["experts"][1].output_dir  # LoRA on attention and on every expert
    meta = export_run(run, tmp_path / "merged", merge=True, device=cpu, say=lambda _: None).metadata
    check = meta["verification"]
    assert check["passed"] and check["distinguishes_unmerged"] and check["max_abs_diff"] < 1e-5, (family, check)
    # 8 attention linears (2 layers) and 4 fused expert parameters: each round-tripped, each adapted
    assert meta["merge"]["requantized"] == meta["merge"]["merged"] == 8 + 4
    if family != "qwen3_moe":
        return  # the round trip below is the same code for every family; once is enough
    # Merged into the 16-bit experts (no 4-bit round trip of the fused parameters), the check fails:
    # the merge is exact because of the round trip, not because the tolerance is loose.
    ref = reference(open_run(run), cpu)
    out = tmp_path / "no-roundtrip"
    out.mkdir()
    plain = {k: q for k, q in ref.quantized.items() if ".experts." not in k}
    stream_merge(model_dir, out, torch.float32, read_adapter(open_run(run).weights_dir), plain, ref.expert_lora, family)
    for f in ("config.json", "generation_config.json"):
        (out / f).write_text((model_dir / f).read_text())
    assert not verify(ref, out, "fp32")["passed"]


def test_moe_load_balancing_loss_is_added_as_transformers_adds_it(tiny_moe, tokenizer):
    from transformers import AutoModelForCausalLM

    from finetune.objectives.loss import CausalLMLoss

    family, model_dir = tiny_moe
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    ids = [tokenizer("Q: 2 + 2?\nA: 4")["input_ids"], tokenizer("Q: 10?\nA: 1 0 yes")["input_ids"]]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    labels = torch.where(mask.bool(), input_ids, -100)
    labels[:, :4] = -100  # a masked prompt
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    torch.manual_seed(0)
    hf = model(input_ids=input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
    aux = model.config.router_aux_loss_coef * float(hf.aux_loss.detach())
    assert aux > 1e-3  # large enough that leaving it out fails the comparison below
    for loss_fn in (CausalLMLoss(), CausalLMLoss(chunk_rows=4)):  # the target-only head and the chunked one
        total, n = loss_fn(model, batch)
        assert loss_fn.aux_coef == model.config.router_aux_loss_coef and n == int((labels[:, 1:] != -100).sum())
        assert float(total.detach()) / n == pytest.approx(float(hf.loss.detach()), rel=1e-5), family  # mean CE + coef * aux


@pytest.mark.parametrize("method", ["dora", "pissa"])
def test_lora_on_the_experts_names_the_methods_peft_cannot_apply_there(recipe_dict, method):
    from finetune.errors import ConfigError

    data = {**recipe_dict, "lora": {"method": method, "target": ["q_proj", "experts"]}}
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert f"lora.method={method} cannot adapt MoE experts" in str(err.value) and "lora.method=lora or rslora" in str(err.value)
