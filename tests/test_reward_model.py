"""A reward model as a GRPO reward (objectives/reward_model.py): the scores of a tiny sequence classifier read back
against its own forward (chat template or plain text), in 4 bits, the errors that name it, and inside a GRPO
sampling (one call a micro-batch, its scores in the metrics)."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD_ID, build_char_tokenizer
from test_grpo import grpo_recipe

from finetune.config.schema import build_recipe
from finetune.config.sections import RewardSpec
from finetune.errors import ConfigError, ModelError, RewardError
from finetune.objectives.reward_model import RewardModel
from finetune.objectives.rewards import from_spec
from finetune.trainer import Trainer


def _classifier(out, labels: int = 1, template: bool = True):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_char_tokenizer(out, chat_template=None if not template else build_char_tokenizer.__defaults__[0])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=labels, pad_token_id=PAD_ID)  # fmt: skip
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    return out


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "plain"])
def test_each_completion_scored_as_the_classifier_reads_prompt_and_reply(tmp_path, template):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = _classifier(tmp_path, template=template)
    scores = RewardModel(str(path), None, 64)(["4", "five", "4"], [{"prompt": "2+2?"}, {"prompt": "2+2?"},
                                                                   {"prompt": [{"role": "user", "content": "2+2?"}]}])  # fmt: skip
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    if template:
        texts = [tok.apply_chat_template([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": c}],
                                         tokenize=False) for c in ("4", "five")]  # fmt: skip
        assert texts[0].startswith("<|im_start|>user\n2+2?<|im_end|>")
        enc = [tok(t, add_special_tokens=False, return_tensors="pt") for t in texts]
    else:
        enc = [tok(t, return_tensors="pt") for t in ("2+2?4", "2+2?five")]
    with torch.no_grad():
        alone = [float(model(**e).logits[0, 0]) for e in enc]  # each row alone: no padding to see past
    assert scores[0] == pytest.approx(alone[0], abs=1e-5) and scores[1] == pytest.approx(alone[1], abs=1e-5)
    assert scores[0] != pytest.approx(scores[1])
    if template:
        assert scores[2] == pytest.approx(scores[0], abs=1e-6)  # messages or text: the same conversation


def test_a_row_longer_than_max_length_loses_its_prompts_start_never_the_completion_and_says_so(tmp_path):
    path = _classifier(tmp_path)
    judge = RewardModel(str(path), None, 24)
    long_prompt = [{"prompt": "Say a number. " * 10}] * 3
    with pytest.warns(UserWarning, match=r"longer than max_length=24: the reward model reads its last 24"):
        scores = judge(["4", "five", "six"], long_prompt)
    assert len(set(scores)) == 3  # each completion still read (a cut end would score the prompt alone, all alike)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        judge(["4"], long_prompt[:1])  # said once


def test_a_reward_model_in_4_bits_and_the_errors_that_name_it(tmp_path):
    import bitsandbytes as bnb

    path = _classifier(tmp_path / "one")
    four = RewardModel(str(path), 4, 64)
    assert all(abs(s) < 1e3 for s in four(["4", "5"], [{"prompt": "2+2?"}] * 2))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in four.model.modules())
    two = RewardModel(str(_classifier(tmp_path / "two", labels=2)), None, 64, "train.rewards[0]")
    with pytest.raises(RewardError, match=r"train.rewards\[0\] \(model\): .* has 2 outputs; a reward model has one"):
        two(["4"], [{"prompt": "2+2?"}])
    with pytest.raises(ModelError, match="cannot load a sequence-classification model"):
        RewardModel(str(tmp_path / "missing"), None, 64)(["4"], [{"prompt": "q"}])
    with pytest.raises(ConfigError, match=r"\(model\) needs `path`"):
        from_spec(RewardSpec(name="model"))


def test_grpo_scores_a_micro_batch_with_the_reward_model_in_one_call(recipe_dict, tmp_path, monkeypatch):
    path = _classifier(tmp_path / "rm")
    calls: list[list[float]] = []
    call = RewardModel.__call__
    monkeypatch.setattr(RewardModel, "__call__", lambda self, c, r: calls.append(call(self, c, r)) or calls[-1])
    data = grpo_recipe(recipe_dict, tmp_path, rewards=[{"name": "model", "path": str(path), "weight": 0.5}], batch_size=2)
    trainer = Trainer(build_recipe(data | {"output_dir": str(tmp_path / "run")}), progress=False)
    trainer.setup()
    batch = trainer.loss_fn.sample(trainer.parallel.unwrap(trainer.model), trainer.step_batches(0)[0])
    assert len(calls) == 1 and len(calls[0]) == 2 * 4  # one call for the micro-batch's 8 completions
    sums = batch["sample_sums"]
    assert sums["rewards/model"] == pytest.approx(sum(calls[0]), rel=1e-5)
    assert sums["reward"] == pytest.approx(0.5 * sum(calls[0]), rel=1e-5)  # its weight
    trainer.close()
