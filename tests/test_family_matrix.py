"""Every popular dense family trains, packs and merges: a tiny random-init model of each (built from its
transformers config with the test tokenizer, no hub) trains 3 QLoRA steps unpacked and packed (under sdpa
and under varlen, with equal losses), its packed logits equal each example's alone, and its merged export
passes the merge check. (Llama: test_trainer /
test_export; the MoE families: test_model_families.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ALPACA_ROWS, assert_packed_logits_match_each_example, build_char_tokenizer, write_jsonl

from finetune.config.schema import build_recipe
from finetune.errors import ModelError
from finetune.metrics import read_metrics
from finetune.trainer import Trainer

# family: (config class, model class, its own config keys). 2 layers, hidden 64, 4 heads of 16, GQA 2.
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 64}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "logits_scaling": 2.0}),
}


def build_tiny(family: str, out):
    import transformers

    config_cls, model_cls, own = FAMILIES[family]
    tok = build_char_tokenizer(out)
    cfg = getattr(transformers, config_cls)(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # adapters and 4-bit rounding then move the logits well past the merge tolerance
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **own,
    )
    torch.manual_seed(0)
    getattr(transformers, model_cls)(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, tmp_path_factory):
    """3 QLoRA steps of one family, unpacked, packed, and packed under model.attn_implementation=varlen
    (all-linear, dropout 0.1, checkpointing all)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model_dir = build_tiny(family, tmp / "model")
    rows = write_jsonl(tmp / "train.jsonl", ALPACA_ROWS[:24])
    runs = {}
    for name, packing, attention in (("unpacked", False, "auto"), ("packed", True, "auto"), ("varlen", True, "varlen")):
        cfg = build_recipe(
            {
                "model": {"path": str(model_dir), "attn_implementation": attention},
                "data": {"path": str(rows), "format": "alpaca", "max_seq_len": 512, "packing": packing},
                "output_dir": str(tmp / name),
                "seed": 0,
                "precision": "fp32",
                "quant": {"bits": 4},
                "lora": {"r": 4, "alpha": 8, "dropout": 0.1},
                "train": {"max_steps": 3, "batch_size": 4, "lr": 1e-2},
                "memory": {"activation_checkpointing": "all"},
                "report": {"plot": False},
            }
        )
        trainer = Trainer(cfg, progress=False)
        try:
            runs[name] = (trainer, trainer.train())
        except ModelError as refused:  # varlen refuses attention it does not compute (Gemma 2's softcapping)
            runs[name] = (None, refused)
    return family, runs


def test_family_trains_unpacked_and_packed(trained):
    family, runs = trained
    for name, (_, result) in [(n, r) for n, r in runs.items() if n != "varlen"]:
        losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
        assert len(losses) == 3 and all(0 < x < 20 for x in losses), (family, name, losses)
    # 4 packed rows a step hold about twice the examples of 4 unpacked ones: more trained tokens.
    assert runs["packed"][1].trained_tokens > runs["unpacked"][1].trained_tokens > 0, family


def test_family_packed_logits_equal_each_example_alone(trained):
    family, runs = trained
    assert_packed_logits_match_each_example(runs["packed"][0], family)


def test_family_packed_rows_under_varlen_train_like_sdpa_or_are_refused(trained):
    family, runs = trained
    trainer, result = runs["varlen"]
    if family == "gemma2":
        assert isinstance(result, ModelError) and "attn_logit_softcapping" in str(result)
        return
    steps = lambda r: [x["loss"] for x in read_metrics(r.metrics_path) if "loss" in x]  # noqa: E731
    assert steps(result) == pytest.approx(steps(runs["packed"][1]), rel=1e-5), family
    assert_packed_logits_match_each_example(trainer, family)


def test_family_merged_export_passes_the_merge_check(trained, tmp_path):
    from finetune.export.run import export_run

    family, runs = trained
    meta = export_run(runs["unpacked"][1].output_dir, tmp_path / "merged", merge=True, dtype="fp32", say=lambda _: None).metadata
    check = meta["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-5 and check["adapter_effect"] > 1e-3, (family, check)
    # every linear of the 2 layers quantized, round-tripped and merged: 7 each (Phi-3 fuses qkv and gate_up: 4)
    assert meta["merge"]["requantized"] == meta["merge"]["merged"] == 2 * (4 if family == "phi3" else 7), (family, meta["merge"])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == family.replace("gemma3", "gemma3_text")
