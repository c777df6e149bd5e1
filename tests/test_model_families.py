"""Model families beyond Llama train with the shipped settings: tiny random-init models of
each architecture, built from transformers configs with the test tokenizer (no hub)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_char_tokenizer

from finetune.config import build_recipe
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
